"""grouped_linear: the grouped paths against one quantized Linear per group, bit for bit
where both run the same GEMM (CPU), and the group sizes read on the device."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import (
    assert_grouped_equals_per_expert,
    assert_grouped_never_syncs,
    per_expert,
    run_grads,
)

import lowprec
from lowprec.formats.float8 import grouped as fp8_grouped
from lowprec.linear import grouped_current
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import group_ids, grouped_linear
from lowprec.linear.grouped_current import current_scaling_quantizers
from lowprec.linear.grouped_parts import fused
from lowprec.recipe.recipes import Float8CurrentScaling, MXFP8BlockScaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [(5, 0, 37, 22), (0, 0, 16, 0), (64, 1, 0, 31)]


def _current(grad=E5M2, **kw):
    return LinearQuantizers(input=lowprec.Float8CurrentScalingQuantizer(E4M3, **kw),
                            weight=lowprec.Float8CurrentScalingQuantizer(E4M3, **kw),
                            grad_output=lowprec.Float8CurrentScalingQuantizer(grad, **kw))


def _data(sizes, k=64, n=48, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.1).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_groups_equals_each_group_quantized(sizes, pow2):
    x, w, _ = _data(sizes)
    x[sizes[0] // 2] *= 1e4  # one group's amax far above the others
    q = lowprec.Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=pow2, amax_epsilon=1e-3)
    ids = group_ids(torch.tensor(sizes), x.shape[0])
    data, scale = fp8_grouped.quantize_groups(x, ids, len(sizes), q)
    for g, xg in enumerate(torch.split(x, list(sizes))):
        ref = q.quantize(xg)
        if xg.shape[0]:  # an empty group's scale scales nothing
            assert torch.equal(scale[g:g + 1], ref.shared_scale)
            part = data[sum(sizes[:g]):sum(sizes[:g + 1])]
            assert torch.equal(part.view(torch.uint8), ref.rowwise_data.view(torch.uint8))
    wq, ws = fp8_grouped.quantize_experts(w, q)
    for g in range(w.shape[0]):
        ref = q.quantize(w[g])
        assert torch.equal(ws[g:g + 1], ref.shared_scale)
        assert torch.equal(wq[g].view(torch.uint8), ref.rowwise_data.view(torch.uint8))
    both, wt, ws2 = fp8_grouped.quantize_experts(w, q, transposed=True)
    assert torch.equal(both.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(ws2, ws)
    assert torch.equal(wt.view(torch.uint8),
                       wq.view(torch.uint8).reshape(-1, w.shape[2]).t())


def test_group_amax_nan_reaches_only_its_group():
    x, _, _ = _data((4, 4, 4))
    x[5, 3] = float("nan")
    amax = fp8_grouped.group_amax(x, group_ids(torch.tensor([4, 4, 4]), 12), 3)
    assert torch.isnan(amax[1]) and torch.isfinite(amax[[0, 2]]).all()
    assert amax[0] == x[:4].abs().amax().float()


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_current_grouped_bit_identical_to_per_expert(sizes, as_tensor):
    q = _current()
    x, w, dy = _data(sizes)
    group_sizes = torch.tensor(sizes) if as_tensor else list(sizes)
    got = run_grads(lambda a, b: grouped_linear(a, b, group_sizes, quantizers=q), x, w, dy)
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_plain_and_other_recipes_match_per_expert():
    sizes = (3, 0, 9)
    x, w, dy = _data(sizes)
    got = run_grads(lambda a, b: grouped_linear(a, b, torch.tensor(sizes)), x, w, dy)
    ref = run_grads(per_expert(None, sizes), x, w, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_current_scaling_quantizers_declines_mixed_settings():
    assert current_scaling_quantizers([_current(), _current()]) is not None
    assert current_scaling_quantizers([_current(), _current(force_pow_2_scales=True)]) is None
    q = _current()
    assert current_scaling_quantizers([LinearQuantizers(
        input=q.input, weight=q.weight, grad_output=q.grad_output, output=q.input)]) is None


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), MXFP8BlockScaling()],
                         ids=["current", "mxfp8"])
def test_module_tensor_splits_equal_list_splits(recipe):
    torch.manual_seed(0)
    sizes = [32, 0, 64, 32]
    mod = lowprec.GroupedLinear(4, 64, 32, bias=False, params_dtype=torch.bfloat16)
    x, _, dy = _data(sizes, k=64, n=32)

    def run(splits):
        xx = x.clone().requires_grad_(True)
        mod.zero_grad()
        with lowprec.autocast(recipe=recipe):
            y = mod(xx, splits)
        y.backward(dy)
        return y.detach(), xx.grad, [p.grad.clone() for p in mod.parameters()]

    y1, dx1, dw1 = run(sizes)
    y2, dx2, dw2 = run(torch.tensor(sizes))
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert all(torch.equal(a, b) for a, b in zip(dw1, dw2))


def test_bad_group_sizes():
    x, w, _ = _data((2, 2))
    with pytest.raises(ValueError, match="1-D integer tensor of 2 sizes"):
        grouped_linear(x, w, torch.tensor([2.0, 2.0]), quantizers=_current())
    with pytest.raises(ValueError, match="must have 2 non-negative sizes"):
        grouped_linear(x, w, torch.tensor([5, -1]), quantizers=_current())
    with pytest.raises(ValueError, match="m_splits sum to 3 but the input has 4 rows"):
        grouped_linear(x, w, [1, 2], quantizers=_current())
    with pytest.raises(ValueError, match=r"\(G, N, K\)"):
        grouped_linear(x, w[0], [2, 2])


HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="grouped GEMMs need a Hopper GPU")
GPU_SIZES = [(5, 0, 37, 22), (100, 0, 3, 253), (16, 32, 0, 48)]


def _cuda(*ts):
    return [t.cuda() for t in ts]


@HOPPER
@pytest.mark.parametrize("sizes", GPU_SIZES)
def test_plain_grouped_gpu_bit_identical_to_per_expert(sizes):
    x, w, dy = _cuda(*_data(sizes, k=256, n=128))
    got = run_grads(lambda a, b: grouped_linear(a, b, torch.tensor(sizes, device="cuda")), x, w, dy)
    ref = run_grads(per_expert(None, sizes), x, w, dy)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@HOPPER
@pytest.mark.parametrize("grad", [E4M3, E5M2], ids=["e4m3", "hybrid"])
@pytest.mark.parametrize("sizes", GPU_SIZES)
def test_current_grouped_gpu_bit_identical_to_per_expert(sizes, grad):
    """The Triton grouped GEMMs give each expert's cuBLAS bits: output and dX always, dW
    where every group's rows are a multiple of 16 (the per-expert wgrad of other sizes is
    not a cuBLAS GEMM, which wants contractions of 16s: it runs emulated, within fp32
    rounding of the same sum)."""
    q = _current(grad)
    x, w, dy = _cuda(*_data(sizes, k=256, n=128))
    assert grouped_current.gemm_backend(x, 128, len(sizes), E4M3, E4M3) == "triton"
    got = run_grads(lambda a, b: grouped_linear(a, b, torch.tensor(sizes, device="cuda"),
                                           quantizers=q), x, w, dy)
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    if all(m % 16 == 0 for m in sizes):
        assert torch.equal(got[2], ref[2])
    else:
        torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=2 ** -7,
                                   atol=2 ** -7 * ref[2].float().abs().max().item())
    assert torch.all(got[2][[g for g, m in enumerate(sizes) if m == 0]] == 0)


@HOPPER
@pytest.mark.parametrize("sizes", GPU_SIZES)
def test_current_grouped_gpu_cutlass_operands_exact_and_gemms_close(sizes, monkeypatch):
    """Few large experts run ``torch._scaled_grouped_mm`` (forced here for small ones): the
    quantized operands are the per-expert kernels' bits; the GEMMs (another kernel than the
    per-expert cuBLAS one) are within bf16 rounding of the per-expert result."""
    monkeypatch.setattr(lowprec.gemm.table, "CUTLASS_ROWS", 0)
    q = _current(E4M3)
    x, w, dy = _cuda(*_data(sizes, k=256, n=128))
    assert grouped_current.gemm_backend(x, 128, len(sizes), E4M3, E4M3) == "cutlass"
    ids = group_ids(torch.tensor(sizes, device="cuda"), x.shape[0])
    data, scale = fused(fp8_grouped.quantize_groups, x)(x, ids, len(sizes), q.input)
    for g, xg in enumerate(torch.split(x, list(sizes))):
        if xg.shape[0]:
            ref = q.input.quantize(xg)  # the Triton kernel
            start = sum(sizes[:g])
            assert torch.equal(scale[g:g + 1], ref.shared_scale)
            assert torch.equal(data[start:start + xg.shape[0]].view(torch.uint8),
                               ref.rowwise_data.view(torch.uint8))
    got = run_grads(lambda a, b: grouped_linear(a, b, torch.tensor(sizes, device="cuda"),
                                           quantizers=q), x, w, dy)
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7,
                                   atol=2 ** -7 * b.float().abs().max().item())
    assert torch.all(got[2][[g for g, m in enumerate(sizes) if m == 0]] == 0)


@HOPPER
def test_fp32_current_grouped_gpu_runs_per_group():
    """FP8 grouped GEMMs write bf16 only: fp32 activations take the per-group GEMMs."""
    sizes = (5, 0, 37, 22)
    x, w, dy = _cuda(*_data(sizes, k=256, n=128, dtype=torch.float32))
    q = _current(E4M3)
    assert_grouped_equals_per_expert(x, w, dy, sizes, q)


@HOPPER
@pytest.mark.parametrize("grad", [None, E4M3, E5M2], ids=["plain", "e4m3", "hybrid"])
def test_grouped_gpu_never_syncs(grad):
    sizes = torch.tensor([64, 0, 17, 47], device="cuda")
    x, w, dy = _cuda(*_data([64, 0, 17, 47], k=256, n=128))
    assert_grouped_never_syncs(x, w, dy, sizes, _current(grad) if grad else None)


def test_cached_expert_weights_quantized_once_per_step(monkeypatch):
    """autocast(cache_weights=True): a 3-D expert weight is quantized once while it is
    unchanged (micro-batches), again after an in-place update; the same results."""
    calls = []
    real = fp8_grouped.quantize_experts
    monkeypatch.setattr(fp8_grouped, "quantize_experts",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = _current()
    x, w, dy = _data((7, 0, 9))
    w = torch.nn.Parameter(w)
    sizes = torch.tensor([7, 0, 9])
    with lowprec.autocast(recipe=Float8CurrentScaling(), cache_weights=True):
        outs = [grouped_linear(x, w, sizes, quantizers=q) for _ in range(2)]
    assert len(calls) == 1 and torch.equal(outs[0], outs[1])
    with torch.no_grad():
        w.mul_(2)
    with lowprec.autocast(recipe=Float8CurrentScaling(), cache_weights=True):
        again = grouped_linear(x, w, sizes, quantizers=q)
    assert len(calls) == 2 and torch.equal(again, grouped_linear(x, w, sizes, quantizers=q))


def test_cached_list_weights_quantized_once(monkeypatch):
    """GroupedLinear's G separate weights are cached together (no re-quantize per call)."""
    calls = []
    real = fp8_grouped.quantize_experts
    monkeypatch.setattr(fp8_grouped, "quantize_experts",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    mod = lowprec.GroupedLinear(3, 64, 48, bias=False, params_dtype=torch.bfloat16)
    x, _, _ = _data((7, 0, 9))
    with lowprec.autocast(recipe=Float8CurrentScaling(), cache_weights=True):
        outs = [mod(x, torch.tensor([7, 0, 9])) for _ in range(3)]
    assert len(calls) == 1 and all(torch.equal(outs[0], o) for o in outs)


@pytest.mark.parametrize("q", [None, "current"])
def test_bad_tensor_sizes_refused_on_every_path(q):
    x, w, _ = _data((2, 2))
    quantizers = _current() if q else None
    for bad in (torch.tensor([2.0, 2.0]), torch.tensor([[2, 2]]), torch.tensor([True, True])):
        with pytest.raises(ValueError, match="1-D integer tensor of 2 sizes"):
            grouped_linear(x, w, bad, quantizers=quantizers)


@HOPPER
@pytest.mark.parametrize("grad", [E4M3, E5M2], ids=["e4m3", "hybrid"])
def test_current_grouped_gpu_caller_aligned_rows_equal_unaligned(grad):
    """Groups laid out by the caller at multiples of 16 rows (zero rows after each; the
    cast then also writes wgrad's transposed codes) give the real rows' results and the
    weight gradients of the unaligned call, bit for bit."""
    sizes = (5, 0, 37, 22)
    x, w, dy = _cuda(*_data(sizes, k=256, n=128))
    padded = [-(-m // 16) * 16 for m in sizes]
    rows = torch.cat([torch.arange(m) + sum(padded[:g]) for g, m in enumerate(sizes)]).cuda()
    xp = x.new_zeros(sum(padded), x.shape[1]).index_copy_(0, rows, x)
    dyp = dy.new_zeros(sum(padded), dy.shape[1]).index_copy_(0, rows, dy)
    q = _current(grad)
    y, dx, dw = run_grads(lambda a, b: grouped_linear(
        a, b, torch.tensor(sizes, device="cuda"), quantizers=q), x, w, dy)
    yp, dxp, dwp = run_grads(lambda a, b: grouped_linear(
        a, b, torch.tensor(padded, device="cuda"), quantizers=q, group_alignment=16),
        xp, w, dyp)
    # both wgrads contract the same 16-row-aligned layout
    assert torch.equal(yp[rows], y) and torch.equal(dxp[rows], dx) and torch.equal(dwp, dw)


def test_gemm_backend_follows_the_table(monkeypatch):
    """FP8 current scaling's grouped GEMM is the GEMM table's route for its device (here a
    Hopper GPU with Triton, described by hand): CUTLASS from CUTLASS_ROWS rows an expert
    with E4M3 operands, the Triton kernel below that and for E5M2 gradients, none for
    other activations or features not multiples of 16."""
    from lowprec.gemm import GroupedDevice, table
    monkeypatch.setattr(grouped_current, "grouped_device",
                        lambda t: GroupedDevice(True, True, True, True))
    rows = table.CUTLASS_ROWS * 4
    big = torch.empty(rows, 64, dtype=torch.bfloat16)
    small = torch.empty(rows - 16, 64, dtype=torch.bfloat16)
    assert grouped_current.gemm_backend(big, 48, 4, E4M3, E4M3) == "cutlass"
    assert grouped_current.gemm_backend(small, 48, 4, E4M3, E4M3) == "triton"
    assert grouped_current.gemm_backend(big, 48, 4, E5M2, E4M3) == "triton"
    assert grouped_current.gemm_backend(big, 48, 4, E5M2, E5M2) is None
    assert grouped_current.gemm_backend(big.float(), 48, 4, E4M3, E4M3) is None
    assert grouped_current.gemm_backend(big, 40, 4, E4M3, E4M3) is None  # N not 16s
    assert grouped_current.gemm_backend(big, 48, 4, E4M3, E4M3) is not None
    monkeypatch.setattr(grouped_current, "grouped_device", lambda t: GroupedDevice())
    assert grouped_current.gemm_backend(big, 48, 4, E4M3, E4M3) is None  # the CPU


def test_route_kept_per_quantizers_sees_hooks_come_and_go():
    """The route the quantizers decide is kept with them, and a debug hook put on them
    later (an instance attribute shadowing ``quantize``) is seen: each group then
    quantizes through its own quantizer; with the hooks gone, the grouped quantize again."""
    sizes = (5, 0, 37, 22)
    qs = [_current() for _ in sizes]
    x, w, _ = _data(sizes)
    ref = grouped_linear(x, w, torch.tensor(sizes), quantizers=qs)
    seen = []
    for q in qs:
        original = q.input.quantize

        def quantize(t, *args, original=original, **kwargs):
            seen.append(t.shape[0])
            return original(t, *args, **kwargs)
        q.input.quantize = quantize
    got = grouped_linear(x, w, torch.tensor(sizes), quantizers=qs)
    assert sorted(seen) == sorted(sizes) and torch.equal(got, ref)
    for q in qs:
        del q.input.quantize
    seen.clear()
    assert torch.equal(grouped_linear(x, w, torch.tensor(sizes), quantizers=qs), ref)
    assert seen == []


def _under_torch_autocast(fn, device):
    def run(a, b):
        with torch.autocast(device, dtype=torch.bfloat16):
            return fn(a, b)
    return run


@pytest.mark.parametrize("q", [None, "current", "mxfp8"])
def test_torch_autocast_equals_per_expert_linears(q, monkeypatch):
    """Under torch.autocast over fp32 rows and weights: each group's Linear bits (the
    operands cast to bf16, fp32 weight gradients), the grouped paths open (current
    scaling's grouped quantize runs)."""
    grouped_quantizes = []
    quantize_groups = fp8_grouped.quantize_groups

    def counting(*args, **kwargs):
        grouped_quantizes.append(1)
        return quantize_groups(*args, **kwargs)
    monkeypatch.setattr(fp8_grouped, "quantize_groups", counting)
    qs = {None: None, "current": _current(E4M3),
          "mxfp8": lowprec.Recipe.from_name("mxfp8")}[q]
    if q == "mxfp8":
        from lowprec.recipe.state import stateless_quantizers
        fq = stateless_quantizers(qs, "forward", [None, None])
        bq = stateless_quantizers(qs, "backward", [None])
        qs = LinearQuantizers(input=fq[0], weight=fq[1], grad_output=bq[0])
    sizes = (32, 0, 64, 32)
    x, w, dy = _data(sizes, k=64, n=64, dtype=torch.float32)
    t = torch.tensor(sizes)
    got = run_grads(_under_torch_autocast(
        lambda a, b: grouped_linear(a, b, t, quantizers=qs), "cpu"), x, w, dy)
    ref = run_grads(_under_torch_autocast(per_expert(qs, sizes), "cpu"), x, w, dy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert bool(grouped_quantizes) == (q == "current")


@HOPPER
@pytest.mark.parametrize("q", [None, "current"])
def test_torch_autocast_gpu_takes_the_grouped_path(q):
    """On a Hopper GPU under torch.autocast: the grouped path (nothing waits for the
    host), each expert's bits."""
    qs = None if q is None else _current(E4M3)
    sizes = (32, 0, 64, 32)
    x, w, dy = _cuda(*_data(sizes, k=256, n=128, dtype=torch.float32))
    t = torch.tensor(sizes, device="cuda")
    got = run_grads(_under_torch_autocast(
        lambda a, b: grouped_linear(a, b, t, quantizers=qs), "cuda"), x, w, dy)
    ref = run_grads(_under_torch_autocast(per_expert(qs, sizes), "cuda"), x, w, dy)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert_grouped_never_syncs(x, w, dy.bfloat16(), t, qs)
