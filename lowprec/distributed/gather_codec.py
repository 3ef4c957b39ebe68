"""How a quantized weight shard travels through FSDP2's all-gather, and comes back whole.

FSDP2 gathers plain tensors along their first dimension, rank after rank. A shard is a
block of whole rows of the weight, so every inner tensor of its quantized form goes out
with its first dimension along those rows: rowwise data and scales as they are stored,
columnwise ones transposed (they are stored (K, rows)); 1-element per-tensor scales (the
same on every rank, the amax having been reduced) travel beside the gather, in FSDP's
metadata. The gathered columnwise tensors come back as transposed views of the gathered
rows, without a copy; ``lowprec.linear.function`` makes the contiguous operand a GEMM reads.

Where a phase gathers the rowwise data only and the backward's gather brings the
columnwise data into the same buffers (FSDP keeps one set of gather outputs a parameter,
sized by the first gather), the whole tensor says so (``COLUMNWISE_IN_BACKWARD_ATTR``), for
a compiled backward that reads only what its forward kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import COLUMNWISE_IN_BACKWARD_ATTR, QuantizedTensor, Quantizer


@dataclass
class Packing:
    """What FSDP hands back to the post-gather hook: how to rebuild the whole tensor."""

    cls: type
    #: (inner tensor name, sent transposed) per all-gather input, in order
    gathered: tuple[tuple[str, bool], ...]
    #: per-tensor inner tensors (the same on every rank), passed through as they are
    per_tensor: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    #: rows of the whole tensor: gathered rows beyond it are the padding of uneven shards
    rows: int = 0
    #: the backward's gather fills these buffers with the columnwise data, transposed
    columnwise_in_backward: bool = False


def pack(part: QuantizedTensor, rows: int, padded_rows: int | None = None,
         columnwise_in_backward: bool = False) -> tuple[tuple[torch.Tensor, ...], Packing]:
    """All-gather inputs of ``part`` (a quantized block of whole rows) and its Packing.
    ``padded_rows``: pad the single input with zero rows up to it (an uneven shard; FSDP
    wants every rank's input of the padded shard size). ``columnwise_in_backward``: ``part``
    is rowwise and the backward's gather sends the columnwise data in its place."""
    inputs, gathered, per_tensor = [], [], {}
    for name, t in part.inner_tensors().items():
        if t is None:
            continue
        if t.dim() < 2:
            per_tensor[name] = t
            continue
        transposed = name.startswith("columnwise_")
        inputs.append(t.t().contiguous() if transposed else t.contiguous())
        gathered.append((name, transposed))
    if padded_rows is not None:
        if len(inputs) != 1:
            raise ValueError(f"only a single all-gather input can be padded; {type(part).__name__} "
                             f"sends {len(inputs)}")
        short = padded_rows - inputs[0].shape[0]
        if short:
            inputs[0] = torch.cat([inputs[0], inputs[0].new_zeros(short, inputs[0].shape[1])])
    return tuple(inputs), Packing(type(part), tuple(gathered), per_tensor, part.metadata(), rows,
                                  columnwise_in_backward)


def signature(inputs) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of each input: FSDP sizes its gather buffers from the first gather,
    so every later one must match."""
    return [(t.numel(), t.dtype) for t in inputs]


def _fields(outputs, packing: Packing) -> dict:
    fields = {name: None for name in packing.cls._inner}
    fields.update(packing.per_tensor)
    single = len(packing.gathered) == 1
    for (name, transposed), out in zip(packing.gathered, outputs):
        if single and out.shape[0] > packing.rows and not transposed:
            out = out[:packing.rows]  # the padding of uneven shards
        fields[name] = out.t() if transposed else out
    return fields


def unpack(outputs, packing: Packing, shape, dtype: torch.dtype) -> QuantizedTensor:
    """The whole quantized tensor, its inner tensors views of the gathered ``outputs``."""
    qt = packing.cls(shape, dtype, **_fields(outputs, packing), **packing.meta)
    # set either way, as ``refill`` sets it: a compiled call that reads it guards on the
    # attribute being there
    setattr(qt, COLUMNWISE_IN_BACKWARD_ATTR, packing.columnwise_in_backward)
    return qt


def refill(dst: QuantizedTensor, outputs, packing: Packing) -> None:
    """Point ``dst`` (the tensor a previous gather built) at a new gather's outputs; the
    directions it does not bring and every derived record are dropped."""
    if type(dst) is not packing.cls:
        raise TypeError(f"FSDP all-gather: the unsharded parameter is a {type(dst).__name__}, "
                        f"the gather brought a {packing.cls.__name__}")
    for name in dst._derived:
        setattr(dst, name, None)
    for name, value in _fields(outputs, packing).items():
        setattr(dst, name, value)
    setattr(dst, COLUMNWISE_IN_BACKWARD_ATTR, packing.columnwise_in_backward)


def derives_columnwise(q: Quantizer, m: int, k: int) -> bool:
    """Whether ``q``'s format derives an (m, k) tensor's columnwise data from its rowwise
    data (per-tensor FP8, 2-D blocks)."""
    with q.usages(rowwise=True, columnwise=False):
        empty = q.make_empty((m, k), dtype=torch.float32, device="meta")
    try:
        empty._derive("columnwise")
    except RuntimeError:
        return False
    return True
