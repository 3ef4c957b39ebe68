"""lowprec.Linear: y = x W^T + b with quantized GEMMs under autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compile import compiled_as_one_op
from ..linear import decided_delayed_linear, quantized_linear, traced
from ..memory import current_frame
from ..recipe import active_region, torch_autocast_dtype
from . import tensor_parallel as tpar
from .base import LowprecModule
from .params import add_linear_params


class Linear(LowprecModule):
    """Drop-in ``torch.nn.Linear`` whose GEMMs follow the active lowprec recipe.

    Outside :func:`lowprec.autocast` it computes in high precision. Under
    :func:`lowprec.quantized_model_init` its weight is kept quantized.

    ``parallel_mode="column"|"row"`` with a ``tp_group`` of several ranks splits the
    weight over them (``in_features``/``out_features`` are the whole layer's);
    ``sequence_parallel`` splits the rows of the input (column) or output (row) too. See
    ``lowprec.modules.tensor_parallel``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device=None, name: str | None = None,
                 parallel_mode: str | None = None, tp_group=None, sequence_parallel: bool = False,
                 output_quantizer_role=None, grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        tp_size = tpar.check_parallel_args(parallel_mode, tp_group, sequence_parallel,
                                           module="Linear")
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        self._tp = tpar.make_tensor_parallel(parallel_mode, tp_group, sequence_parallel, tp_size)
        row = self._tp is not None and parallel_mode == "row"
        tpar.check_boundary_roles(self._tp, row_output=row and output_quantizer_role is not None,
                                  column_grad_input=not row and grad_input_quantizer_role
                                  is not None)
        n_out = tpar.shard_size(out_features, tp_size, "out_features") if not row else out_features
        n_in = tpar.shard_size(in_features, tp_size, "in_features") if row else in_features
        dtype = params_dtype or torch.get_default_dtype()
        add_linear_params(self, "weight", "bias", n_out, n_in, bias=bias, dtype=dtype,
                          device=device, fan_in=in_features if row else None)
        self._maybe_quantize_weights()

    def _plain_call(self, x: torch.Tensor) -> bool:
        """Whether a call with no recipe is ``torch.nn.functional.linear`` as it stands: no
        tensor parallelism, plain input and weight (a quantized weight dequantizes) of one
        dtype or under ``torch.autocast`` (else the usual path says what is wrong)."""
        return (self._tp is None and type(x) is torch.Tensor
                and type(self.weight) in (torch.Tensor, torch.nn.Parameter)
                and (x.dtype == self.weight.dtype or torch_autocast_dtype(x) is not None))

    def compiled_output_shapes(self, x: torch.Tensor) -> list[tuple]:
        tp = self._tp
        rows = tpar.output_rows(tp, x.shape[0], tp.mode if tp is not None else "column")
        return [(rows, *x.shape[1:-1], self.weight.shape[0])]

    def traced_forward(self, x: torch.Tensor):
        """The call as torch.compile traces it (``lowprec.linear.traced``; a
        tensor-parallel one between its collectives, ``tensor_parallel.traced_split``), or
        the reason (a string) it stays one opaque op."""
        tp, w = self._tp, self.weight
        if tp is None and active_region() is None and current_frame() is None \
                and self._plain_call(x):
            return F.linear(x, w, self.bias)
        if tp is not None and self.traced_plain_call(x, w):
            return tpar.traced_split(tp, x, self.bias, lambda a, b: F.linear(a, w, b))
        if tp is None:
            decided = self.traced_decision(x, w, self.bias)
            if decided is not None:
                return decided.call(x, w, self.bias)
        got = self.traced_quantizers(x, w)
        if isinstance(got, str):
            return got
        (q, *_), mode, delayed = got
        if tp is None:
            if delayed is not None:
                decided = decided_delayed_linear(q, x, w, self.bias, delayed)
                if decided is not None:
                    return decided.call(x, w, self.bias, delayed)
            return traced.traced_linear(q, mode, x, w, self.bias, delayed)
        row = tp.mode == "row"
        plan = traced.planned(q, mode, tpar.gemm_input_like(tp, x), w,
                              None if row else self.bias,
                              input_grad=torch.is_grad_enabled() and x.requires_grad)
        refused = traced.refusal(plan, delayed)
        if refused is not None:
            return refused  # before any collective is traced
        return tpar.traced_split(tp, x, self.bias, lambda a, b: traced.traced_linear(
            q, mode, a, w, b, delayed, plan))

    @compiled_as_one_op
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dtype(x, self.weight.shape[-1])
        qs, mode, done = self.gemm_quantizers(x.device)
        if qs is None and self._plain_call(x):
            return F.linear(x, self.weight, self.bias)  # no recipe: what nn.Linear runs
        q = qs[0] if qs else None
        tp = self._tp
        if tp is not None and tp.mode == "row":
            y = quantized_linear(x, self.weight, None, quantizers=q, backward_mode=mode,
                                 on_backward_done=done)
            return tpar.row_output(tp, y, self.bias,
                                   tpar.gathered_grad_quantizer(tp, q, mode, x, self.weight),
                                   mode)
        return tpar.column_linear(tp, x, self.weight, self.bias, q, mode, done)

    def extra_repr(self) -> str:
        tp = "" if self._tp is None else (f", parallel_mode={self.parallel_mode!r}, "
                                          f"tp_size={self._tp.size}, "
                                          f"sequence_parallel={self.sequence_parallel}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}{tp}")
