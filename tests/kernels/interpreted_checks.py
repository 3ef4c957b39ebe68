"""Checks of lowprec's Triton kernels run by Triton's interpreter on the CPU (imported by
``test_interpreted_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1``, which must be
set before the kernels are defined). Each check raises AssertionError on a mismatch."""

from __future__ import annotations

import torch


def _scalar_index_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter holds every scalar as a shape-(1,) numpy array and gives a
    tensor's ``__index__`` (a ``range`` bound such as a kernel's ``K``) as ``int(array)``,
    which NumPy 2.4 refuses for an array of ndim > 0 (triton-lang/triton#9171, fixed upstream
    by #9172): ``int(array.item())`` instead, the same integer under any NumPy."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_item_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._item_index = True
    interpreter._patch_lang_tensor = patched


_scalar_index_for_numpy_2_4()


def grouped_gemm_tiles() -> None:
    """The grouped GEMM kernel (fp16 operands: the interpreter has no bf16 or fp8 dot), one
    tile a program and persistent, rows and wgrad: the same bits as each other, within fp32
    rounding of a torch reference, an empty group's wgrad zero."""
    from lowprec.gemm._fp8_grouped_kernels import (
        fp8_grouped_gemm_kernel,
        fp8_grouped_gemm_persistent_kernel,
    )

    def run(kernel, a, b, da, db, offs, out, group_k, s_b, s_o, programs=None):
        g = offs.shape[0]
        m, n, k = a.shape[0], out.shape[-1], a.shape[1]
        meta = dict(GROUP_K=group_k, BM=32, BN=32, BK=32, GP=max(2, 1 << (g - 1).bit_length()),
                    GROUP_M=2, MASK_K=group_k or k % 32 != 0, FP8=False)
        args = (a, b, da, db, out, offs, m, n, k, g, *a.stride(), *s_b, *s_o)
        if programs:
            kernel[(programs,)](*args, PROGRAMS=programs, **meta)
        else:
            kernel[((-(-m // 32) + (0 if group_k else g)) * -(-n // 32),
                    g if group_k else 1)](*args, **meta)
        return out

    def ends(sizes):
        return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)

    def spans(offs):
        return list(zip([0] + offs[:-1].tolist(), offs.tolist()))

    gen = torch.Generator().manual_seed(0)
    sizes = [37, 0, 64, 16, 5]
    offs, m, n, k = ends(sizes), sum(sizes), 48, 80
    a = torch.randn(m, k, generator=gen).half()
    w = torch.randn(len(sizes), n, k, generator=gen).half()
    da, db = torch.rand(len(sizes), generator=gen) + 0.5, torch.rand(len(sizes), generator=gen)
    outs = [run(kern, a, w, da, db, offs, torch.zeros(m, n), False, w.stride(), (0, n, 1), p)
            for kern, p in ((fp8_grouped_gemm_kernel, None),
                            (fp8_grouped_gemm_persistent_kernel, 3))]
    ref = torch.cat([(a[s:e].float() @ w[g].float().t()) * (da[g] * db[g])
                     for g, (s, e) in enumerate(spans(offs))])
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-4)
    sizes = [32, 0, 48, 16]
    offs, m = ends(sizes), sum(sizes)
    a_t, b_t = torch.randn(n, m, generator=gen).half(), torch.randn(k, m, generator=gen).half()
    outs = [run(kern, a_t, b_t, da[:4], db[:4], offs, torch.full((4, n, k), 7.0), True,
                (0, *b_t.stride()), (n * k, k, 1), p)
            for kern, p in ((fp8_grouped_gemm_kernel, None),
                            (fp8_grouped_gemm_persistent_kernel, 5))]
    ref = torch.stack([(a_t[:, s:e].float() @ b_t[:, s:e].float().t()) * (da[g] * db[g])
                       for g, (s, e) in enumerate(spans(offs))])
    assert torch.equal(outs[0], outs[1]) and bool((outs[0][1] == 0).all())
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-4)


