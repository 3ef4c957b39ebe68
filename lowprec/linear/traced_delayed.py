"""Delayed scaling in a traced linear (``traced.TracedLinear`` with a plan whose forms read
a module's state): the forward's operands cast with the state's scales and their amaxes
recorded into it, dY's likewise, and the backward state's update once the module's last
GEMM has run its backward, as eager's end-of-backward callback does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed._functional_collectives as funcol

from ..formats import Fp8, decode_scale, scale_in_use
from ..recipe import push_amaxes


@torch.library.custom_op("lowprec::delayed_update",
                         mutates_args=("history", "amax_current", "scale"))
def delayed_update(history: torch.Tensor, amax_current: torch.Tensor, scale: torch.Tensor,
                   fp8_max: torch.Tensor, reduced: Optional[torch.Tensor], algo: int,
                   margin: float) -> None:
    """The backward state's update once a traced delayed-scaling backward has recorded its
    amaxes, under a callable amax algorithm (:func:`update_backward_state` runs the named
    ones through ``push_amaxes`` in the graph itself): eager's own update
    (``lowprec.recipe.state.push_amaxes``), one op in the graph; ``reduced``: the amaxes
    all-reduced over the amax reduction group, where there is one; ``algo``:
    :func:`algo_code`'s place of the callable."""
    push_amaxes(history, amax_current, scale, fp8_max,
                amax_current if reduced is None else reduced, _ALGOS[algo], margin)


@delayed_update.register_fake
def _delayed_update_fake(history, amax_current, scale, fp8_max, reduced, algo, margin):
    return None


_ALGO_NAMES = {-1: "max", -2: "most_recent"}
#: callable amax algorithms a traced update runs, by the int :func:`algo_code` names them by
_ALGOS: list = []


def algo_code(algo) -> int:
    """The int the traced update op names ``DelayedScaling.amax_compute_algo`` by: -1
    "max", -2 "most_recent", else a callable's place in a table the op reads (the callable
    runs in the op, as eager's update runs it)."""
    if algo == "max":
        return -1
    if algo == "most_recent":
        return -2
    return _callable_code(algo)


@torch._dynamo.assume_constant_result
def _callable_code(algo) -> int:
    # run for real while dynamo traces: the op reads the table when the graph runs
    for i, known in enumerate(_ALGOS):
        if known is algo:
            return i
    _ALGOS.append(algo)
    return len(_ALGOS) - 1


def delayed_forward(plan, x2d, weight, fwd):
    """fprop's operands under delayed scaling: cast with the state's scales, their amaxes
    recorded into it (slot ``s`` the input, ``s + 1`` the weight)."""
    scale, amax, handle, s, records = fwd
    seen = torch.cat([plan.x.amax(x2d), plan.w.amax(weight)])
    # Backward recasts x and W with these scales, so it keeps this copy: recomputed from
    # the state, it would read scales the region's update has moved since (autograd's
    # version check then raises). A cat is an op the partitioner saves, not recomputes.
    # The codes are cast with the state's scales; the GEMMs read them NaN where an amax is
    # not finite (``formats.float8.graph.fp8_delayed`` says why). Where both slots seed
    # alike, both are seeded in one set of elementwise ops (half the graph's nodes: the
    # compiler's time goes with them).
    if plan.x.seeds_like(plan.w):
        cast = plan.x.seeded(scale[s:s + 2], seen)
    else:
        cast = torch.cat([plan.x.seeded(scale[s:s + 1], seen[0:1]),
                          plan.w.seeded(scale[s + 1:s + 2], seen[1:2])])
    scales = scale_in_use(cast, seen)
    xs, ws = scales[0:1], scales[1:2]
    if records:  # training
        amax[s:s + 2].copy_(torch.maximum(amax[s:s + 2], seen))
        if handle is not None:  # the region around the compiled call: joined at run time
            torch.ops.lowprec.join_region(amax, handle)
    decoded = decode_scale(scales)
    xd, wd = decoded[0].reshape(()), decoded[1].reshape(())
    return ((Fp8(plan.x.cast(x2d, cast[0:1]), xs, xd), (x2d, xs, xd)),
            (Fp8(plan.w.cast(weight, cast[1:2]), ws, wd), (weight, ws, wd)))


@dataclass(frozen=True)
class StateQuantizers:
    """An eager delayed-scaling call's own quantizers (a ``LinearQuantizers`` of the
    module's state: the quantizes read its scales and record amaxes into it) and the
    module's end-of-backward callback, which updates the backward state."""

    quantizers: object
    done: Optional[Callable[[], None]] = None


def delayed_grad(plan, dy2d: torch.Tensor, update) -> tuple[Fp8, Fp8]:
    """dY's (rowwise, columnwise) forms under the backward state's scale (``update``: the
    backward state's tensors and settings, as ``traced.traced_linear`` hands them on),
    its amax recorded into the state."""
    scale, amax, _, _, _, _, s, _, _ = update
    dyq, dys, seen = plan.dy.delayed(dy2d, scale[s:s + 1])
    amax[s:s + 1].copy_(torch.maximum(amax[s:s + 1], seen))
    dyd = decode_scale(dys).reshape(())
    return Fp8(dyq, dys, dyd), Fp8(dyq.t().contiguous(), dys, dyd)


def update_backward_state(update) -> None:
    """The backward state's update where this GEMM is the module's last to run backward
    (the amaxes all-reduced over the autocast's amax_reduction_group first)."""
    scale, amax, history, fp8_max, algo, margin, _, updates, group = update
    if not updates:
        return
    reduced = None if group is None else funcol.all_reduce(amax, "max", group)
    if algo in _ALGO_NAMES:
        # eager's update: on CUDA its one kernel launch (the compiler would make several
        # small kernels of the torch ops, which the CPU traces; the same bits either way)
        push_amaxes(history, amax, scale, fp8_max, amax if reduced is None else reduced,
                    _ALGO_NAMES[algo], margin)
    else:  # a callable runs as eager runs it
        delayed_update(history, amax, scale, fp8_max, reduced, algo, margin)
