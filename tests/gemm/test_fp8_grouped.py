"""Grouped per-tensor FP8 GEMMs (lowprec/gemm/fp8_grouped.py): on CPU the kernel's sum
in torch ops against fp64 products and the custom ops' fake shapes; on a Hopper GPU each
group bit for bit one cuBLAS ``torch._scaled_mm`` (what the per-expert Linear runs), for
groups of any size, empty ones, contractions that end inside a 128-chunk, and E5M2
operands."""

from __future__ import annotations

import pytest
import torch

from lowprec.gemm import fp8_grouped
from lowprec.kernels import triton_available

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _codes(*shape, dtype=E4M3, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 8).to(dtype).to(device)


def _scales(num, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(num, generator=g) * 0.01 + 1e-3).to(device)


def _offs(sizes, device="cpu"):
    return torch.cumsum(torch.tensor(sizes), 0).to(device=device, dtype=torch.int32)


def _exact(a, b, scale):
    return (a.double() @ b.double().t()) * scale


def test_reference_rows_and_wgrad_match_fp64_products():
    sizes = (5, 0, 37, 22)
    m, n, k = sum(sizes), 48, 320
    a, b = _codes(m, k), _codes(len(sizes), n, k, seed=2)
    da, db = _scales(len(sizes)), _scales(len(sizes), seed=3)
    y = fp8_grouped.rows_by_experts(a, da, b, db, _offs(sizes), torch.float32)
    start = 0
    for g, size in enumerate(sizes):
        part = y[start:start + size]
        ref = _exact(a[start:start + size], b[g], float(da[g]) * float(db[g]))
        torch.testing.assert_close(part.double(), ref, rtol=1e-6, atol=1e-6)
        start += size
    wsizes = (16, 0, 48, 32)
    at, bt = _codes(n, sum(wsizes), seed=4), _codes(k, sum(wsizes), seed=5)
    dw = fp8_grouped.wgrad(at, da, bt, db, _offs(wsizes), torch.float32)
    start = 0
    for g, size in enumerate(wsizes):
        ref = _exact(at[:, start:start + size], bt[:, start:start + size],
                     float(da[g]) * float(db[g]))
        torch.testing.assert_close(dw[g].double(), ref, rtol=1e-6, atol=1e-6)
        start += size
    assert torch.all(dw[1] == 0)


def test_fake_shapes_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(70, 256, dtype=E4M3), torch.empty(3, 48, 256, dtype=E4M3)
        s, offs = torch.empty(3), torch.empty(3, dtype=torch.int32)
        y = fp8_grouped.rows_by_experts.op(a, s, b, s, offs, torch.bfloat16)
        dw = fp8_grouped.wgrad.op(torch.empty(48, 96, dtype=E4M3), s,
                                  torch.empty(256, 96, dtype=E4M3), s, offs, torch.bfloat16)
    assert y.shape == (70, 48) and y.dtype == torch.bfloat16
    assert dw.shape == (3, 48, 256)


def test_available_refuses_cpu_and_e5m2_pairs():
    assert not fp8_grouped.available(torch.zeros(2, 2), E4M3)
    if torch.cuda.is_available():
        assert not fp8_grouped.available(torch.zeros(2, 2, device="cuda"), E5M2, E5M2)


HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
         and triton_available()),
    reason="the grouped FP8 kernel needs a Hopper GPU with Triton")


def _cublas(a, b, sa, sb):
    # scalar scales in their own allocations (cuBLAS wants aligned scale pointers)
    return torch._scaled_mm(a, b.t(), sa.clone(), sb.clone(), out_dtype=torch.bfloat16,
                            use_fast_accum=False)


#: the launcher's threshold for each form of the kernel: never / always persistent
FORMS = pytest.mark.parametrize("persistent_rows", [0, 1 << 30], ids=["tiles", "persistent"])


def _bits_equal(x, y):
    return torch.equal(x.view(torch.int16), y.view(torch.int16))


@HOPPER
@FORMS
@pytest.mark.parametrize("k", [384, 208])  # whole 128-chunks, and a contraction ending inside one
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
def test_rows_by_experts_bit_identical_to_cublas_per_group(k, dtypes, persistent_rows,
                                                           monkeypatch):
    monkeypatch.setattr(fp8_grouped, "PERSISTENT_ROWS", persistent_rows)
    sizes = (5, 0, 300, 129, 1)
    n = 272
    a = _codes(sum(sizes), k, dtype=dtypes[0], device="cuda")
    b = _codes(len(sizes), n, k, dtype=dtypes[1], device="cuda", seed=2)
    da, db = _scales(len(sizes), "cuda"), _scales(len(sizes), "cuda", seed=3)
    y = fp8_grouped.rows_by_experts(a, da, b, db, _offs(sizes, "cuda"), torch.bfloat16)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            ref = _cublas(a[start:start + size], b[g], da[g], db[g])
            assert _bits_equal(y[start:start + size], ref), f"group {g}"
        start += size


@HOPPER
@FORMS
def test_rows_by_experts_reads_strided_experts(persistent_rows, monkeypatch):
    """dgrad's experts: the (K, G * N) transposed codes viewed as (G, K, N)."""
    monkeypatch.setattr(fp8_grouped, "PERSISTENT_ROWS", persistent_rows)
    sizes = (64, 17, 0)
    n, k = 256, 160
    dy = _codes(sum(sizes), n, device="cuda")
    w_t = _codes(k, len(sizes) * n, device="cuda", seed=2)
    experts = w_t.view(k, len(sizes), n).permute(1, 0, 2)
    da, db = _scales(3, "cuda"), _scales(3, "cuda", seed=3)
    dx = fp8_grouped.rows_by_experts(dy, da, experts, db, _offs(sizes, "cuda"), torch.bfloat16)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            ref = _cublas(dy[start:start + size], w_t[:, g * n:(g + 1) * n], da[g], db[g])
            assert _bits_equal(dx[start:start + size], ref), f"group {g}"
        start += size


@HOPPER
@FORMS
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
def test_wgrad_bit_identical_to_cublas_per_group(dtypes, persistent_rows, monkeypatch):
    monkeypatch.setattr(fp8_grouped, "PERSISTENT_ROWS", persistent_rows)
    sizes = (16, 0, 400, 144, 32)
    n, k = 144, 272
    a = _codes(n, sum(sizes), dtype=dtypes[0], device="cuda")
    b = _codes(k, sum(sizes), dtype=dtypes[1], device="cuda", seed=2)
    da, db = _scales(len(sizes), "cuda"), _scales(len(sizes), "cuda", seed=3)
    dw = fp8_grouped.wgrad(a, da, b, db, _offs(sizes, "cuda"), torch.bfloat16)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            ref = _cublas(a[:, start:start + size], b[:, start:start + size], da[g], db[g])
            assert _bits_equal(dw[g], ref), f"group {g}"
        else:
            assert torch.all(dw[g] == 0)
        start += size
