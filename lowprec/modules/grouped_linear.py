"""GroupedLinear: num_gemms independent Linears over consecutive row groups of one input."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compile import compiled_as_one_op
from ..formats import QuantizedTensor
from ..linear import (
    LinearQuantizers,
    check_sizes,
    grouped_linear,
    grouped_refusal,
    per_group_equivalent,
    traced,
)
from .base import LowprecModule
from .params import add_linear_params, check_parallel_args


class GroupedLinear(LowprecModule):
    """``forward(x, m_splits)``: rows ``x[s_i : s_i + m_splits[i]]`` go through GEMM ``i``
    with ``weight{i}`` / ``bias{i}``; the outputs are concatenated in order.

    Each group is quantized on its own rows, so the result equals one
    :class:`Linear` per group with the same weights.
    """

    module_type = "grouped_linear"

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device=None, name: str | None = None,
                 parallel_mode: str | None = None, tp_group=None, sequence_parallel: bool = False,
                 output_quantizer_role=None, grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        check_parallel_args(parallel_mode, tp_group, sequence_parallel)
        if not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            add_linear_params(self, f"weight{i}", f"bias{i}", out_features, in_features, bias=bias,
                              dtype=dtype, device=device)
        self._maybe_quantize_weights()

    def _gemm_names(self) -> list[str]:
        return [self.name] * self.num_gemms

    def _boundary(self, i: int, fwd: bool):
        # Every group's output and grad-input cross the module boundary.
        return self.output_quantizer_role if fwd else self.grad_input_quantizer_role

    def _weight_names(self) -> list[str]:
        return [f"weight{i}" for i in range(self.num_gemms)]

    def output_shape(self, shape: tuple) -> tuple:
        """The output shape for an input of ``shape`` (as an op of a Sequential)."""
        return (*shape[:-1], self.out_features)

    def compiled_output_shapes(self, x: torch.Tensor, m_splits) -> list[tuple]:
        return [self.output_shape(tuple(x.shape))]

    def traced_forward(self, x: torch.Tensor, m_splits):
        """The call as torch.compile traces it, or the reason (a string) it stays one
        opaque op. Where ``grouped_linear`` takes a grouped path (no bias, one quantizer
        setting, see ``grouped_refusal``): eager's autograd Function over custom ops.
        Where it gives one Linear a group's bits and the sizes are Python ints: each group
        as a traced ``Linear`` (``lowprec.linear.traced``), an empty group as torch's
        linear (zero gradients, as eager's); a group that refuses leaves only dead ops
        before the opaque op."""
        self._check_input_dtype(x, self.in_features)
        weights = [getattr(self, name) for name in self._weight_names()]
        bias = self._biases()
        got = self.traced_grouped_quantizers(x, *weights)
        if isinstance(got, str):
            return got
        qs, mode = got
        x2d = x.reshape(-1, x.shape[-1])
        refused = grouped_refusal(x2d, weights, qs, bias, mode)  # biases refuse
        if refused is None:
            return grouped_linear(x, weights, m_splits, bias, quantizers=qs, backward_mode=mode)
        if not per_group_equivalent(x2d, weights, qs, bias, mode):
            return refused
        if isinstance(m_splits, torch.Tensor):
            return "group sizes in a tensor: one Linear a group reads them on the host"
        if not isinstance(m_splits, (list, tuple)) or not all(
                isinstance(m, int) for m in m_splits):
            return f"group sizes of type {type(m_splits).__name__}"
        sizes = list(m_splits)
        check_sizes(sizes, self.num_gemms, x2d.shape[0])
        outs = []
        for g, xg in enumerate(torch.split(x2d, sizes)):
            b, w = None if bias is None else bias[g], weights[g]
            if qs is None or xg.shape[0] == 0:
                if isinstance(w, QuantizedTensor):
                    return "an empty group of a quantized weight"
                # no recipe, or no rows: torch's linear
                outs.append(F.linear(xg, w, b))
                continue
            y = traced.traced_linear(qs if isinstance(qs, LinearQuantizers) else qs[g], mode,
                                     xg, w, b)
            if isinstance(y, str):
                return y
            outs.append(y)
        return torch.cat(outs).reshape(*x.shape[:-1], self.out_features)

    def _biases(self) -> list | None:
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return None if biases[0] is None else biases

    @compiled_as_one_op
    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        self._check_input_dtype(x, self.in_features)
        qs, mode, done = self.gemm_quantizers(x.device)
        weights = [getattr(self, name) for name in self._weight_names()]
        return grouped_linear(x, weights, m_splits, self._biases(), quantizers=qs,
                              backward_mode=mode, on_backward_done=done)
