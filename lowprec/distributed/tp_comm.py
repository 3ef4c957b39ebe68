"""The collectives of tensor and sequence parallelism, as autograd functions.

A column-parallel GEMM holds rows of the weight (a slice of the output features), a
row-parallel one holds columns (a slice of the input features); a column-parallel layer
followed by a row-parallel one needs no communication between them (Megatron-LM's MLP and
attention split). What moves:

* column-parallel input: replicated (backward all-reduces its gradient), or, with
  sequence parallelism, a shard of the rows that the ranks all-gather (backward
  reduce-scatters the gradient);
* row-parallel output: partial sums that the ranks all-reduce, or reduce-scatter into row
  shards with sequence parallelism (backward all-gathers the gradient).

The two all-gathers of sequence parallelism move quantized bytes where the GEMM after them
quantizes the gathered tensor anyway and the format lets each rank quantize its own rows
exactly as a quantize of the whole tensor would (``Quantizer.quantize_part``: per-tensor
FP8 and NVFP4 with the amax all-reduced over the group first, block formats whose blocks do
not straddle the shards). Either way the GEMM reads the same bits; the quantized gather is
the cheaper way to get them.

Rows are the leading dimension: a sequence-parallel tensor is split along its first
dimension (the sequence-first ``(seq, batch, hidden)`` layout), rank after rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..formats import QuantizedTensor, Quantizer, contiguous_data
from . import gather_codec
from .gather_codec import derives_columnwise


class GroupRef:
    """A tensor-parallel process group held by a module. A deep copy shares it; a pickle
    keeps only its ranks (a process group cannot travel), and the unpickled module asks
    for the group again (``set_tensor_parallel_group``) before any forward."""

    def __init__(self, group, ranks: tuple[int, ...] | None = None) -> None:
        self._group = group
        self.ranks = ranks if ranks is not None else tuple(dist.get_process_group_ranks(group))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def group(self):
        if self._group is None:
            raise RuntimeError(
                f"this module's tensor-parallel group (ranks {list(self.ranks)}) did not "
                f"travel with it (pickled or loaded in another process); call "
                f"module.set_tensor_parallel_group(group) before its forward")
        return self._group

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (GroupRef, (None, self.ranks))


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


#: dtypes the collectives of every backend carry (FP8 codes travel as their bytes)
_BYTES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _all_gather_fn():
    # torch 2.13 renames the tensor collectives (the old names warn); looked up per call,
    # where lowprec.distributed.diagnostics may be counting them
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# A compiled call traces torch's functional collectives, which dynamo and inductor know
# (the in-place ones above would break the graph); torch 2.13 renames them too.
_traced_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_traced_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _all_gather_rows(t2d: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _traced_gather(t2d.contiguous(), 0, group)
    world = dist.get_world_size(group)
    out = t2d.new_empty((world * t2d.shape[0], *t2d.shape[1:]))
    src = t2d.contiguous()
    if src.dtype in _BYTES:
        out_view, src = out.view(torch.uint8), src.view(torch.uint8)
    else:
        out_view = out
    _all_gather_fn()(out_view, src, group=group)
    return out


def _gathered_shape(t: torch.Tensor, world: int) -> tuple[int, ...]:
    return (t.shape[0] * world, *t.shape[1:])


def quantized_gather_applies(quantizer: Quantizer | None, x: torch.Tensor, *, rowwise: bool,
                             columnwise: bool) -> bool:
    """Whether :func:`gather_rows` can send ``x``'s rows quantized by ``quantizer`` with
    these usages: the format quantizes a part as the whole would, and the row shard of
    each rank fills whole blocks along the rows. Never in a compiled call: it gathers the
    high-precision rows, and its traced GEMM quantizes them into the same bits."""
    if torch.compiler.is_compiling() or quantizer is None:
        return False
    if isinstance(x, QuantizedTensor) or x.dim() < 2 or x.numel() == 0:
        return False
    with quantizer.usages(rowwise=rowwise, columnwise=columnwise):
        if not quantizer.can_quantize_part():
            return False
        multiple = quantizer.row_multiple(rowwise=rowwise, columnwise=columnwise)
    return (x.numel() // x.shape[-1]) % multiple == 0


def sent_usages(quantizer: Quantizer, x: torch.Tensor, rowwise: bool,
                columnwise: bool) -> tuple[bool, bool]:
    """The usages to send for a receiver that needs these: rowwise alone where the format
    derives columnwise data from it (per-tensor FP8, 2-D blocks), a cheaper transpose
    than sending both."""
    if not (rowwise and columnwise):
        return rowwise, columnwise
    m = quantizer.row_multiple(rowwise=True, columnwise=True)
    return (True, True) if not derives_columnwise(quantizer, m, x.shape[-1]) else (True, False)


def gather_rows(x: torch.Tensor, group, quantizer: Quantizer | None = None, *,
                rowwise: bool = True, columnwise: bool = False) -> torch.Tensor:
    """All-gather ``x``'s rows (its first dimension) over ``group``, rank after rank.

    With ``quantizer`` (see :func:`quantized_gather_applies`) each rank quantizes its rows
    with these usages (the per-tensor statistic all-reduced first) and the ranks gather the
    codes and scales: the result is the quantized tensor ``quantizer`` makes of the gathered
    rows, bit for bit. Without, the high-precision rows travel."""
    world = dist.get_world_size(group)
    shape = _gathered_shape(x, world)
    x2d = _rows_2d(_plain(x))
    if quantizer is None:
        return _all_gather_rows(x2d, group).view(shape)
    with quantizer.usages(rowwise=rowwise, columnwise=columnwise):
        statistic = quantizer.part_statistic(x2d)
        if statistic is not None:
            dist.all_reduce(statistic, op=dist.ReduceOp.MAX, group=group)
        part = quantizer.quantize_part(x2d, statistic)
    inputs, packing = gather_codec.pack(part, world * x2d.shape[0])
    outputs = [_all_gather_rows(t, group) for t in inputs]
    gathered = gather_codec.unpack(outputs, packing, shape, x.dtype)
    return gathered._rebuild(contiguous_data)  # columnwise data came as transposed views


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of rows (first dimension)."""
    world = dist.get_world_size(group)
    x = _plain(x)
    if x.shape[0] % world:
        raise ValueError(f"sequence parallelism splits the first dimension over {world} ranks; "
                         f"a tensor of shape {tuple(x.shape)} does not split evenly")
    x2d = _rows_2d(x)
    if torch.compiler.is_compiling():
        out = _traced_scatter(x2d, "sum", 0, group)
    else:
        out = x2d.new_empty((x2d.shape[0] // world, x2d.shape[1]))
        _reduce_scatter_fn()(out, x2d, op=dist.ReduceOp.SUM, group=group)
    return out.view(x.shape[0] // world, *x.shape[1:])


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x.contiguous(), "sum", group)
    out = _plain(x).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Identity forward (a replicated tensor); backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum of partial results over the group; the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherRows(torch.autograd.Function):
    """Sequence-parallel all-gather (see :func:`gather_rows`); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group, quantizer, rowwise, columnwise):
        ctx.group = group
        return gather_rows(x.detach(), group, quantizer, rowwise=rowwise, columnwise=columnwise)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_rows(g, ctx.group), None, None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Sequence-parallel reduce-scatter of partial sums; backward all-gathers the gradient,
    quantized by ``grad_quantizer`` where :func:`quantized_gather_applies`."""

    @staticmethod
    def forward(ctx, x, group, grad_quantizer, rowwise, columnwise):
        ctx.group, ctx.grad_quantizer, ctx.usages = group, grad_quantizer, (rowwise, columnwise)
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        rowwise, columnwise = ctx.usages
        q = ctx.grad_quantizer
        if not quantized_gather_applies(q, g, rowwise=rowwise, columnwise=columnwise):
            q = None
        else:
            rowwise, columnwise = sent_usages(q, g, rowwise, columnwise)
        return (gather_rows(g, ctx.group, q, rowwise=rowwise, columnwise=columnwise),
                None, None, None, None)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` as it is; its gradient summed over ``group`` (a replicated input of partial
    gradients: a column-parallel input, a sequence-parallel norm parameter or bias)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (row-parallel partial outputs); gradient as it is."""
    return _ReduceFromGroup.apply(x, group)


def gather_sequence(x: torch.Tensor, group, quantizer: Quantizer | None = None, *,
                    rowwise: bool = True, columnwise: bool = False) -> torch.Tensor:
    """All-gather a sequence-parallel input's rows, quantized where
    :func:`quantized_gather_applies`; backward reduce-scatters its gradient."""
    if not quantized_gather_applies(quantizer, x, rowwise=rowwise, columnwise=columnwise):
        quantizer = None
    else:
        rowwise, columnwise = sent_usages(quantizer, x, rowwise, columnwise)
    return _GatherRows.apply(x, group, quantizer, rowwise, columnwise)


def reduce_scatter_sequence(x: torch.Tensor, group, grad_quantizer: Quantizer | None = None,
                            *, rowwise: bool = True, columnwise: bool = True) -> torch.Tensor:
    """Reduce-scatter partial sums into row shards; backward all-gathers the gradient,
    quantized by ``grad_quantizer`` with these usages where it can."""
    return _ReduceScatterRows.apply(x, group, grad_quantizer, rowwise, columnwise)
