"""Delayed scaling in a traced linear (``traced.TracedLinear`` with a plan whose forms read
a module's state): the forward's operands cast with the state's scales and their amaxes
recorded into it, dY's likewise, and the backward state joined to the backward pass's
update when the module's last GEMM runs its backward, as eager's end-of-backward callback
joins it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..formats import Fp8, decode_scale, scale_in_use
from ..kernels import CUDAGRAPH_UNSAFE, graph_op
from ..recipe import join_backward_pass, state_of_key


@graph_op("join_backward", mutates_args=("amax",), tags=CUDAGRAPH_UNSAFE)
def join_backward(amax: torch.Tensor, key: torch.Tensor, group: str,
                  seen: torch.Tensor) -> None:
    """A traced delayed-scaling backward at its module's last GEMM, which records dY's amax
    ``seen`` into ``amax`` (its backward state's) next: the state named by ``key`` joins
    the running backward pass's update (``lowprec.recipe.backward_pass``), its amaxes
    all-reduced there over the process group named ``group`` ("" for none), as an eager
    backward's state joins. A host-side op: the update runs once for every module at the
    pass's end, outside the graph. ``amax`` is declared written because that update writes
    it (which keeps the compiler from dropping the op and orders it before the record).
    ``seen`` is only read, so that the op depends on dY: reading the state alone, it would
    be moved into the forward graph by the partitioners (and join no pass there). Not for
    a CUDA graph: a replay would not run it."""
    resolved = None if not group else \
        torch.distributed.distributed_c10d._resolve_process_group(group)
    join_backward_pass(state_of_key(key), resolved)


@torch.library.register_fake("lowprec::join_backward")
def _join_backward_fake(amax, key, group, seen):
    return None


def delayed_forward(plan, x2d, weight, fwd):
    """fprop's operands under delayed scaling: cast with the state's scales, their amaxes
    recorded into it (slot ``s`` the input, ``s + 1`` the weight)."""
    scale, amax, handle, s, records = fwd
    # The codes are cast with the state's scales as they are (seeded from the tensor's own
    # amax only while the slot may have none): the casts need not wait for the amaxes. The
    # GEMMs read the scales NaN where an amax is not finite (``formats.float8.graph.
    # fp8_delayed`` says why).
    ax, aw = plan.x.amax(x2d), plan.w.amax(weight)
    cx, cw = plan.x.seeded(scale[s:s + 1], ax), plan.w.seeded(scale[s + 1:s + 2], aw)
    xs, ws = scale_in_use(cx, ax), scale_in_use(cw, aw)
    # Backward recasts x and W with the scales in use, so it keeps this copy of them. Left
    # reads of the state, a partitioner would save the state's tensor and recompute from
    # it in backward, after the region's update has moved it (autograd's version check
    # raises where that update is torch ops; nothing checks a kernel's write). The copy is
    # a cat, which the min-cut partitioner saves, never recomputes, and the forward reads
    # it, so that the default partitioner (which places in backward what no forward
    # output needs) keeps it in the forward too. One cat an operand, its scale first: the
    # compiler may make the backward's decode scale in the copy's place, and cuBLAS
    # refuses a scale at an offset of 4 bytes (CUBLAS_STATUS_NOT_SUPPORTED).
    held = torch.cat([xs, ax]), torch.cat([ws, aw])
    if records:  # training
        if handle is not None:  # the region around the compiled call: joined at run time
            # before the records, so that nothing sits between a record and its write-back
            # and the compiler makes the call's records one small kernel; it reads the
            # copies
            torch.ops.lowprec.join_region(amax, handle, list(held))
            seen = ax, aw
        else:  # the region's update is traced with the call: the records read the copies
            seen = held[0][1:2], held[1][1:2]
        amax[s:s + 1].copy_(torch.maximum(amax[s:s + 1], seen[0]))
        amax[s + 1:s + 2].copy_(torch.maximum(amax[s + 1:s + 2], seen[1]))
    # each operand's decode scale of its own, from the scale itself, not the kept copy: so
    # the reduction that makes the scale makes it too (inductor's scaled-GEMM lowering
    # cannot view an element of a shared buffer as the GEMM's scale: it asserts, on CUDA)
    xd, wd = decode_scale(xs).reshape(()), decode_scale(ws).reshape(())
    kx, kw = held[0][0:1], held[1][0:1]
    return ((Fp8(plan.x.cast(x2d, cx), xs, xd), (x2d, kx, decode_scale(kx).reshape(()))),
            (Fp8(plan.w.cast(weight, cw), ws, wd), (weight, kw, decode_scale(kw).reshape(()))))


@dataclass(frozen=True)
class StateQuantizers:
    """An eager delayed-scaling call's own quantizers (a ``LinearQuantizers`` of the
    module's state: the quantizes read its scales and record amaxes into it) and the
    module's end-of-backward callback, which joins the backward state to the backward
    pass's update."""

    quantizers: object
    done: Optional[Callable[[], None]] = None


def delayed_grad(plan, dy2d: torch.Tensor, update) -> tuple[Fp8, Fp8]:
    """dY's (rowwise, columnwise) forms under the backward state's scale (``update``: the
    backward state's tensors and settings, as ``traced.traced_linear`` hands them on),
    its amax recorded into the state. Where this GEMM is the module's last to run
    backward, the state joins the backward pass's update (which runs at the pass's end,
    outside the graph) before the record, so that nothing sits between the record and
    its write-back: the compiler makes both in one small kernel."""
    scale, amax, key, s, updates, group = update
    dyq, dys, seen = plan.dy.delayed(dy2d, scale[s:s + 1])
    if updates:
        torch.ops.lowprec.join_backward(amax, key, group, seen)
    amax[s:s + 1].copy_(torch.maximum(amax[s:s + 1], seen))
    dyd = decode_scale(dys).reshape(())
    return Fp8(dyq, dys, dyd), Fp8(dyq.t().contiguous(), dys, dyd)
