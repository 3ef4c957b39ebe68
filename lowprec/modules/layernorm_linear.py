"""LayerNormLinear: a LayerNorm/RMSNorm followed by a quantized Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compile import compiled_as_one_op
from ..fused import graph_norm, producer_kernel
from ..linear import decided_delayed_linear, quantized_linear, traced
from ..recipe import torch_autocast_dtype
from . import tensor_parallel as tpar
from .base import LowprecModule
from .norms import (
    check_eps,
    check_normalization,
    make_norm_params,
    norm_into_gemm,
    norm_output_grad,
    reset_norm_params,
)
from .params import add_linear_params, release_fprop_copy


class LayerNormLinear(LowprecModule):
    """``Linear(norm(x))``; parameters ``layer_norm_weight``, ``layer_norm_bias``
    (LayerNorm only), ``weight`` and ``bias``.

    Tensor parallel: ``parallel_mode="column"`` only (the norm needs whole rows); with
    ``sequence_parallel`` the norm runs on this rank's rows and its output is gathered.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, name: str | None = None, parallel_mode: str | None = None,
                 tp_group=None, sequence_parallel: bool = False, output_quantizer_role=None,
                 grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        tp_size = tpar.check_parallel_args(parallel_mode, tp_group, sequence_parallel,
                                           modes=("column",), module="LayerNormLinear")
        self._tp = tpar.make_tensor_parallel(parallel_mode, tp_group, sequence_parallel, tp_size)
        tpar.check_boundary_roles(self._tp, row_output=False,
                                  column_grad_input=grad_input_quantizer_role is not None)
        self.normalization = check_normalization(normalization)
        self.in_features, self.out_features, self.eps = in_features, out_features, check_eps(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        dtype = params_dtype or torch.get_default_dtype()
        make_norm_params(self, in_features, normalization, zero_centered_gamma=zero_centered_gamma,
                         dtype=dtype, device=device, prefix="layer_norm_")
        add_linear_params(self, "weight", "bias",
                          tpar.shard_size(out_features, tp_size, "out_features"), in_features,
                          bias=bias, dtype=dtype, device=device)
        self._maybe_quantize_weights()

    def reset_parameters(self) -> None:
        reset_norm_params(self, "layer_norm_", self.zero_centered_gamma)
        super().reset_parameters()

    def compiled_output_shapes(self, x: torch.Tensor) -> list[tuple]:
        rows = tpar.output_rows(self._tp, x.shape[0], "column")
        y = (rows, *x.shape[1:-1], self.weight.shape[0])
        return [y, tuple(x.shape)] if self.return_layernorm_output else [y]

    def traced_forward(self, x: torch.Tensor):
        """The call as torch.compile traces it: the norm as one op around eager's own
        computation (``lowprec.fused.graph``), then the linear traced as ``Linear``'s
        (``lowprec.linear.traced``; tensor-parallel, between its collectives); the reason
        (a string) where it stays one opaque op (under torch.autocast, the norm's output in
        the autocast dtype as eager's)."""
        tp, w = self._tp, self.weight
        if self.traced_plain_call(x, w):  # no quantizer: eager's unfused norm
            ln = tpar.graph_norm_rows(self, tp, x)
            y = tpar.traced_split(tp, ln, self.bias, lambda a, b: F.linear(a, w, b))
            return (y, ln) if self.return_layernorm_output else y
        ln_grad = norm_output_grad(self, x)
        if tp is None:
            # decided outside dynamo from x's metadata, before the norm is traced (a refusal
            # leaves nothing traced)
            decided = self.traced_decision(x, w, self.bias, ln_grad)
            if decided is not None:
                return self._decided_forward(x, decided)
        got = self.traced_quantizers(x, w)
        if isinstance(got, str):
            return got
        (q,), mode, delayed = got
        if tp is None and delayed is not None:
            decided = decided_delayed_linear(q, x, w, self.bias, delayed, ln_grad)
            if decided is not None:
                return self._decided_forward(x, decided, delayed)
        plan = traced.planned(q, mode, tpar.gemm_input_like(tp, x), w, self.bias,
                              input_grad=ln_grad)
        refused = traced.refusal(plan, delayed)
        if refused is not None:
            return refused
        if tp is None:
            ln = self._graph_norm(x, q.input, mode)
            y = traced.traced_linear(q, mode, ln, w, self.bias, delayed, plan)
        else:  # the norm on this rank's rows, then replicated or gathered
            ln = tpar.graph_norm_rows(self, tp, x)
            y = tpar.traced_split(tp, ln, self.bias, lambda a, b: traced.traced_linear(
                q, mode, a, w, b, delayed, plan))
        return (y, ln) if self.return_layernorm_output else y

    def _decided_forward(self, x: torch.Tensor, decided, delayed=None):
        """The call with its GEMM's ``Decision`` (one node; the reason, a string, where it
        stays opaque, given before the norm is traced)."""
        if isinstance(decided.plan, str):
            return decided.plan
        ln = self._graph_norm(x, decided.q.input, decided.mode)
        y = decided.call(ln, self.weight, self.bias, delayed)
        return (y, ln) if self.return_layernorm_output else y

    def _graph_norm(self, x: torch.Tensor, quantizer, mode: str) -> torch.Tensor:
        # eager fuses the norm into the quantize unless it returns the norm output
        return graph_norm(self, x, kernel=not self.return_layernorm_output
                          and producer_kernel(x, quantizer, mode), dtype=torch_autocast_dtype(x))

    @compiled_as_one_op
    def forward(self, x: torch.Tensor):
        self._check_input_dtype(x, self.in_features)
        qs, mode, done = self.gemm_quantizers(x.device)
        q = qs[0] if qs else None
        if self._tp is not None:
            return self._forward_tensor_parallel(x, q, mode, done)
        # return_layernorm_output needs the high-precision norm output: no fusion then.
        ln_out = norm_into_gemm(self, x, q, mode, self.weight,
                                fuse=not self.return_layernorm_output)
        y = quantized_linear(ln_out, self.weight, self.bias, quantizers=q, backward_mode=mode,
                             on_backward_done=done)
        if self.return_layernorm_output:
            return y, ln_out
        release_fprop_copy(ln_out, mode)
        return y

    def _forward_tensor_parallel(self, x, q, mode, done):
        # The norm runs apart, in high precision, on the rows this rank holds; its output
        # is then replicated (its gradient summed over the group before the norm's
        # backward) or gathered.
        ln_out = tpar.norm_rows(self, self._tp, x)
        y = tpar.column_linear(self._tp, ln_out, self.weight, self.bias, q, mode, done)
        return (y, ln_out) if self.return_layernorm_output else y
