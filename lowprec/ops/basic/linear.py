"""BasicLinear (``y = x W^T``, no bias) and Linear (BasicLinear + Bias)."""

from __future__ import annotations

import torch

from ...formats import QuantizedTensor
from ...linear import quantized_linear
from ...modules import LowprecModule, add_linear_params, check_parallel_args
from ...recipe import BackwardMode, operand_usages, torch_autocast_dtype
from ..base import BasicOperation, EmitSpec, RunContext
from .bias import bias_forward


class BasicLinear(LowprecModule, BasicOperation):
    """``y = x @ weight.T`` through :func:`lowprec.linear.function.quantized_linear`.

    A :class:`~lowprec.modules.base.LowprecModule`: roles (``module_type``
    ``linear``, forward ``[input, weight, output]``, backward
    ``[grad_output, grad_input]``), recipe state, delayed scaling, extra
    state and :func:`lowprec.quantized_model_init` weights. A quantized
    weight is consumed as it is: no usage is ever removed from it, so an
    evaluation forward under ``torch.no_grad`` leaves it ready for the next
    training step.

    Inside a :class:`~lowprec.ops.Sequential` it accepts an input that the
    previous op already quantized with this linear's input quantizer.
    """

    op_kind = "linear"
    takes_quantized_grad = True

    def __init__(self, in_features: int, out_features: int, *,
                 params_dtype: torch.dtype | None = None, device=None, name: str | None = None,
                 parallel_mode: str | None = None, tp_group=None, sequence_parallel: bool = False,
                 output_quantizer_role=None, grad_input_quantizer_role=None,
                 _with_bias: bool = False) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        check_parallel_args(parallel_mode, tp_group, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        dtype = params_dtype or torch.get_default_dtype()
        add_linear_params(self, "weight", "bias" if _with_bias else None, out_features,
                          in_features, bias=_with_bias, dtype=dtype, device=device)
        self._maybe_quantize_weights()

    # ---- what the run machinery asks of a linear -----------------------------------------
    def prepare(self, device) -> tuple:
        """(per-GEMM quantizers or None, backward mode, backward callback) for one forward."""
        return self.gemm_quantizers(device)

    def input_usages(self, prep: tuple) -> tuple[bool, bool] | None:
        """(rowwise, columnwise) usages this linear needs of its input, None outside autocast.

        Mirrors :func:`quantized_linear`: columnwise only for wgrad in the default backward
        mode, when the weight requires grad and grad mode is on (an inference forward, under
        ``torch.no_grad`` or ``torch.inference_mode``, reads the input rowwise alone).
        """
        qs, mode, _ = prep
        if qs is None:
            return None
        return operand_usages(mode, needs_dgrad=False,
                              needs_wgrad=self.weight.requires_grad
                              and torch.is_grad_enabled()).input

    def input_emit_spec(self, prep: tuple) -> EmitSpec | None:
        """How a previous op may quantize this linear's input for it (None: it may not).

        Not in ``high_precision`` backward mode: that mode saves the original input.
        """
        qs, mode, _ = prep
        if qs is None or mode == BackwardMode.HIGH_PRECISION or qs[0].input is None:
            return None
        return EmitSpec(qs[0].input, *self.input_usages(prep))

    def grad_emit_spec(self, prep: tuple, x: torch.Tensor) -> EmitSpec | None:
        """How the next op's backward may quantize this linear's grad_output for it:
        the usages its dgrad (rowwise) and wgrad (columnwise) consume, default mode only."""
        qs, mode, _ = prep
        if qs is None or mode != BackwardMode.DEFAULT or qs[0].grad_output is None:
            return None
        need_dx, need_dw = x.requires_grad, self.weight.requires_grad
        if not torch.is_grad_enabled() or not (need_dx or need_dw):
            return None
        return EmitSpec(qs[0].grad_output, need_dx, need_dw)

    def run_linear(self, x: torch.Tensor, bias: torch.Tensor | None, prep: tuple, *,
                   intermediate: bool) -> torch.Tensor:
        """``x W^T (+ bias in the GEMM)``. An ``intermediate`` quantized input (made by a
        previous op of this run, referenced nowhere else) loses its rowwise data once the
        fprop GEMM has run, when backward keeps only its columnwise data.

        An input of another dtype than the weight's is cast to it, as Transformer Engine's
        fusible ops compute in their parameters' dtype: a plain one differentiably (its
        gradient comes back in its own dtype), a quantized one in its nominal dtype only
        (lossless). Under ``torch.autocast`` the autocast dtype rules instead."""
        self._check_input_dtype(x, self.weight.shape[-1])
        if x.dtype != self.weight.dtype and torch_autocast_dtype(x) is None:
            x = x.to(self.weight.dtype)
        qs, mode, done = prep
        y = quantized_linear(x, self.weight, bias, quantizers=qs[0] if qs else None,
                             backward_mode=mode, on_backward_done=done)
        if (intermediate and qs is not None and mode == BackwardMode.DEFAULT
                and isinstance(x, QuantizedTensor)
                and x.has_usage("rowwise") and x.has_usage("columnwise")):
            x.update_usage(rowwise_usage=False)
        return y

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        prep = ctx.prep if ctx.prep is not None else self.prepare(x.device)
        return self.run_linear(x, None, prep, intermediate=ctx.intermediate)

    def output_shape(self, shape: tuple) -> tuple:
        return (*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"name={self.name!r}")


class _LinearBias:
    """The bias half of an ops.Linear as a basic part (its parameter stays on the Linear)."""

    op_kind = "bias"
    part_name = "Bias"
    num_extra_inputs = 0
    can_emit = True
    takes_quantized_grad = False

    def __init__(self, owner: "Linear") -> None:
        self.owner = owner

    @property
    def bias(self) -> torch.Tensor:
        return self.owner.bias

    def output_shape(self, shape: tuple) -> tuple:
        return shape

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        return bias_forward(x, self.bias, ctx)


class Linear(BasicLinear):
    """``BasicLinear`` + ``Bias`` as one op with parameters ``weight`` and ``bias``
    (``torch.nn.Linear`` initialization, as :class:`lowprec.Linear`).

    It runs as the fused linear+bias piece (bias added in the GEMM), so it
    gives the same result as ``lowprec.Linear(bias=True)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, _with_bias=bias, **kwargs)
        if not bias:
            self.register_parameter("bias", None)

    def basic_parts(self) -> list:
        return [self, _LinearBias(self)] if self.bias is not None else [self]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bias={self.bias is not None}"
