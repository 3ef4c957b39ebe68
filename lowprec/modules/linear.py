"""lowprec.Linear: y = x W^T + b with quantized GEMMs under autocast."""

from __future__ import annotations

import torch

from ..compiled_call import compiled_as_one_op
from ..linear_fn import quantized_linear
from .base import LowprecModule, add_linear_params, check_parallel_args


class Linear(LowprecModule):
    """Drop-in ``torch.nn.Linear`` whose GEMMs follow the active lowprec recipe.

    Outside :func:`lowprec.autocast` it computes in high precision. Under
    :func:`lowprec.quantized_model_init` its weight is kept quantized.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device=None, name: str | None = None,
                 parallel_mode: str | None = None, tp_group=None, sequence_parallel: bool = False,
                 output_quantizer_role=None, grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        check_parallel_args(parallel_mode, tp_group, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        dtype = params_dtype or torch.get_default_dtype()
        add_linear_params(self, "weight", "bias", out_features, in_features, bias=bias, dtype=dtype,
                          device=device)
        self._maybe_quantize_weights()

    def compiled_output_shapes(self, x: torch.Tensor) -> list[tuple]:
        return [(*x.shape[:-1], self.out_features)]

    @compiled_as_one_op
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dtype(x)
        qs, mode, done = self.gemm_quantizers(x.device)
        return quantized_linear(x, self.weight, self.bias, quantizers=qs[0] if qs else None,
                                backward_mode=mode, on_backward_done=done)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}")
