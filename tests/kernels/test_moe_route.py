"""The routed rows' layout (lowprec/kernels/moe_route.py): the torch ops against the padded
layout of the grouped GEMMs (``grouped_mm.padded_layout``) and the definition, the kernels
against the torch ops, integer for integer."""

from __future__ import annotations

import pytest
import torch

from lowprec.gemm import grouped_mm
from lowprec.kernels import triton_available
from lowprec.kernels.moe_route import route, route_torch, row_count

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                         reason="the routing kernels need a GPU with Triton")


def _ids(t, k, e, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros((0, k), dtype=torch.int64)
    if skew and t:
        ids[: t // 2, 0] = 0  # half the tokens' first choice on expert 0
        ids[: t // 2, 1:] = torch.arange(1, k) % e if e > 1 else 0
    return ids


@pytest.mark.parametrize("t, k, e, align", [(37, 4, 8, 16), (50, 2, 5, 1), (9, 1, 3, 32)])
def test_torch_ops_give_the_padded_layout(t, k, e, align):
    ids = _ids(t, k, e)
    r = route_torch(ids, e, align)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    total = row_count(t, k, e, align)
    if align > 1:
        src, valid, offs, total_ref, place = grouped_mm.padded_layout(
            counts, flat[order], flat.numel(), align)
        assert total_ref == total and torch.equal(valid, r.valid)
        assert torch.equal(torch.cumsum(r.sizes, 0)[:-1], offs[:-1].long())
        assert torch.equal(r.token_of, torch.where(valid, (order // k)[src], t))
        assert torch.equal(r.slot_of, torch.where(valid, order[src], 0))
    else:
        assert torch.equal(r.sizes, counts) and bool(r.valid.all())
        assert torch.equal(r.token_of, order // k) and torch.equal(r.slot_of, order)
    assert int(r.sizes.sum()) == total
    # each token's rows: ascending, each holding one of its slots
    assert torch.equal(r.rows_of, r.rows_of.sort(1).values)
    assert torch.equal(r.token_of[r.rows_of], torch.arange(t)[:, None].expand(t, k))
    assert torch.equal(flat[r.slot_of[r.rows_of]].sort(1).values, ids.sort(1).values)


@GPU
@pytest.mark.parametrize("t, k, e, align", [
    (300, 8, 128, 16), (1000, 2, 8, 128), (5, 1, 3, 16), (129, 6, 256, 32), (128, 8, 64, 1),
    (16384, 8, 128, 16), (4096, 2, 8, 16), (1, 8, 8, 16)])
@pytest.mark.parametrize("skew", [False, True])
def test_kernels_give_the_torch_ops_integers(t, k, e, align, skew):
    ids = _ids(t, k, e, seed=t, skew=skew).cuda()
    got, ref = route(ids, e, align), route_torch(ids, e, align)
    for name, a, b in zip(ref._fields, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


CASES = [([16, 0, 32], 48, 16, True), ([16, 0, 32], 49, 16, False), ([16, -16, 48], 48, 16, False),
         ([5, 3], 8, 1, True), ([8, 8], 16, 16, False), ([16, 16], 32, 16, True)]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=GPU)])
def test_group_sizes_checked(device):
    from lowprec.kernels.moe_route import group_sizes_ok
    for sizes, rows, align, want in CASES:
        ok = group_sizes_ok(torch.tensor(sizes, device=device), rows, align)
        assert ok.dtype == torch.bool and ok.shape == () and bool(ok) == want, (sizes, rows)
