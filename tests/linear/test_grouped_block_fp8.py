"""Grouped block-scaled FP8 (lowprec/linear/grouped_block_fp8.py): which settings it takes,
its layout and GEMMs on CPU (the kernel's sum in torch ops) against the per-expert Linears,
and on a Hopper GPU bit for bit the per-expert cuBLAS GEMMs with no host sync."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import (
    assert_grouped_equals_per_expert,
    assert_grouped_never_syncs,
    grouped_data,
    per_expert,
    run_grads,
)

import lowprec
from lowprec.gemm import block_grouped
from lowprec.kernels import triton_available, tuning
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import group_alignment_for, grouped_linear
from lowprec.linear.grouped_block_fp8 import BLOCK_FP8, block_fp8_quantizers, runs_on
from lowprec.linear.grouped_engine import GroupedFunction, GroupedPlan

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [(5, 0, 200, 130), (0, 0, 16, 0), (128, 1, 0, 255)]


def _block(w_dim=2, x_dim=1, grad=E4M3):
    return LinearQuantizers(
        input=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=x_dim),
        weight=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=w_dim),
        grad_output=lowprec.Float8BlockQuantizer(grad, block_scaling_dim=1))


def _data(sizes, k=512, n=512, seed=0, device="cpu"):
    return grouped_data(sizes, k, n, w_scale=0.05, seed=seed, device=device)


def test_takes_the_deepseek_settings_only():
    q = _block()
    picked = (q.input, q.weight, q.grad_output)
    assert block_fp8_quantizers([q] * 3, 512, 512) == picked
    assert block_fp8_quantizers([_block(w_dim=1)] * 3, 384, 256) is not None
    assert group_alignment_for(q, 512, 512) == block_grouped.ALIGN
    assert block_fp8_quantizers([_block(x_dim=2)] * 3, 512, 512) is None  # 2-D activations
    assert block_fp8_quantizers([q] * 3, 512, 448) is None  # K not whole blocks
    # 128x128 weights over a contraction cuBLAS refuses: that direction emulated exactly
    assert block_fp8_quantizers([q] * 3, 384, 640) == picked
    no_pow2 = LinearQuantizers(
        input=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1, force_pow_2_scales=False),
        weight=q.weight, grad_output=q.grad_output)
    assert block_fp8_quantizers([no_pow2] * 3, 512, 512) is None
    # one setting for every group
    assert block_fp8_quantizers([q, q, _block(w_dim=1)], 512, 512) is None
    assert not runs_on(torch.zeros(2, 512, dtype=torch.bfloat16), picked)  # CPU


def _grouped(q, sizes, aligned=False):
    def fn(x, w):
        picked = block_fp8_quantizers([q] * w.shape[0], w.shape[1], w.shape[2])
        return GroupedFunction.apply(x, torch.tensor(sizes, device=x.device),
                                     GroupedPlan(BLOCK_FP8, picked), True, aligned, w)
    return fn


def _close(got, ref):
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7,
                                   atol=2 ** -8 * b.float().abs().max().item())


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("w_dim", [1, 2])
def test_cpu_grouped_matches_per_expert(sizes, w_dim):
    """Off the GPU the kernel's chunked sum runs in fp32 torch ops and the per-expert GEMMs
    in the fp32 emulation: the same products, so equal to fp32 rounding before the bf16
    output; empty experts get zero weight gradients."""
    q = _block(w_dim)
    x, w, dy = _data(sizes)
    got = run_grads(_grouped(q, sizes), x, w, dy)
    _close(got, run_grads(per_expert(q, sizes), x, w, dy))
    assert torch.all(got[2][[g for g, m in enumerate(sizes) if m == 0]] == 0)


def test_cpu_caller_aligned_rows_equal_unaligned():
    sizes = (5, 0, 200, 130)
    x, w, dy = _data(sizes)
    padded = [-(-m // 128) * 128 for m in sizes]
    rows = torch.cat([torch.arange(m) + sum(padded[:g]) for g, m in enumerate(sizes)])
    xp, dyp = x.new_zeros(sum(padded), x.shape[1]), dy.new_zeros(sum(padded), dy.shape[1])
    xp[rows], dyp[rows] = x, dy
    q = _block()
    y, dx, dw = run_grads(_grouped(q, sizes), x, w, dy)
    yp, dxp, dwp = run_grads(_grouped(q, padded, aligned=True), xp, w, dyp)
    assert torch.equal(yp[rows], y) and torch.equal(dxp[rows], dx) and torch.equal(dwp, dw)


HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
         and triton_available()),
    reason="the grouped block FP8 kernel needs a Hopper GPU and Triton")
GPU_SIZES = [(5, 0, 200, 130), (128, 1, 0, 383), (0, 256, 0, 0), (1000, 3, 517, 64)]


@HOPPER
@pytest.mark.parametrize("sizes", GPU_SIZES)
@pytest.mark.parametrize("w_dim", [1, 2])
@pytest.mark.parametrize("k,n", [(512, 1024), (640, 384)])
def test_gpu_grouped_bit_identical_to_per_expert(sizes, w_dim, k, n):
    """The grouped kernel sums each 128-long chunk as cuBLAS's block-scaled GEMM does: the
    output and both gradients are the per-expert Linears' bits. (640, 384) with 128x128
    weights: cuBLAS takes neither weight GEMM, so forward and dgrad are the exact bf16
    emulation's, per expert and grouped."""
    q = _block(w_dim)
    x, w, dy = _data(sizes, k=k, n=n, device="cuda")
    assert runs_on(x, block_fp8_quantizers([q] * len(sizes), n, k))
    assert_grouped_equals_per_expert(x, w, dy, sizes, q)


