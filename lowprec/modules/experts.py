"""GroupedExperts: the routed experts of a mixture-of-experts layer, in low precision.

It holds the experts the way Hugging Face transformers stores them (Mixtral, Qwen3-MoE,
DeepSeek-V3 ``*Experts`` modules): ``gate_up_proj`` (E, 2I, H) whose first I rows of each
expert are the gate, ``down_proj`` (E, H, I), an activation, and
``forward(hidden_states, top_k_index, top_k_weights)``. ``convert_model`` swaps those
modules for this one, keeping the same parameter objects, so checkpoints load unchanged.

A call sorts the routed rows by expert (the token counts stay on the device), runs the
gate/up and down GEMMs through :func:`lowprec.linear.grouped.grouped_linear`, and adds each
expert's weighted output back to its token, as the transformers loop does.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..compile import compiled_as_one_op
from ..kernels.moe_route import route
from ..kernels.swiglu import silu, swiglu
from ..kernels.token_sum import gated_rows_grad, gated_runs, token_sum
from ..linear import group_alignment_for, grouped_linear, grouped_refusal
from ..recipe import init_recipe
from .base import LowprecModule


def _check_expert_ids(ids: torch.Tensor, num_experts: int) -> None:
    # transformers' expert parallelism routes foreign tokens to id E: not supported here
    msg = f"expert ids must be in [0, {num_experts}) (expert parallelism is not supported)"
    if ids.is_cuda or torch.compiler.is_compiling():
        # checked on the device (no host sync) and in a compiled graph (no graph break)
        torch._assert_async(((ids >= 0) & (ids < num_experts)).all(), msg)
    elif ids.numel() and not bool(((ids >= 0) & (ids < num_experts)).all()):
        raise ValueError(f"{msg}; got ids from {int(ids.min())} to {int(ids.max())}")


class GroupedExperts(LowprecModule):
    """``num_experts`` SwiGLU-style experts (``act_fn(gate) * up``, then down) over routed
    tokens. Each expert has its own quantizers: GEMM slots ``<name>.<e>.gate_up`` for
    experts 0..E-1, then ``<name>.<e>.down`` (``module_type`` ``grouped_linear``), so
    per-role recipes and ``lowprec compare`` see each expert."""

    module_type = "grouped_linear"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act_fn: Callable[[torch.Tensor], torch.Tensor] = nn.functional.silu, *,
                 params_dtype: torch.dtype | None = None, device=None,
                 name: str | None = None) -> None:
        super().__init__(name)
        for what, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GroupedExperts: {what} must be a positive int, got {v!r}")
        if init_recipe() is not None:
            raise ValueError("GroupedExperts keeps 3-D expert weights in high precision: build "
                             "it outside quantized_model_init")
        self.apply_gate = None
        dtype = params_dtype or torch.get_default_dtype()
        self.num_experts, self.hidden_dim, self.intermediate_dim = (num_experts, hidden_size,
                                                                   intermediate_size)
        self.act_fn = act_fn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                  dtype=dtype, device=device))
        self._init_weights()

    @classmethod
    def from_experts(cls, experts: nn.Module, name: str = "") -> "GroupedExperts":
        """A GroupedExperts holding ``experts``' own ``gate_up_proj``/``down_proj``
        parameters and activation (a transformers ``*Experts`` module)."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        new = cls.__new__(cls)
        LowprecModule.__init__(new, name)
        new.num_experts, two_i, new.hidden_dim = gate_up.shape
        new.intermediate_dim = two_i // 2
        new.act_fn = experts.act_fn
        new.gate_up_proj, new.down_proj = gate_up, down
        # the model's gating (transformers' _apply_gate: act_fn(gate) * up by default; some
        # models clamp, or run it in fp32), called on the source module it belongs to; None
        # for transformers' default, which is this module's own act_fn(gate) * up
        gating = getattr(type(experts), "_apply_gate", None)
        default = (getattr(gating, "__name__", "") == "_default_apply_gate"
                   and getattr(gating, "__module__", "") == "transformers.integrations.moe")
        new.apply_gate = None if default else getattr(experts, "_apply_gate", None)
        new.train(experts.training)
        # built here, as a constructor builds them: a compiled call would otherwise build
        # every expert's roles while dynamo traces it
        new._cache_roles()
        return new

    def _init_weights(self) -> None:
        # each expert as an nn.Linear of its shape draws its weight
        with torch.no_grad():
            for w in (self.gate_up_proj, self.down_proj):
                bound = 1 / math.sqrt(w.shape[2]) if w.shape[2] else 0.0
                w.uniform_(-bound, bound)

    def reset_parameters(self) -> None:
        super().reset_parameters()  # scaling state afresh (no 2-D weights of its own)
        self._init_weights()

    def _gemm_names(self) -> list[str]:
        e = range(self.num_experts)
        return [f"{self.name}.{i}.gate_up" for i in e] + [f"{self.name}.{i}.down" for i in e]

    def _boundary(self, i: int, fwd: bool):
        return None

    def _weight_names(self) -> list[str]:
        return []

    def _expert_weights(self) -> dict[str, range]:
        e = self.num_experts
        return {"gate_up_proj": range(0, e), "down_proj": range(e, 2 * e)}

    def compiled_output_shapes(self, hidden_states, top_k_index, top_k_weights) -> list[tuple]:
        return [tuple(hidden_states.shape)]

    def traced_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor):
        """The call as torch.compile traces it: eager's code, whose grouped paths are
        autograd Functions over custom ops, with the quantizers of the recipe's rule
        (:meth:`traced_grouped_quantizers`); or the reason (a string) it stays one opaque
        op (``grouped_refusal``). A gating of the model's own stays opaque: its ops are
        not lowprec's to keep in eager's bits, and its output's dtype decides the down
        GEMM's path."""
        if self.apply_gate is not None or not _is_silu(self.act_fn):
            return "a gating of the model's own (apply_gate, or an activation but silu)"
        got = self.traced_grouped_quantizers(hidden_states, self.gate_up_proj,
                                             self.down_proj)
        if isinstance(got, str):
            return got
        qs, mode = got
        e = self.num_experts
        qs_up, qs_down = _slice(qs, 0, e), _slice(qs, 1, e)
        # the down GEMM's input: the gating's output, of the input's dtype and device
        down_rows = hidden_states.new_empty((1, self.intermediate_dim))
        refused = (grouped_refusal(hidden_states, self.gate_up_proj, qs_up, backward_mode=mode)
                   or grouped_refusal(down_rows, self.down_proj, qs_down, backward_mode=mode))
        if refused is not None:
            return refused
        return self._run(hidden_states, top_k_index, top_k_weights, qs_up, qs_down, mode, None)

    @compiled_as_one_op
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` (T, H); ``top_k_index`` (T, k) expert ids in ``[0, E)``;
        ``top_k_weights`` (T, k). Returns (T, H) in ``hidden_states``' dtype."""
        qs, mode, done = self.gemm_quantizers(hidden_states.device)
        e = self.num_experts
        qs_up, qs_down = _slice(qs, 0, e), _slice(qs, 1, e)
        return self._run(hidden_states, top_k_index, top_k_weights, qs_up, qs_down, mode, done)

    def _run(self, hidden_states, top_k_index, top_k_weights, qs_up, qs_down, mode, done):
        e = self.num_experts
        _check_expert_ids(top_k_index.reshape(-1), e)
        # the routed rows laid out in whole blocks of the recipe's grouped path, zero rows
        # after each expert's: the grouped GEMMs then pad nothing themselves
        align = math.lcm(group_alignment_for(qs_up, 2 * self.intermediate_dim, self.hidden_dim),
                         group_alignment_for(qs_down, self.hidden_dim, self.intermediate_dim))
        padded = align > 1 and hidden_states.shape[0] > 0
        if not padded:
            align = 1  # the rows as routed (bf16 experts, or no tokens to lay out)
        counts, token_of, slot_of, valid, rows_of = route(top_k_index, e, align)
        gates = _RowGates.apply(top_k_weights, slot_of, valid if padded else None, rows_of)
        x = _RoutedRows.apply(hidden_states, token_of, rows_of, padded)
        h = grouped_linear(x, self.gate_up_proj, counts, quantizers=qs_up, backward_mode=mode,
                           on_backward_done=done, group_alignment=align)
        if self.apply_gate is not None:
            a = self.apply_gate(h)
        elif _is_silu(self.act_fn):
            a = swiglu(h)  # one pass each way on a GPU, the same bits
        else:
            gate, up = h.chunk(2, dim=-1)
            a = self.act_fn(gate) * up
        out = grouped_linear(a, self.down_proj, counts, quantizers=qs_down, backward_mode=mode,
                             on_backward_done=done, group_alignment=align)
        out = out.to(hidden_states.dtype)
        if gated_runs(out, gates, rows_of):
            return _GatedSumIntoTokens.apply(out, gates, rows_of, token_of)
        return _SumIntoTokens.apply((out * gates[:, None]).to(out.dtype), rows_of, token_of)


def _is_silu(act_fn) -> bool:
    """Whether ``act_fn`` is torch's silu: the function, ``nn.SiLU``, or transformers'
    ``SiLUActivation`` (``F.silu`` in a module) as transformers builds it."""
    if act_fn is nn.functional.silu or type(act_fn) is nn.SiLU:
        return True
    cls = type(act_fn)
    return (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations"
            and "forward" not in vars(act_fn))


class _SumIntoTokens(torch.autograd.Function):
    """Each token's routed rows of ``out`` summed into it, one add at a time in expert order
    (``rows_of``: (T, k) row indices, ascending), from zero and rounded to ``out``'s dtype
    after each add: the sums of ``index_add_`` over rows sorted by expert on the CPU and of
    the transformers loop, the same bits on every device and every run (``index_add_`` on
    a GPU adds with atomics in no fixed order). Rows that are no token's (padding, zeros or
    what an expert with NaN or Inf weights made of them) reach none. ``token_of``: each
    row's token, T for a padded row (for the backward)."""

    @staticmethod
    def forward(ctx, out, rows_of, token_of):
        ctx.save_for_backward(token_of)
        return token_sum(out, rows_of)

    @staticmethod
    def backward(ctx, grad):
        (token_of,) = ctx.saved_tensors
        # each row takes its token's gradient; a padded row reads the zero row past them
        return nn.functional.pad(grad, (0, 0, 0, 1))[token_of], None, None


class _GatedSumIntoTokens(torch.autograd.Function):
    """:class:`_SumIntoTokens` of ``(out * gates[:, None]).to(out.dtype)`` in one pass (the
    same bits), its backward in another: the rows' gradients as torch's, the gates' summed
    over the features in another order than torch's."""

    @staticmethod
    def forward(ctx, out, gates, rows_of, token_of):
        ctx.save_for_backward(out, gates, token_of)
        return token_sum(out, rows_of, gates)

    @staticmethod
    def backward(ctx, grad):
        out, gates, token_of = ctx.saved_tensors
        d_out, d_gates = gated_rows_grad(grad.contiguous(), out, gates, token_of)
        return d_out, d_gates, None, None


class _RowGates(torch.autograd.Function):
    """Each routed row's gate, ``top_k_weights.reshape(-1)[slot_of]``, zero for the padding
    rows (``valid`` False; None: no padding). The backward gathers each slot's gradient
    from its one row instead of indexing's scatter-add, whose padding rows all land on
    slot 0 and are added one after another (1.45 ms at the Qwen3-like layer's 128-row
    blocks). ``rows_of`` lists a token's rows in expert order, so each one's place among
    the token's slots is read from ``slot_of``. The bits are indexing's (NaN where it has
    NaN): the sum from zero of one row's gradient and the padding rows' zeros is that
    gradient plus +0 (so -0 becomes +0)."""

    @staticmethod
    def forward(ctx, top_k_weights, slot_of, valid, rows_of):
        ctx.save_for_backward(slot_of, rows_of)
        ctx.shape = top_k_weights.shape
        gates = top_k_weights.reshape(-1)[slot_of]
        return gates if valid is None else gates.masked_fill(~valid, 0)

    @staticmethod
    def backward(ctx, grad):
        slot_of, rows_of = ctx.saved_tensors
        place = slot_of[rows_of] % rows_of.shape[1]  # (T, k): each row's slot in its token
        d = torch.empty(rows_of.shape, dtype=grad.dtype, device=grad.device)
        d.scatter_(1, place, grad[rows_of])
        return (d + 0.0).reshape(ctx.shape), None, None, None


class _RoutedRows(torch.autograd.Function):
    """``hidden_states[token_of]``: each routed row a copy of its token; with ``padded``,
    ``token_of`` is the token count for the zero rows between the experts' groups, read
    from a zero row past the tokens (no masking pass). The backward sums each token's rows
    (``rows_of``, ascending: expert order) one at a time from zero, in one pass on a GPU
    (:func:`token_sum`): the bits of indexing's backward, which accumulates each token's
    rows in sorted order; the padded rows' gradients (zero, or NaN from an expert's
    non-finite weights) reach no token."""

    @staticmethod
    def forward(ctx, hidden_states, token_of, rows_of, padded):
        ctx.save_for_backward(rows_of)
        if padded:
            return nn.functional.pad(hidden_states, (0, 0, 0, 1))[token_of]
        return hidden_states[token_of]

    @staticmethod
    def backward(ctx, grad):
        (rows_of,) = ctx.saved_tensors
        return token_sum(grad.contiguous(), rows_of), None, None, None


class TorchtitanGroupedExperts(LowprecModule):
    """torchtitan's routed experts (``GroupedExperts`` of ``torchtitan.models.moe`` in 0.2.x,
    parameters ``w1``, ``w2``, ``w3``; of ``torchtitan.models.common.moe`` in 0.3,
    ``w1_EFD``, ``w2_EDF``, ``w3_EFD``) in low precision, holding the same parameters under
    the same names: w1 and w3 (E, F, D), w2 (E, D, F), ``forward(x, num_tokens_per_expert)``
    on rows grouped by expert, ``w2(silu(w1 x) * w3 x)``. Like torchtitan's grouped-mm path
    it computes in bf16 (its 0.2.x per-expert loop, ``use_grouped_mm=False``, in the
    parameters' dtype), each GEMM through :func:`lowprec.linear.grouped.grouped_linear`.
    Quantizer slots ``<name>.<e>.w1``, ``<name>.<e>.w3``, ``<name>.<e>.w2``, by GEMM then
    expert. Expert parallelism (padded token layouts) is not supported."""

    module_type = "grouped_linear"
    #: the parameter names of each torchtitan version, in the order w1, w3, w2
    NAMES = (("w1", "w3", "w2"), ("w1_EFD", "w3_EFD", "w2_EDF"))

    @classmethod
    def from_experts(cls, experts: nn.Module, name: str = "") -> "TorchtitanGroupedExperts":
        """One holding ``experts``' own three parameters, under their names."""
        params = dict(experts.named_parameters())
        names = next(n for n in cls.NAMES if set(n) == set(params))
        new = cls.__new__(cls)
        LowprecModule.__init__(new, name)
        new.param_names = names
        for n, p in params.items():  # registered in the source's order (state-dict order)
            setattr(new, n, p)
        new.num_experts = params[names[0]].shape[0]
        new.in_bf16 = getattr(experts, "use_grouped_mm", True)
        # torchtitan's model.init_weights calls its experts' init_weights: the source class's
        # own, which reads the parameters by the names this module keeps
        new._source_init = getattr(type(experts), "init_weights", None)
        new.train(experts.training)
        # built here, as a constructor builds them: a compiled call would otherwise build
        # every expert's roles while dynamo traces it
        new._cache_roles()
        return new

    def init_weights(self, *args, **kwargs):
        """torchtitan's ``GroupedExperts.init_weights`` on these parameters."""
        if self._source_init is None:
            raise NotImplementedError("the converted torchtitan experts had no init_weights")
        return self._source_init(self, *args, **kwargs)

    def _gemm_names(self) -> list[str]:
        return [f"{self.name}.{e}.{g}" for g in ("w1", "w3", "w2")
                for e in range(self.num_experts)]

    def _boundary(self, i: int, fwd: bool):
        return None

    def _weight_names(self) -> list[str]:
        return []

    def _expert_weights(self) -> dict[str, range]:
        e = self.num_experts
        return {name: range(i * e, (i + 1) * e) for i, name in enumerate(self.param_names)}

    def _experts_compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the GEMMs read the experts in, for parameters of ``dtype``."""
        return torch.bfloat16 if self.in_bf16 else dtype

    def reset_parameters(self) -> None:
        raise NotImplementedError("torchtitan initializes its experts (init_weights); "
                                  "TorchtitanGroupedExperts keeps its parameters")

    def compiled_output_shapes(self, x, num_tokens_per_expert) -> list[tuple]:
        return [tuple(x.shape)]

    def _local_weights(self) -> tuple:
        # torchtitan's own module computes on the local shards of DTensor weights
        ws = (getattr(self, n) for n in self.param_names)
        return tuple(w.to_local() if hasattr(w, "to_local") else w for w in ws)  # a DTensor

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        # the dtype the GEMMs read (cast at each GEMM: one bf16 copy of a weight at a time)
        return t.bfloat16() if self.in_bf16 else t

    def traced_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor):
        """The call as torch.compile traces it (eager's code over the grouped paths, as
        :meth:`GroupedExperts.traced_forward`), or the reason it stays one opaque op."""
        got = self.traced_grouped_quantizers(x, *(getattr(self, n) for n in self.param_names))
        if isinstance(got, str):
            return got
        qs, mode = got
        weights = self._local_weights()
        xc = self._cast(x)
        e = self.num_experts
        hidden = xc.new_empty((1, weights[0].shape[1]))  # w2's input: the gated rows
        for i, (w, rows) in enumerate(zip(weights, (xc, xc, hidden))):
            # a stand-in of the weight as the GEMM reads it (a dead op in the graph)
            w_like = (w.new_empty(w.shape, dtype=torch.bfloat16)
                      if self.in_bf16 and w.dtype != torch.bfloat16 else w)
            refused = grouped_refusal(rows, w_like, _slice(qs, i, e), backward_mode=mode)
            if refused is not None:
                return refused
        return self._run(x, num_tokens_per_expert, weights, qs, mode, None)

    @compiled_as_one_op
    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        qs, mode, done = self.gemm_quantizers(x.device)
        return self._run(x, num_tokens_per_expert, self._local_weights(), qs, mode, done)

    def _run(self, x, num_tokens_per_expert, weights, qs, mode, done):
        e = self.num_experts
        w1, w3, w2 = weights

        def gemm(inp, w, i):
            return grouped_linear(inp, self._cast(w), num_tokens_per_expert,
                                  quantizers=_slice(qs, i, e), backward_mode=mode,
                                  on_backward_done=done)
        xc = self._cast(x)
        h = silu(gemm(xc, w1, 0)) * gemm(xc, w3, 1)
        return gemm(h, w2, 2).type_as(x)


def _slice(qs, i: int, e: int):
    """GEMM ``i``'s experts' quantizers: ``e`` of a per-GEMM list, or the one set all share
    (or None)."""
    return qs[i * e:(i + 1) * e] if isinstance(qs, list) else qs
