"""LayerNormLinear: a LayerNorm/RMSNorm followed by a quantized Linear."""

from __future__ import annotations

import torch

from ..compiled_call import compiled_as_one_op
from ..linear_fn import quantized_linear
from .base import LowprecModule, add_linear_params, check_parallel_args, release_fprop_copy
from .norms import check_normalization, make_norm_params, norm_into_gemm, reset_norm_params


class LayerNormLinear(LowprecModule):
    """``Linear(norm(x))``; parameters ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``weight`` and ``bias``."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, name: str | None = None, parallel_mode: str | None = None,
                 tp_group=None, sequence_parallel: bool = False, output_quantizer_role=None,
                 grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        check_parallel_args(parallel_mode, tp_group, sequence_parallel)
        self.normalization = check_normalization(normalization)
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        dtype = params_dtype or torch.get_default_dtype()
        make_norm_params(self, in_features, normalization, zero_centered_gamma=zero_centered_gamma,
                         dtype=dtype, device=device, prefix="layer_norm_")
        add_linear_params(self, "weight", "bias", out_features, in_features, bias=bias, dtype=dtype,
                          device=device)
        self._maybe_quantize_weights()

    def reset_parameters(self) -> None:
        reset_norm_params(self, "layer_norm_", self.zero_centered_gamma)
        super().reset_parameters()

    def compiled_output_shapes(self, x: torch.Tensor) -> list[tuple]:
        y = (*x.shape[:-1], self.out_features)
        return [y, tuple(x.shape)] if self.return_layernorm_output else [y]

    @compiled_as_one_op
    def forward(self, x: torch.Tensor):
        self._check_input_dtype(x)
        qs, mode, done = self.gemm_quantizers(x.device)
        q = qs[0] if qs else None
        # return_layernorm_output needs the high-precision norm output: no fusion then.
        ln_out = norm_into_gemm(self, x, q, mode, self.weight,
                                fuse=not self.return_layernorm_output)
        y = quantized_linear(ln_out, self.weight, self.bias, quantizers=q, backward_mode=mode,
                             on_backward_done=done)
        if self.return_layernorm_output:
            return y, ln_out
        release_fprop_copy(ln_out, mode)
        return y
