"""@triton.jit kernels of the routed rows' layout (launcher: :mod:`lowprec.kernels.moe_route`).

The routed slots (token t, slot j: flat index ``t * K + j``) are cut into blocks of ``BT``
tokens. ``route_count_kernel`` counts each block's slots by expert; ``route_bases_kernel``
(one program) turns the counts into every expert's padded group (its start a multiple of
``ALIGN``), each block's first row in every group, and writes the padding rows;
``route_place_kernel`` gives each slot its row: its group's start plus the number of slots
of that expert before it in flat order (a stable sort by expert, as ``argsort(stable=True)``
orders them), and each token its rows in ascending order.

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def route_count_kernel(ids_ptr, counts_ptr, N, BLK: tl.constexpr, CH: tl.constexpr,
                       EP: tl.constexpr):
    """``counts[b, e]``: block ``b``'s slots (``BLK`` of them) routed to expert ``e``."""
    b = tl.program_id(0)
    experts = tl.arange(0, EP)
    acc = tl.zeros((EP,), dtype=tl.int32)
    for c in tl.static_range(0, BLK, CH):
        local = c + tl.arange(0, CH)
        i = b * BLK + local
        e = tl.load(ids_ptr + i, mask=(local < BLK) & (i < N), other=-1).to(tl.int32)
        acc += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + b * EP + experts, acc)


@triton.jit
def route_bases_kernel(bc_ptr, base_ptr, sizes_ptr, token_ptr, slot_ptr, valid_ptr, NB, E, T,
                       R, ALIGN: tl.constexpr, EP: tl.constexpr, CB: tl.constexpr,
                       AP: tl.constexpr, CR: tl.constexpr):
    """From the block counts: the group sizes (each expert's count rounded up to ``ALIGN``,
    the rows left over up to ``R`` to the last expert), each block's first row in every
    group (``base[b, e]``), and the padding rows (token ``T``, slot 0, not valid)."""
    experts = tl.arange(0, EP)
    live = experts < E
    total = tl.zeros((EP,), dtype=tl.int32)
    for b0 in range(0, NB, CB):
        blocks = b0 + tl.arange(0, CB)
        total += tl.sum(tl.load(bc_ptr + blocks[:, None] * EP + experts[None, :],
                                mask=(blocks < NB)[:, None], other=0), 0)
    padded = tl.where(live, (total + (ALIGN - 1)) // ALIGN * ALIGN, 0)
    end = tl.cumsum(padded, 0)
    start = end - padded
    used = tl.sum(padded, 0)
    last = experts == E - 1
    tl.store(sizes_ptr + experts, (padded + tl.where(last, R - used, 0)).to(tl.int64),
             mask=live)
    carry = start
    for b0 in range(0, NB, CB):
        blocks = b0 + tl.arange(0, CB)
        m = (blocks < NB)[:, None]
        ptrs = blocks[:, None] * EP + experts[None, :]
        tile = tl.load(bc_ptr + ptrs, mask=m, other=0)
        tl.store(base_ptr + ptrs, tl.cumsum(tile, 0) - tile + carry[None, :], mask=m)
        carry += tl.sum(tile, 0)
    # each group's padding rows, then the rows past the last group's
    pad = (start + total)[:, None] + tl.arange(0, AP)[None, :]
    pm = live[:, None] & (pad < end[:, None])
    tl.store(token_ptr + pad, tl.full(pad.shape, 0, tl.int64) + T, mask=pm)
    tl.store(slot_ptr + pad, tl.full(pad.shape, 0, tl.int64), mask=pm)
    tl.store(valid_ptr + pad, tl.full(pad.shape, 0, tl.int8), mask=pm)
    for r0 in range(used, R, CR):
        rows = r0 + tl.arange(0, CR)
        rm = rows < R
        tl.store(token_ptr + rows, tl.full((CR,), 0, tl.int64) + T, mask=rm)
        tl.store(slot_ptr + rows, tl.full((CR,), 0, tl.int64), mask=rm)
        tl.store(valid_ptr + rows, tl.full((CR,), 0, tl.int8), mask=rm)


@triton.jit
def route_place_kernel(ids_ptr, base_ptr, token_ptr, slot_ptr, valid_ptr, rows_of_ptr, T,
                       K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                       CT: tl.constexpr, EP: tl.constexpr):
    """Block ``b``'s slots, ``CT`` tokens at a time in flat order: each slot's row (its
    expert's next row in this block), that row's token, slot and validity; each token's
    rows sorted ascending into ``rows_of`` (T, K)."""
    b = tl.program_id(0)
    experts = tl.arange(0, EP)
    base = tl.load(base_ptr + b * EP + experts)
    lane = tl.arange(0, CT * KP)
    j = lane % KP
    for c in tl.static_range(0, BT, CT):
        t = b * BT + c + lane // KP
        live = (t < T) & (j < K)
        flat = t.to(tl.int64) * K + j
        e = tl.load(ids_ptr + flat, mask=live, other=-1).to(tl.int32)
        hit = e[:, None] == experts[None, :]
        first = tl.sum(tl.where(hit, base[None, :], 0), 1)
        before = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None]) & live[None, :]
        row = (first + tl.sum(before.to(tl.int32), 1)).to(tl.int64)
        tl.store(token_ptr + row, t.to(tl.int64), mask=live)
        tl.store(slot_ptr + row, flat, mask=live)
        tl.store(valid_ptr + row, tl.full(row.shape, 1, tl.int8), mask=live)
        base += tl.sum(hit.to(tl.int32), 0)
        rows = tl.sort(tl.reshape(tl.where(live, row, 1 << 62), (CT, KP)), 1)
        tok = b * BT + c + tl.arange(0, CT)[:, None]
        col = tl.arange(0, KP)[None, :]
        tl.store(rows_of_ptr + tok.to(tl.int64) * K + col, rows, mask=(tok < T) & (col < K))


@triton.jit
def group_sizes_ok_kernel(sizes_ptr, ok_ptr, G, rows, align, GP: tl.constexpr):
    """``ok``: every size non-negative and a multiple of ``align``, their sum ``rows``."""
    g = tl.arange(0, GP)
    s = tl.load(sizes_ptr + g, mask=g < G, other=0)
    bad = tl.sum(((s < 0) | (s % align != 0)).to(tl.int32), 0)
    tl.store(ok_ptr, ((bad == 0) & (tl.sum(s, 0) == rows)).to(tl.int8))
