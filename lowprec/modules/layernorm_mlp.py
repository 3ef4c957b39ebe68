"""LayerNormMLP: norm -> fc1 -> activation -> fc2, both GEMMs quantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fused
from ..compile import compiled_as_one_op
from ..fused import graph_activation, graph_norm, producer_kernel
from ..linear import decided_delayed_linear, quantized_linear, traced
from ..recipe import BackwardMode, torch_autocast_dtype
from . import tensor_parallel as tpar
from .activations import get_activation
from .base import LowprecModule
from .norms import (
    check_eps,
    check_normalization,
    make_norm_params,
    norm_into_gemm,
    norm_output_grad,
    reset_norm_params,
)
from .params import add_linear_params, is_count, producer_usages, release_fprop_copy


class LayerNormMLP(LowprecModule):
    """``fc2(act(fc1(norm(x))))``. Gated activations (swiglu, geglu) make fc1 2x wide.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias``, ``fc1_weight``,
    ``fc1_bias``, ``fc2_weight``, ``fc2_bias``. Roles name the GEMMs
    ``<name>.fc1`` and ``<name>.fc2``.

    Tensor parallel: over a ``tp_group`` of several ranks fc1 is column-parallel and fc2
    row-parallel (``ffn_hidden_size / tp`` on each rank); ``parallel_mode`` may be left
    None. With ``sequence_parallel`` the input and output are blocks of rows.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, *, normalization: str = "LayerNorm", activation: str = "gelu",
                 zero_centered_gamma: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, name: str | None = None, parallel_mode: str | None = None,
                 tp_group=None, sequence_parallel: bool = False, output_quantizer_role=None,
                 grad_input_quantizer_role=None) -> None:
        super().__init__(name, output_quantizer_role, grad_input_quantizer_role)
        tp_size = tpar.check_parallel_args(parallel_mode, tp_group, sequence_parallel,
                                           modes=(None, "column", "row"),
                                           module="LayerNormMLP")
        # fc1 column-parallel, fc2 row-parallel, whatever parallel_mode says
        self._tp = tpar.make_tensor_parallel("column", tp_group, sequence_parallel, tp_size)
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        tpar.check_boundary_roles(self._tp, row_output=output_quantizer_role is not None,
                                  column_grad_input=grad_input_quantizer_role is not None)
        if is_count(ffn_hidden_size) and ffn_hidden_size == 0:
            raise ValueError("LayerNormMLP: ffn_hidden_size must be >= 1, got 0 (an FFN of no "
                             "hidden features has no activation to apply)")
        ffn_local = tpar.shard_size(ffn_hidden_size, tp_size, "ffn_hidden_size")
        self.normalization = check_normalization(normalization)
        self.activation = activation
        self._act, gated = get_activation(activation)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps = check_eps(eps)
        self.zero_centered_gamma = zero_centered_gamma
        dtype = params_dtype or torch.get_default_dtype()
        make_norm_params(self, hidden_size, normalization, zero_centered_gamma=zero_centered_gamma,
                         dtype=dtype, device=device, prefix="layer_norm_")
        fc1_out = 2 * ffn_local if gated else ffn_local
        add_linear_params(self, "fc1_weight", "fc1_bias", fc1_out, hidden_size, bias=bias,
                          dtype=dtype, device=device)
        add_linear_params(self, "fc2_weight", "fc2_bias", hidden_size, ffn_local, bias=bias,
                          dtype=dtype, device=device,
                          fan_in=ffn_hidden_size if tp_size > 1 else None)
        self._maybe_quantize_weights()

    def reset_parameters(self) -> None:
        reset_norm_params(self, "layer_norm_", self.zero_centered_gamma)
        super().reset_parameters()

    def _gemm_names(self) -> list[str]:
        return [f"{self.name}.fc1", f"{self.name}.fc2"]

    def _weight_names(self) -> list[str]:
        return ["fc1_weight", "fc2_weight"]

    def compiled_output_shapes(self, x: torch.Tensor) -> list[tuple]:
        return [tuple(x.shape)]  # sequence parallel: gathered, then scattered back

    def traced_forward(self, x: torch.Tensor):
        """The call as torch.compile traces it: the norm and the activation as one op each
        around eager's own computations (``lowprec.fused.graph``), both linears traced as
        ``Linear``'s (``lowprec.linear.traced``); the reason (a string) where it stays one
        opaque op. Under torch.autocast the norm's output is in the autocast dtype, as
        eager's, and the linears cast their operands. Under delayed scaling each GEMM
        records into its slots of the module's states, and the backward state is updated
        once, after the last GEMM's backward (fc1's, or fc2's where fc1 needs no gradient),
        as eager's end-of-backward callback does. Tensor-parallel, fc1's input is replicated
        or gathered and fc2's partial outputs reduced as eager's, by the same functions
        (``tensor_parallel.traced_split``)."""
        w1, b1, w2, b2 = self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias
        tp = self._tp
        b2_gemm = b2 if tp is None else None  # a row-parallel bias follows the reduction
        if self.traced_plain_call(x, w1, w2):  # no quantizer: eager's unfused norm and activation
            h1 = tpar.traced_split(tp, tpar.graph_norm_rows(self, tp, x), b1,
                                   lambda a, b: F.linear(a, w1, b))
            y = F.linear(graph_activation(self.activation, h1, kernel=False), w2, b2_gemm)
            return y if tp is None else tpar.row_output(tp, y, b2, None, BackwardMode.DEFAULT)
        # whether fc1's output, fc2's input, needs a gradient: then fc1's backward runs,
        # after fc2's
        ln_grad = norm_output_grad(self, x)
        fc1_backward = torch.is_grad_enabled() and (
            ln_grad or any(t is not None and t.requires_grad for t in (w1, b1)))
        # fc2's input is made below: a stand-in of its shape asks its plan first (a dead
        # op in the graph); under tensor parallelism fc1 reads the gathered rows
        x_like = tpar.gemm_input_like(tp, x)
        a_like = x_like.new_empty((*x_like.shape[:-1], w2.shape[1]))
        if tp is None:
            # both GEMMs decided outside dynamo, before the norm is traced
            decided = (self.traced_decision(x, w1, b1, ln_grad),
                       self.traced_decision(a_like, w2, b2, fc1_backward))
            if all(d is not None for d in decided):
                return self._decided_forward(x, a_like, *decided)
        got = self.traced_quantizers(x, w1, w2)
        if isinstance(got, str):
            return got
        (q1, q2), mode, delayed = got
        if tp is None and delayed is not None:
            decided = (decided_delayed_linear(q1, x, w1, b1, delayed, ln_grad),
                       decided_delayed_linear(q2, a_like, w2, b2, delayed, fc1_backward))
            if all(d is not None for d in decided):
                return self._decided_forward(x, a_like, *decided, delayed, fc1_backward)
        plans = (traced.planned(q1, mode, x_like, w1, b1, input_grad=ln_grad),
                 traced.planned(q2, mode, a_like, w2, b2_gemm, input_grad=fc1_backward))
        for plan in plans:
            refused = traced.refusal(plan, delayed)
            if refused is not None:
                return refused

        def fc1(a, b):
            return traced.traced_linear(q1, mode, a, w1, b, delayed, plan=plans[0], gemm=0,
                                        updates=fc1_backward)
        if tp is None:  # eager's fused norm
            h1 = fc1(graph_norm(self, x, kernel=producer_kernel(x, q1.input, mode),
                                dtype=torch_autocast_dtype(x)), b1)
        else:
            h1 = tpar.traced_split(tp, tpar.graph_norm_rows(self, tp, x), b1, fc1)
        a = graph_activation(self.activation, h1,
                             kernel=producer_kernel(a_like, q2.input, mode))
        y = traced.traced_linear(q2, mode, a, w2, b2_gemm, delayed, plan=plans[1], gemm=1,
                                 updates=not fc1_backward)
        return y if tp is None else tpar.row_output(tp, y, b2, None, BackwardMode.DEFAULT)

    def _decided_forward(self, x, a_like, fc1, fc2, delayed=None, fc1_backward=True):
        """The call with its two GEMMs' ``Decision`` s: each one node, or the reason (a
        string) it stays opaque, given before anything is traced. Under delayed scaling
        (``delayed``) each GEMM records into its own slots of the states, and the backward
        state is updated once, by fc1's backward where it runs, else fc2's."""
        for d in (fc1, fc2):
            if isinstance(d.plan, str):
                return d.plan
        ln = graph_norm(self, x, kernel=producer_kernel(x, fc1.q.input, fc1.mode),
                        dtype=torch_autocast_dtype(x))
        h1 = fc1.call(ln, self.fc1_weight, self.fc1_bias, delayed, 0, fc1_backward)
        a = graph_activation(self.activation, h1,
                             kernel=producer_kernel(a_like, fc2.q.input, fc2.mode))
        return fc2.call(a, self.fc2_weight, self.fc2_bias, delayed, 1, not fc1_backward)

    @compiled_as_one_op
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dtype(x, self.hidden_size)
        qs, mode, done = self.gemm_quantizers(x.device)
        q1, q2 = (qs[0], qs[1]) if qs else (None, None)
        tp = self._tp
        if tp is None:
            # Norm and activation hand their GEMM its quantized input from one fused kernel
            # where the quantizer has one (lowprec.fused); else they run apart.
            h = norm_into_gemm(self, x, q1, mode, self.fc1_weight)
            h1 = quantized_linear(h, self.fc1_weight, self.fc1_bias, quantizers=q1,
                                  backward_mode=mode, on_backward_done=done)
            release_fprop_copy(h, mode)
            del h  # the norm output must not outlive fc1's forward (peak memory)
        else:
            h1 = tpar.column_linear(tp, tpar.norm_rows(self, tp, x), self.fc1_weight,
                                    self.fc1_bias, q1, mode, done)
        if (q2 is not None and fused.activation_prologue(self.activation) is not None
                and fused.can_fuse(q2.input, h1, mode)):
            a = fused.activation_then_quantize(h1, self.activation, q2.input,
                                               *producer_usages(self.fc2_weight, mode))
        else:
            a = self._act(h1)
        gq = tpar.gathered_grad_quantizer(tp, q2, mode, a, self.fc2_weight)
        y = quantized_linear(a, self.fc2_weight, self.fc2_bias if tp is None else None,
                             quantizers=q2, backward_mode=mode, on_backward_done=done)
        release_fprop_copy(a, mode)
        if tp is not None:
            y = tpar.row_output(tp, y, self.fc2_bias, gq, mode)
        return y