@HOPPER
def test_gpu_caller_aligned_rows_bit_identical():
    sizes = (5, 0, 200, 130)
    x, w, dy = _data(sizes, device="cuda")
    padded = [-(-m // 128) * 128 for m in sizes]
    rows = torch.cat([torch.arange(m) + sum(padded[:g]) for g, m in enumerate(sizes)]).cuda()
    xp, dyp = x.new_zeros(sum(padded), x.shape[1]), dy.new_zeros(sum(padded), dy.shape[1])
    xp[rows], dyp[rows] = x, dy
    q = _block()
    pt = torch.tensor(padded, device="cuda")
    y, dx, dw = run_grads(lambda a, b: grouped_linear(a, b, torch.tensor(sizes, device="cuda"),
                                                      quantizers=q), x, w, dy)
    yp, dxp, dwp = run_grads(lambda a, b: grouped_linear(a, b, pt, quantizers=q,
                                                         group_alignment=128), xp, w, dyp)
    assert torch.equal(yp[rows], y) and torch.equal(dxp[rows], dx) and torch.equal(dwp, dw)


@HOPPER
def test_gpu_grouped_never_syncs():
    sizes = [300, 0, 17, 195]
    x, w, dy = _data(sizes, device="cuda")
    assert_grouped_never_syncs(x, w, dy, torch.tensor(sizes, device="cuda"), _block())


# the Triton kernel, then the Gluon kernel's configs: small experts, the two-warpgroup form
# with OVERLAP and the warp-specialized kernel (OVERLAP 2, large experts' rows)
KERNELS = {"triton": None, "gluon_small": (128, 2, False, 8, 4),
           "gluon_large": (128, 4, True, 8, 8), "gluon_ws": (128, 3, 2, 8, 4)}


@pytest.mark.parametrize("cfg", [(128, 3, True, 8, 4), (128, 3, 2, 8, 8), (128, 2, 3, 8, 4),
                                 (128, 2, False, 8, 2)])
def test_gluon_configs_the_kernels_do_not_run_are_refused(cfg):
    with pytest.raises(ValueError, match="block grouped Gluon config"):
        block_grouped.check_gluon_config(cfg)


def test_gluon_configs_of_the_table_and_the_gpu_test_are_accepted():
    for cfg in [*tuning.tuning.block_grouped_gluon_configs.values(), *KERNELS.values()]:
        if cfg is not None:
            block_grouped.check_gluon_config(cfg)


@HOPPER
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dim", [1, 2])
def test_gpu_kernel_bit_identical_to_cublas_per_group(w_dim, out_dtype, kernel):
    """Each group of every kernel's output (Triton's; Gluon's configs where Gluon imports)
    is cuBLAS's block-scaled GEMM of that group (``lowprec.gemm``): forward, dgrad (the
    experts side by side in the weights' columnwise codes) and wgrad; an empty group's
    wgrad is zeros."""
    cfg = KERNELS[kernel]
    if cfg is not None and not lowprec.kernels.gluon_available():
        pytest.skip("Gluon does not import")
    every = dict.fromkeys(tuning.tuning.block_grouped_gluon_configs, cfg)
    with tuning.override(block_grouped_gluon=cfg is not None,
                         block_grouped_gluon_configs=every):
        _kernel_vs_cublas(w_dim, out_dtype)


def _kernel_vs_cublas(w_dim, out_dtype):
    sizes = (384, 0, 128, 640, 256)
    q = _block(w_dim)
    x, w, dy = _data(sizes, device="cuda")
    num, n, k = w.shape
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xq = q.input.quantize(x)
    dyq = q.grad_output.quantize(dy)
    wqs = [q.weight.quantize(w[g]) for g in range(num)]
    wq = q.weight.quantize(w.reshape(-1, k))
    if w_dim == 2:
        w_dec, rows = wq.decode_scale("rowwise").view(num, n // 128, k // 128), 128
    else:
        w_dec, rows = wq.decode_scale("rowwise").t().reshape(num, n, k // 128), 1
    y = block_grouped.rows_by_experts(xq.rowwise_data, xq.decode_scale("rowwise").t(),
                                      wq.rowwise_data.view(num, n, k), w_dec, offs, 1, rows,
                                      out_dtype)
    w_t = wq.columnwise_data.view(k, num, n).permute(1, 0, 2)
    if w_dim == 2:
        w_tdec = wq.decode_scale("columnwise").view(k // 128, num, n // 128).permute(1, 0, 2)
    else:
        w_tdec = wq.decode_scale("columnwise").t().reshape(k, num, n // 128).permute(1, 0, 2)
    dx = block_grouped.rows_by_experts(dyq.rowwise_data, dyq.decode_scale("rowwise").t(), w_t,
                                       w_tdec, offs, 1, rows, out_dtype)
    dw = block_grouped.wgrad(dyq.columnwise_data, dyq.decode_scale("columnwise").t(),
                             xq.columnwise_data, xq.decode_scale("columnwise").t(), offs,
                             out_dtype)
    start = 0
    for g, m in enumerate(sizes):
        if m:
            xg = q.input.quantize(x[start:start + m])
            dyg = q.grad_output.quantize(dy[start:start + m])
            assert torch.equal(y[start:start + m], lowprec.gemm.gemm(
                xg, "rowwise", wqs[g], "rowwise", out_dtype=out_dtype))
            assert torch.equal(dx[start:start + m], lowprec.gemm.gemm(
                dyg, "rowwise", wqs[g], "columnwise", out_dtype=out_dtype))
            assert torch.equal(dw[g], lowprec.gemm.gemm(
                dyg, "columnwise", xg, "columnwise", out_dtype=out_dtype))
        else:
            assert torch.all(dw[g] == 0)
        start += m


@HOPPER
def test_gpu_compiled_experts_bit_identical_to_eager():
    """``lowprec.GroupedExperts`` under the block recipe and ``torch.compile(fullgraph=True)``
    (the experts one op of the graph, running the grouped block path): output and
    gradients the eager bits."""
    torch.manual_seed(0)
    hidden, ffn, experts, tokens = 512, 512, 4, 300
    mod = lowprec.GroupedExperts(experts, hidden, ffn, params_dtype=torch.bfloat16,
                                 device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, experts, (tokens, 2), device="cuda")
    weights = torch.rand(tokens, 2, device="cuda", dtype=torch.bfloat16)
    recipe = lowprec.recipe.Float8BlockScaling()

    def forward(m, xx):
        with lowprec.autocast(recipe=recipe):
            return m(xx, idx, weights)

    def step(fwd):
        xx = x.clone().requires_grad_(True)
        y = fwd(mod, xx)
        y.float().square().sum().backward()
        grads = (xx.grad, mod.gate_up_proj.grad.clone(), mod.down_proj.grad.clone())
        mod.zero_grad(set_to_none=True)
        return (y.detach(), *grads)

    eager = step(forward)
    torch._dynamo.reset()
    compiled = step(torch.compile(forward, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
