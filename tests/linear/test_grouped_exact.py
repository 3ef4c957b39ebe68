"""The grouped path of block formats emulated on bf16 GEMMs (MXFP8): which quantizers it
takes, its operands and GEMMs against one quantized Linear per group (CPU: against the
exact products, since the per-expert CPU GEMM is the fp32 emulation; Hopper: bit for bit
with the per-expert bf16 emulation), and no host sync."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import assert_grouped_equals_per_expert, grouped_data, per_expert, run_grads

import lowprec
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import group_alignment_for, grouped_linear
from lowprec.linear.grouped_engine import GroupedFunction, GroupedPlan
from lowprec.linear.grouped_exact import EXACT, exact_quantizers, row_align

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [(5, 0, 37, 22), (0, 0, 32, 0), (64, 1, 0, 31)]


def _grouped_mm_runs() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on the CPU (2.13 does)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.ones(16, 16, dtype=torch.bfloat16),
                          torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([16], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


CPU_GROUPED = pytest.mark.skipif(not _grouped_mm_runs(),
                                 reason="this torch has no CPU torch._grouped_mm")


def _mx(**kw):
    return LinearQuantizers(input=lowprec.MXFP8Quantizer(**kw),
                            weight=lowprec.MXFP8Quantizer(**kw),
                            grad_output=lowprec.MXFP8Quantizer(**kw))


def _data(sizes, k=64, n=96, seed=0, device="cpu"):
    return grouped_data(sizes, k, n, seed=seed, device=device)


def _exact(quantizers, sizes):
    def fn(x, w):
        picked = exact_quantizers([quantizers] * w.shape[0], w.shape[1], w.shape[2])
        sizes_t = torch.tensor(sizes, device=x.device)
        return GroupedFunction.apply(x, sizes_t, GroupedPlan(EXACT, picked), True, False, w)
    return fn


def test_takes_mxfp8_only_with_one_setting_and_whole_blocks():
    mx = _mx()
    assert exact_quantizers([mx] * 3, 96, 64) == (mx.input, mx.weight, mx.grad_output)
    assert row_align((mx.input, mx.weight, mx.grad_output)) == 32
    # other formats: per-tensor statistics (current, NVFP4) or cuBLAS FP8 GEMMs (block)
    current = LinearQuantizers(*(lowprec.Float8CurrentScalingQuantizer(E4M3) for _ in range(2)),
                               grad_output=lowprec.Float8CurrentScalingQuantizer(E4M3))
    block = LinearQuantizers(lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1),
                             lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=2),
                             grad_output=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1))
    nv = LinearQuantizers(lowprec.NVFP4Quantizer(), lowprec.NVFP4Quantizer(),
                          grad_output=lowprec.NVFP4Quantizer())
    for q in (current, block, nv):
        assert exact_quantizers([q] * 3, 128, 128) is None
    # mixed settings, a boundary quantizer, features that do not fill the blocks
    assert exact_quantizers([mx, _mx(fp8_dtype=E5M2)], 96, 64) is None
    assert exact_quantizers([_mx(with_2d_quantization=True)] * 2, 96, 64) is not None
    boundary = _mx()
    boundary.output = lowprec.MXFP8Quantizer()
    assert exact_quantizers([boundary], 96, 64) is None
    assert exact_quantizers([mx], 80, 64) is None and exact_quantizers([mx], 96, 48) is None
    hooked = _mx()
    hooked.input.quantize = hooked.input.quantize  # an instance attribute, as debug hooks set
    assert exact_quantizers([hooked, mx], 96, 64) is None


def _exact_products(quantizers, sizes, x, w, dy):
    """Each group's forward, dgrad and wgrad from its own quantizes (padded as the
    per-expert Linear pads), multiplied in fp64: what any fp32-accumulating GEMM of the
    exact values approximates."""
    q_x, q_w, q_dy = quantizers.input, quantizers.weight, quantizers.grad_output
    ys, dxs, dws = [], [], []
    for g, (xg, dyg) in enumerate(zip(torch.split(x, list(sizes)), torch.split(dy, list(sizes)))):
        m, pad = xg.shape[0], -xg.shape[0] % 32
        xp = torch.cat([xg, xg.new_zeros(pad, xg.shape[1])])
        dyp = torch.cat([dyg, dyg.new_zeros(pad, dyg.shape[1])])
        xq = q_x.quantize(xp).dequantize(dtype=torch.float32).double()
        xc = q_x.quantize(xp).dequantize(dtype=torch.float32, usage="columnwise").double()
        wq = q_w.quantize(w[g])
        wr = wq.dequantize(dtype=torch.float32).double()
        wc = wq.dequantize(dtype=torch.float32, usage="columnwise").double()
        dq = q_dy.quantize(dyp)
        dr = dq.dequantize(dtype=torch.float32).double()
        dc = dq.dequantize(dtype=torch.float32, usage="columnwise").double()
        ys.append((xq @ wr.t())[:m])
        dxs.append((dr @ wc)[:m])
        dws.append(dc.t() @ xc)
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _within_bf16_rounding(got, exact):
    # one rounding to bf16 of an fp32 sum of exact products: half an ulp, plus the fp32
    # sum's own error
    tol = exact.abs() * 2.0 ** -8 + exact.abs().amax() * 2.0 ** -20 + 1e-30
    assert ((got.double() - exact).abs() <= tol).all()


@CPU_GROUPED
@pytest.mark.parametrize("sizes", SIZES)
def test_exact_grouped_equals_exact_products_per_group(sizes):
    x, w, dy = _data(sizes)
    x[3] *= 1e3  # a row far above the others: its blocks alone scale for it
    q = _mx()
    y, dx, dw = run_grads(_exact(q, sizes), x, w, dy)
    ry, rdx, rdw = _exact_products(q, sizes, x, w, dy)
    _within_bf16_rounding(y, ry)
    _within_bf16_rounding(dx, rdx)
    _within_bf16_rounding(dw, rdw)
    # the per-expert Linears (fp32 emulation here) agree to the same rounding
    py, pdx, pdw = run_grads(per_expert(q, sizes), x, w, dy)
    _within_bf16_rounding(py, ry)
    _within_bf16_rounding(pdw, rdw)


def test_cpu_grouped_linear_stays_per_expert():
    sizes = (5, 0, 37, 22)
    x, w, dy = _data(sizes)
    assert_grouped_equals_per_expert(x, w, dy, sizes, _mx())


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a Hopper GPU")


@gpu
@pytest.mark.parametrize("sizes", SIZES + [(300, 2, 129, 33, 0, 64)])
@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_grouped_gpu_bit_identical_to_per_expert(sizes, two_d):
    x, w, dy = _data(sizes, k=256, n=128, device="cuda")
    q = _mx(with_2d_quantization=two_d)
    assert_grouped_equals_per_expert(x, w, dy, sizes, q)


@gpu
def test_mxfp8_grouped_gpu_list_weights_and_no_sync():
    sizes = [64, 0, 17, 47]
    x, w, dy = _data(sizes, k=256, n=128, device="cuda")
    q = _mx()
    sizes_t = torch.tensor(sizes, device="cuda")
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    xs = x.clone().requires_grad_(True)
    ws = [w[g].clone().requires_grad_(True) for g in range(len(sizes))]
    grouped_linear(xs, ws, sizes_t, quantizers=q).backward(dy)  # warm-up (compiles)
    for t in [xs, *ws]:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_linear(xs, ws, sizes_t, quantizers=q)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y.detach(), ref[0]) and torch.equal(xs.grad, ref[1])
    assert torch.equal(torch.stack([t.grad for t in ws]), ref[2])


def test_group_alignment_for_each_path_and_checked():
    assert group_alignment_for(_mx(), 96, 64) == 32
    current = LinearQuantizers(lowprec.Float8CurrentScalingQuantizer(E4M3),
                               lowprec.Float8CurrentScalingQuantizer(E4M3),
                               grad_output=lowprec.Float8CurrentScalingQuantizer(E4M3))
    assert group_alignment_for(current, 96, 64) == 16
    assert group_alignment_for(None, 96, 64) == 1
    nv = LinearQuantizers(lowprec.NVFP4Quantizer(), lowprec.NVFP4Quantizer(),
                          grad_output=lowprec.NVFP4Quantizer())
    assert group_alignment_for([nv, nv], 96, 64) == 16
    assert group_alignment_for([nv, nv], 96, 40) == 1  # no grouped NVFP4 path: no padding
    x, w, _ = _data((5, 0, 37, 22))
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="group_alignment"):
            grouped_linear(x, w, [5, 0, 37, 22], quantizers=_mx(), group_alignment=bad)
    with pytest.raises(ValueError, match="multiples of group_alignment=16"):
        grouped_linear(x, w, [5, 0, 37, 22], quantizers=_mx(), group_alignment=16)


@CPU_GROUPED
def test_rows_laid_out_by_the_caller_give_the_same_result():
    """Groups the caller already spread into whole blocks (zero rows after each) run as
    they are, and give on the real rows what the path's own padding gives."""
    sizes = (5, 0, 37, 22)
    x, w, dy = _data(sizes)
    padded = [-(-m // 32) * 32 for m in sizes]
    xp, dyp = x.new_zeros(sum(padded), x.shape[1]), dy.new_zeros(sum(padded), dy.shape[1])
    rows = torch.cat([torch.arange(m) + sum(padded[:g]) for g, m in enumerate(sizes)])
    xp[rows], dyp[rows] = x, dy
    q = _mx()
    picked = exact_quantizers([q] * len(sizes), w.shape[1], w.shape[2])

    def run(inp, grad, sizes_, aligned):
        inp = inp.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        y = GroupedFunction.apply(inp, torch.tensor(sizes_), GroupedPlan(EXACT, picked), True,
                                  aligned, ww)
        y.backward(grad)
        return y.detach(), inp.grad, ww.grad
    y, dx, dw = run(x, dy, sizes, False)
    yp, dxp, dwp = run(xp, dyp, padded, True)
    assert torch.equal(yp[rows], y) and torch.equal(dxp[rows], dx) and torch.equal(dwp, dw)
    assert not yp[~torch.isin(torch.arange(len(yp)), rows)].any()


@CPU_GROUPED
def test_one_expert_given_as_a_list():
    sizes = (37,)
    x, w, dy = _data(sizes)
    q = _mx()
    picked = exact_quantizers([q], w.shape[1], w.shape[2])
    ref = run_grads(_exact(q, sizes), x, w, dy)
    xx = x.clone().requires_grad_(True)
    ww = w[0].clone().requires_grad_(True)
    y = GroupedFunction.apply(xx, torch.tensor(sizes), GroupedPlan(EXACT, picked), True, False,
                              ww)
    y.backward(dy)
    assert torch.equal(y, ref[0]) and torch.equal(xx.grad, ref[1])
    assert torch.equal(ww.grad, ref[2][0])


def test_no_rows_take_the_per_group_path():
    x, w, dy = _data((0, 0, 0))
    for q in (_mx(), None):
        xx = x.clone().requires_grad_(True)
        y = grouped_linear(xx, w, torch.tensor([0, 0, 0]), quantizers=q)
        assert y.shape == (0, w.shape[1])