def moe_route() -> None:
    """The routing kernels give the torch ops' integers, and the group-size check its
    verdicts."""
    from lowprec.kernels import moe_route as mr
    from lowprec.kernels.moe_route_kernel import (
        group_sizes_ok_kernel,
        route_bases_kernel,
        route_count_kernel,
        route_place_kernel,
    )
    for t, k, e, align in ((300, 8, 128, 16), (70, 2, 8, 128), (5, 1, 3, 16), (40, 6, 256, 32),
                           (33, 8, 64, 1)):
        gen = torch.Generator().manual_seed(t)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        ids[: t // 2, 0] = 0  # one expert busier
        total = mr.row_count(t, k, e, align)
        ep, kp = max(2, 1 << (e - 1).bit_length()), max(2, 1 << (k - 1).bit_length())
        blocks = -(-t // mr._BT)
        counts = torch.empty((blocks, ep), dtype=torch.int32)
        bases = torch.empty_like(counts)
        got = mr.Routing(torch.empty(e, dtype=torch.int64),
                         torch.empty(total, dtype=torch.int64),
                         torch.empty(total, dtype=torch.int64),
                         torch.empty(total, dtype=torch.bool),
                         torch.empty((t, k), dtype=torch.int64))
        route_count_kernel[(blocks,)](ids, counts, t * k, BLK=mr._BT * k, CH=64, EP=ep)
        route_bases_kernel[(1,)](counts, bases, got.sizes, got.token_of, got.slot_of,
                                 got.valid.view(torch.int8), blocks, e, t, total, ALIGN=align,
                                 EP=ep, CB=max(1, 4096 // ep),
                                 AP=max(2, 1 << (align - 1).bit_length()), CR=1024)
        route_place_kernel[(blocks,)](ids, bases, got.token_of, got.slot_of,
                                      got.valid.view(torch.int8), got.rows_of, t, K=k, KP=kp,
                                      BT=mr._BT, CT=64 // kp, EP=ep)
        ref = mr.route_torch(ids, e, align)
        for name, x, y in zip(ref._fields, got, ref):
            assert torch.equal(x, y), (name, t, k, e, align)
    for sizes, rows, align, want in (([16, 0, 32], 48, 16, True), ([16, 0, 32], 49, 16, False),
                                     ([16, -16, 48], 48, 16, False), ([8, 8], 16, 16, False)):
        ok = torch.empty((), dtype=torch.bool)
        group_sizes_ok_kernel[(1,)](torch.tensor(sizes), ok.view(torch.int8), len(sizes), rows,
                                    align, GP=max(2, 1 << (len(sizes) - 1).bit_length()))
        assert bool(ok) == want, (sizes, rows, align)


def group_amax_and_expert_cast() -> None:
    """The per-group amax kernel against its torch ops (bits); the row cast finding each
    row's expert as row // N against the same cast given an ids tensor, and the reference."""
    from lowprec.formats.float8.triton_kernels import row_scaled_cast_kernel
    from lowprec.kernels.fp8_args import FP8_PARAMS
    from lowprec.kernels.group_amax import group_amax_torch
    from lowprec.kernels.group_amax_kernel import group_amax_kernel
    gen = torch.Generator().manual_seed(1)
    sizes = [5, 0, 40, 19]
    x = torch.randn(sum(sizes), 300, generator=gen) * 3
    x[7, 3] = float("inf")
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    out = torch.zeros(4, dtype=torch.int32)
    group_amax_kernel[(-(-x.shape[0] // 16),)](x, ids, out, x.shape[0], 300, 300, BR=16, BK=128)
    assert torch.equal(out, group_amax_torch(x, ids, 4).view(torch.int32))
    g, n, k = 5, 48, 200
    w = (torch.randn(g * n, k, generator=gen) * 10).half()
    scale = torch.rand(g, generator=gen) * 50
    mbits, bias, max_bits, fmax = FP8_PARAMS[torch.float8_e4m3fn]
    codes = []
    for by_ids in (True, False):
        y = torch.empty(g * n, k, dtype=torch.uint8)
        yt = torch.empty(k, g * n, dtype=torch.uint8)
        row_scaled_cast_kernel[(-(-g * n // 32), -(-k // 128))](
            w, y, yt, scale, torch.arange(g).repeat_interleave(n) if by_ids else scale, g * n,
            k, k, n, MBITS=mbits, BIAS=bias, MAX_BITS=max_bits, HW_CVT=False, COL_MODE=0,
            BM=32, BN=128, TRANS=True, BY_IDS=by_ids)
        codes.append((y, yt))
    ref = (w.float() * scale.repeat_interleave(n)[:, None]).clamp(-fmax, fmax).to(
        torch.float8_e4m3fn).view(torch.uint8)
    for y, yt in codes:
        assert torch.equal(y, ref) and torch.equal(yt, ref.t())


def nvfp4_expert_codes() -> None:
    """NVFP4 experts quantized by the kernels (each expert's S, then the row kernel with one
    S a 16-row block; ``formats/nvfp4/experts.py``): the codes, block scales and global
    scales of one quantize an expert, bit for bit (a NaN block and an expert 1000x the
    others included)."""
    from lowprec.formats.nvfp4 import NVFP4Quantizer, grouped
    from lowprec.formats.nvfp4 import experts as nvfp4_experts

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 32, 48, generator=gen) * 0.1).bfloat16()
    w[2] *= 1e3
    w[1, 3, 5] = float("nan")
    plain = grouped.use_kernels
    grouped.use_kernels = lambda t: True  # group_scales' kernel on these CPU tensors
    try:
        got = nvfp4_experts.experts_by_kernels(w)
    finally:
        grouped.use_kernels = plain
    want = nvfp4_experts.quantize_experts(w, NVFP4Quantizer(with_2d_quantization=True))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)


CHECKS = {"grouped_gemm_tiles": grouped_gemm_tiles, "moe_route": moe_route,
          "group_amax_and_expert_cast": group_amax_and_expert_cast,
          "nvfp4_expert_codes": nvfp4_expert_codes}
