"""Triton quantize kernels for per-tensor FP8, block FP8 and MXFP8 against the reference.

GPU-only (CUDA + Triton); skipped elsewhere. Every case quantizes the same CUDA input
through the kernel path and through the pure-PyTorch reference
(``lowprec.kernels.reference_only()``) and requires identical fp8 bytes, scales and
recorded amaxes, except that a NaN may have any NaN bit pattern (NaN masks must match).
``tests/slow/test_fuzz_kernels_fp8.py`` (``pytest -m slow``) runs the much larger sweep
(exhaustive element rules, many more shapes and settings).
"""

from __future__ import annotations

import pytest
import torch
from format_inputs import spread
from helpers import GPU_ONLY

from lowprec.formats.block.quantizer import Float8BlockQuantizer
from lowprec.formats.block.tensor import Float8BlockwiseTensor
from lowprec.formats.float8.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from lowprec.formats.float8.tensor import Float8Tensor
from lowprec.formats.mxfp8 import launch as mx_launch
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.formats.mxfp8.reference import block_exponents
from lowprec.kernels import reference_only

pytestmark = GPU_ONLY

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
USAGES = {"both": (True, True), "row": (True, False), "col": (False, True)}

QUANTIZERS = {
    "current": lambda f: Float8CurrentScalingQuantizer(f),
    "current_pow2_eps": lambda f: Float8CurrentScalingQuantizer(f, force_pow_2_scales=True,
                                                                amax_epsilon=1e-3),
    "delayed": lambda f: Float8Quantizer(torch.tensor([0.37], device="cuda"),
                                         torch.full((1,), -1.0, device="cuda"), f),
    "delayed_saturating": lambda f: Float8Quantizer(torch.tensor([2.0 ** 40], device="cuda"),
                                                    torch.full((1,), -1.0, device="cuda"), f),
    "block1x128": lambda f: Float8BlockQuantizer(f, block_scaling_dim=1),
    "block128x128": lambda f: Float8BlockQuantizer(f, block_scaling_dim=2),
    "block1x128_nopow2": lambda f: Float8BlockQuantizer(f, block_scaling_dim=1,
                                                        force_pow_2_scales=False),
    "mxfp8": lambda f: MXFP8Quantizer(f),
    "mxfp8_2d": lambda f: MXFP8Quantizer(f, with_2d_quantization=True),
}

# 2-D and 3-D, odd leading dims, a transposed (non-contiguous) view
SHAPES = [(256, 384), (100, 128), (3, 40, 256), (4, 64, 384), (7, 32), ("t", 128, 256)]


def _input(shape, dtype, dist, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    transposed = shape[0] == "t"
    if transposed:
        shape = shape[1:]
    x = spread(torch.randn(shape[::-1] if transposed else shape, generator=g, device="cuda"),
               dtype, dist, g)
    x2 = x.view(-1, x.shape[-1])
    if dist == "special":
        m, k = x2.shape
        x2[: min(m, 32), : min(k, 64)] = 0
        x2[min(m - 1, 5), min(k - 1, 7)] = float("nan")
        x2[m - 1, k - 1] = float("inf")
    return x.t() if transposed else x


def _assert_same(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.is_contiguous(), what
    if a.dtype == torch.uint8:
        assert torch.equal(a, b), what
        return
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(nan_a, nan_b), what
    ints = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b]), what


def _matches_reference(kind, usage, x, what, qk=None, qr=None):
    """Quantizes ``x`` with a per-tensor quantizer of ``kind`` through the kernels and the
    reference (fresh quantizers unless given) and requires the same bytes, decode scale and
    recorded amax."""
    qk = qk if qk is not None else QUANTIZERS[kind](E4).set_usage(*USAGES[usage])
    qr = qr if qr is not None else QUANTIZERS[kind](E4).set_usage(*USAGES[usage])
    with reference_only():
        ref = qr.quantize(x)
    got = qk.quantize(x)
    for name, t in got.inner_tensors().items():
        _assert_same(t, ref.inner_tensors()[name], f"{what} {name}")
    _assert_same(got.decode_scale().reshape(1), torch.reciprocal(ref.shared_scale),
                 f"{what} decode scale")
    if hasattr(qk, "amax"):
        _assert_same(qk.amax, qr.amax, f"{what} recorded amax")


@pytest.mark.parametrize("dist", ["normal", "wide", "tiny", "special"])
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_kernel_matches_reference(kind, fp8_dtype, dtype, usage, dist):
    for i, shape in enumerate(SHAPES):
        x = _input(shape, dtype, dist, seed=i)
        qk = QUANTIZERS[kind](fp8_dtype).set_usage(*USAGES[usage])
        qr = QUANTIZERS[kind](fp8_dtype).set_usage(*USAGES[usage])
        try:
            with reference_only():
                ref = qr.quantize(x)
        except ValueError:
            with pytest.raises(ValueError):
                qk.quantize(x)
            continue
        got = qk.quantize(x)
        assert type(got) is type(ref) and got.metadata() == ref.metadata()
        for name, t in got.inner_tensors().items():
            _assert_same(t, ref.inner_tensors()[name], f"{kind} {shape} {name}")
        if hasattr(qk, "amax"):
            _assert_same(qk.amax, qr.amax, f"{kind} {shape} recorded amax")
            assert qk.scale.item() == qr.scale.item()  # the recipe-owned scale is untouched
        if isinstance(got, Float8Tensor):
            # the decode scale the kernel wrote is the one the GEMMs get, and exact
            assert got._decode is not None and got._decode[0] is got.shared_scale
            assert got._decode[2].data_ptr() % 16 == 0  # cuBLAS takes aligned scales only
            _assert_same(got.decode_scale().reshape(1), torch.reciprocal(ref.shared_scale),
                         f"{kind} {shape} decode scale")
        if isinstance(got, Float8BlockwiseTensor):
            _check_block_decode(got, ref, f"{kind} {shape}", qk)


def _check_block_decode(got, ref, what, quantizer):
    """The block kernel's decode scales (kept records) equal the ones computed from the
    reference's scales, in the same cuBLAS layout. A tensor with partial blocks keeps no
    records (they hold the zero-padded layout, ``Quantizer._tensor_of``): its decode
    scales are computed from its scales, as the reference's are."""
    k = got.shape[-1]
    m = got.numel() // k
    partial = quantizer._whole_blocks(got.shape, m, k) != (m, k)
    for usage in ("rowwise", "columnwise"):
        scale = getattr(got, f"{usage}_scale")
        rec = getattr(got, f"_decode_{usage}")
        if scale is None or partial:
            assert rec is None, what
            if scale is not None:
                _assert_same(got.decode_scale(usage), ref.decode_scale(usage),
                             f"{what} {usage} decode")
            continue
        assert rec is not None and rec[0] is scale, what
        assert getattr(ref, f"_decode_{usage}") is None  # computed below, not a record
        _assert_same(got.decode_scale(usage), ref.decode_scale(usage), f"{what} {usage} decode")
        assert got.decode_scale(usage) is rec[2]


@pytest.mark.parametrize("kind", ["current", "delayed", "block1x128", "block128x128", "mxfp8",
                                  "mxfp8_2d"])
def test_kernel_split_launches_match(kind):
    """Both usages as two launches (rowwise-only + columnwise-only) give the same bytes."""
    from lowprec.kernels import tuning
    x = _input((256, 384), torch.float32, "special", seed=11)
    fused = QUANTIZERS[kind](E4).quantize(x)
    with tuning.override(split_both=dict.fromkeys(tuning.tuning.split_both, True)):
        split = QUANTIZERS[kind](E4).quantize(x)
    for name, t in fused.inner_tensors().items():
        _assert_same(t, split.inner_tensors()[name], f"{kind} {name}")
    if isinstance(fused, Float8BlockwiseTensor):
        for usage in ("rowwise", "columnwise"):
            _assert_same(split.decode_scale(usage), fused.decode_scale(usage), f"{kind} {usage}")


@pytest.mark.parametrize("order", [(0, 0), (1, 0), (0, 1), (1, 1)],
                         ids=["m_fast", "k_fast", "m_fast_bottom_up", "k_fast_bottom_up"])
@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_cast_tile_orders_match_reference(kind, order):
    """The per-tensor cast reads its tiles in any order (grid axis along K, rows from the
    last up, several tiles a program) and gives the reference's bytes: the scale store and
    the delayed finish are done by exactly one program in each order."""
    from lowprec.kernels import tuning
    configs = {"cast_both": (64, 128, 4, 2, 1), "cast_row": (16, 256, 4, 3, 1),
               "cast_col": (64, 128, 4, 1, 1)}
    fp8_configs = dict(tuning.tuning.fp8_configs)
    for key, (bm, bn, warps, iters, stages) in configs.items():
        fp8_configs[key] = (bm, bn, warps, iters, stages, *order)
    # current scaling: amax pass + cast
    with tuning.override(one_launch_current=False, fp8_configs=fp8_configs):
        for usage in USAGES:
            for i, shape in enumerate([(300, 520), (4, 64, 384), ("t", 128, 256)]):
                x = _input(shape, torch.bfloat16, "special" if i == 0 else "normal",
                           seed=20 + i)
                _matches_reference(kind, usage, x, f"{kind} {order} {usage} {shape}")


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("kind", ["current", "delayed", "current_pow2_eps", "current_one_launch"])
def test_quantizes_leave_their_amax_words_zero(kind, usage):
    """A per-tensor quantizer's amax pass and cast count in words kept on the quantizer;
    each quantize sets them back to zero, so a later, smaller input gets its own amax (not
    the earlier one's), and a NaN input does not poison the next quantize. Current scaling
    in two launches (amax pass, cast) and in one cooperative launch."""
    from lowprec.formats.float8 import launch
    from lowprec.kernels import tuning
    one_launch = kind == "current_one_launch"
    kind = "current" if kind == "current_one_launch" else kind
    qk = QUANTIZERS[kind](E4).set_usage(*USAGES[usage])
    qr = QUANTIZERS[kind](E4).set_usage(*USAGES[usage])
    big = _input((300, 520), torch.bfloat16, "normal", seed=3) * 1000
    nan = _input((256, 384), torch.bfloat16, "special", seed=4)
    small = _input((4, 64, 384), torch.bfloat16, "normal", seed=5)
    with tuning.override(one_launch_current=one_launch):
        for x in (big, nan, small, big, small):
            _matches_reference(kind, usage, x, f"{usage} {tuple(x.shape)}", qk, qr)
            (words,) = qk._amax_words.values()  # one stream, one set
            assert words.tolist() == [0] * launch.AMAX_WORDS


@pytest.mark.parametrize("dist", ["normal", "wide", "special"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_current_one_launch_matches_reference(dtype, dist):
    """Current scaling in one cooperative launch (opt-in) gives the reference's bytes on
    every shape, usage and setting the two-launch path is tested on."""
    from lowprec.kernels import tuning
    with tuning.override(one_launch_current=True):
        for kind in ("current", "current_pow2_eps"):
            for usage in USAGES:
                for i, shape in enumerate(SHAPES):
                    x = _input(shape, dtype, dist, seed=40 + i)
                    _matches_reference(kind, usage, x, f"{kind} {usage} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_current_one_launch_with_several_tiles_a_program(dtype):
    """More tiles than the cooperative grid has programs (several a program, the last
    ones partly or wholly past the edge): the one-launch current quantize still gives the
    reference's bytes, in both usages, with NaN and Inf in the input."""
    from lowprec.kernels import tuning
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bm, bn, _, per_sm = tuning.tuning.fp8_configs["current_one"]
    m, k = bm * 2 * sms * per_sm // 9 + 37, bn * 9 + 40  # > 2 tiles a program, ragged
    x = _input((m, k), dtype, "special", seed=31)
    x2 = _input((m // 3, k), dtype, "normal", seed=32)  # finite next: words left zero
    with tuning.override(one_launch_current=True):
        for usage in USAGES:
            qk = QUANTIZERS["current"](E4).set_usage(*USAGES[usage])
            qr = QUANTIZERS["current"](E4).set_usage(*USAGES[usage])
            _matches_reference("current", usage, x, f"{usage} first", qk, qr)
            _matches_reference("current", usage, x2, f"{usage} second", qk, qr)


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_amax_words_are_per_stream_and_not_shared_by_copies(kind, no_kernel_loads_in_capture):
    """Quantizes of one quantizer on two streams, or of a quantizer and its copy, count in
    words of their own; none are kept for a quantize under CUDA graph capture (the graph
    zeroes its own on each replay), and the capture compiles no kernel the eager quantize
    did not."""
    from lowprec.formats.float8 import launch

    def kept_ptrs(quantizer):
        return {w.data_ptr() for w in quantizer._amax_words.values()}
    q = QUANTIZERS[kind](E4)
    x = _input((256, 384), torch.bfloat16, "normal", seed=50)
    ref = q.quantize(x)
    (first,) = q._amax_words.values()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = q.quantize(x)
    torch.cuda.current_stream().wait_stream(side)
    assert len({w.data_ptr() for w in q._amax_words.values()}) == 2  # a set per stream
    for name, t in on_side.inner_tensors().items():
        _assert_same(t, ref.inner_tensors()[name], f"{kind} side stream {name}")
    twin = q.copy()
    assert "_amax_words" not in twin.__dict__ and first.data_ptr() in kept_ptrs(q)
    twin.quantize(x)
    assert all(w.data_ptr() != first.data_ptr() for w in twin._amax_words.values())
    torch.cuda.synchronize()
    kept = kept_ptrs(q)
    g = torch.cuda.CUDAGraph()
    # (no_kernel_loads_in_capture: every kernel the capture launches was loaded eagerly)
    with torch.cuda.graph(g):
        assert launch.kept_amax_words(q, x.device).data_ptr() not in kept
        graphed = q.quantize(x)
    assert kept_ptrs(q) == kept  # the capture kept no words
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    for name, t in graphed.inner_tensors().items():
        _assert_same(t, ref.inner_tensors()[name], f"{kind} graph replay {name}")
    for w in list(q._amax_words.values()) + list(twin._amax_words.values()):
        assert w.tolist() == [0] * launch.AMAX_WORDS


@pytest.mark.parametrize("kind", ["current", "delayed", "block1x128", "mxfp8"])
def test_kernel_update_quantized_in_place(kind):
    x = _input((256, 256), torch.bfloat16, "normal", seed=7)
    q = QUANTIZERS[kind](E4)
    qt = q.make_empty(x.shape, dtype=x.dtype, device="cuda")
    buffers = {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None}
    q.update_quantized(x, qt)
    assert {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None} == buffers
    with reference_only():
        ref = QUANTIZERS[kind](E4).quantize(x)
    for name, t in qt.inner_tensors().items():
        _assert_same(t, ref.inner_tensors()[name], f"{kind} {name}")


def test_kernel_path_is_used_and_respects_reference_only(monkeypatch):
    """The dispatch goes to the launcher on CUDA and to the reference under reference_only."""
    from lowprec.formats.mxfp8 import launch
    calls = []
    orig = launch.quantize_mxfp8
    monkeypatch.setattr(launch, "quantize_mxfp8", lambda *a: calls.append(1) or orig(*a))
    x = torch.randn(64, 64, device="cuda")
    MXFP8Quantizer(E4).quantize(x)
    assert calls == [1]
    with reference_only():
        MXFP8Quantizer(E4).quantize(x)
    assert calls == [1]


@pytest.mark.parametrize("kind", ["current", "delayed", "block128x128", "mxfp8"])
def test_kernel_torch_compile_fullgraph(kind):
    x = _input((256, 512), torch.bfloat16, "normal", seed=3)
    q_eager, q_comp = QUANTIZERS[kind](E4), QUANTIZERS[kind](E4)

    def run(q, t):
        qt = q.quantize(t)
        return tuple(getattr(qt, n) for n in type(qt)._inner if getattr(qt, n) is not None)

    torch._dynamo.reset()
    got = torch.compile(lambda t: run(q_comp, t), fullgraph=True)(x)
    want = run(q_eager, x)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _assert_same(a, b, kind)
    if hasattr(q_eager, "amax"):
        _assert_same(q_comp.amax, q_eager.amax, "amax")


def test_decode_scale_helper_is_torch_reciprocal():
    """The kernels' ``decode_scale`` is bit for bit ``torch.reciprocal`` on fp32 bit patterns
    from the whole range (subnormal results of huge scales included) and the special values."""
    import triton
    import triton.language as tl

    from lowprec.kernels.fp8_cast import decode_scale

    @triton.jit
    def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, decode_scale(x), mask=offs < n)

    g = torch.Generator(device="cuda").manual_seed(5)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 22,), generator=g, device="cuda",
                         dtype=torch.int32)
    special = torch.tensor([0.0, -0.0, 1.0, 448.0, 57344.0, float("inf"), float("nan"),
                            torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny,
                            1e-45, 3e-39, 2.0 ** 126, 2.0 ** 127 * 1.5], device="cuda")
    x = torch.cat([bits.view(torch.float32), special])
    y = torch.empty_like(x)
    _kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    _assert_same(y, torch.reciprocal(x), "decode_scale")


def test_decode_scale_offset_agrees():
    from lowprec.formats.float8 import launch, triton_kernels
    assert launch.DECODE_AT == triton_kernels.DECODE_AT.value
    assert launch.DECODE_AT * 4 % 16 == 0


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_decode_scale_follows_in_place_scale_changes(kind):
    """A kept decode scale is used only while the scale it came from is unmodified."""
    x = _input((64, 128), torch.bfloat16, "normal", seed=2)
    qt = QUANTIZERS[kind](E4).quantize(x)
    assert qt.decode_scale() is qt._decode[2]
    qt.shared_scale.mul_(4.0)
    assert torch.equal(qt.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))
    like = QUANTIZERS[kind](E4).quantize_usage_like(x.reshape(64, 128), qt, "columnwise")
    assert like.shared_scale is qt.shared_scale
    assert torch.equal(like.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))


@pytest.mark.parametrize("kind", ["block1x128", "block128x128"])
def test_block_decode_scale_follows_in_place_scale_changes(kind):
    x = _input((256, 384), torch.bfloat16, "normal", seed=5)
    qt = QUANTIZERS[kind](E4).quantize(x)
    kept = qt.decode_scale("rowwise")
    assert kept is qt._decode_rowwise[2]
    qt.rowwise_scale.mul_(4.0)
    fresh = qt.decode_scale("rowwise")
    assert fresh is not kept and not torch.equal(fresh, kept)
    with reference_only():
        ref = QUANTIZERS[kind](E4).quantize(x)
    ref.rowwise_scale.mul_(4.0)
    _assert_same(fresh, ref.decode_scale("rowwise"), kind)
    assert qt.decode_scale("columnwise") is qt._decode_columnwise[2]  # its scale is untouched


@pytest.mark.parametrize("kind", ["current", "delayed", "block1x128"])
def test_quantize_under_inference_mode(kind):
    """Inference tensors have no version counter: no decode record, the GEMM scale is
    computed (and the quantize does not raise)."""
    x = _input((128, 256), torch.bfloat16, "normal", seed=4)
    with torch.inference_mode():
        qt = QUANTIZERS[kind](E4).quantize(x)
        if kind.startswith("block"):
            assert qt._decode_rowwise is None and qt._decode_columnwise is None
            want = torch.reciprocal(qt.rowwise_scale).t()
            assert torch.equal(qt.decode_scale("rowwise"), want)
        else:
            assert qt._decode is None
            assert torch.equal(qt.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))


def test_delayed_nan_fill_past_int32_elements():
    """An input of 2**31 elements or more finishes in its own launch (the fused finish counts
    elements in int32): a NaN still turns every code NaN."""
    need = 2 ** 31 * (2 + 1 + 1) + 2 ** 30
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip("needs about 9 GiB of free GPU memory")
    x = torch.ones(65536, 32768, device="cuda", dtype=torch.bfloat16)
    x[7, 9] = float("nan")
    q = QUANTIZERS["delayed"](E4).set_usage(rowwise=True, columnwise=False)
    qt = q.quantize(x)
    del x
    assert torch.isnan(qt.shared_scale).all()
    assert bool((qt.rowwise_data.view(torch.uint8) & 0x7F == 0x7F).all())


def _edge_amaxes(p: int) -> torch.Tensor:
    """fp32 amaxes around every place the integer scale rule could slip: the mantissa
    bound 0x600000 at many exponents, the pattern where the quotient rounds down to the
    smallest subnormal (exponent p), tiny and huge amaxes, zero, plus random ones."""
    mants = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x600002, 0x7FFFFF],
                         dtype=torch.int64)
    exps = torch.tensor(sorted({0, 1, 2, p - 2, p - 1, p, p + 1, p + 2, 100, 127, 127 + p,
                                200, 253, 254}), dtype=torch.int64)
    bits = (exps[:, None] << 23 | mants[None, :]).reshape(-1)
    g = torch.Generator().manual_seed(p)
    rand = torch.randint(0, 0x7F800000, (4096,), generator=g, dtype=torch.int64)
    return torch.cat([bits, rand]).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_mxfp8_scale_rule_at_edge_amaxes(fp8_dtype):
    """The MXFP8 kernel gets the E8M0 exponent from the amax's bits, no division; each row
    and each column of the input below is one block whose amax is a chosen fp32 pattern.
    (``tests/slow/test_fuzz_kernels_fp8.py`` checks the rule on every finite fp32.)"""
    amax = _edge_amaxes(8 if fp8_dtype == E4 else 15)
    n = (amax.numel() + 31) // 32 * 32
    amax = torch.cat([amax, amax[: n - amax.numel()]]).cuda()
    # (n, 32): row i holds amax[i] at column i % 32 and smaller values elsewhere; its
    # transpose, quantized columnwise, makes the same blocks
    x = amax[:, None] * torch.rand(n, 32, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(0)) * 0.5
    x[torch.arange(n), torch.arange(n) % 32] = amax
    _, want = block_exponents(amax, fp8_dtype)
    _, rs, _, _, _, _ = mx_launch.mxfp8_quantize(x, fp8_dtype == E5, False, True, True, 0, [])
    assert torch.equal(rs.reshape(-1), want), "rowwise scales"
    _, _, _, cs, _, _ = mx_launch.mxfp8_quantize(x.t().contiguous(), fp8_dtype == E5, False,
                                                 True, True, 0, [])
    assert torch.equal(cs.reshape(-1), want), "columnwise scales"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_mxfp8_input_pass_without_rowwise_codes(shape, fp8_dtype):
    """An input's forward pass (``row_codes=False``: the rowwise exact values and the
    columnwise codes and scales, no rowwise codes) writes what the whole quantize writes in
    those outputs, through the kernel each shape takes (Triton where a dimension is not a
    multiple of 32 or the view is strided)."""
    x = _input(shape, torch.bfloat16, "special", seed=3)
    x2 = x.reshape(-1, x.shape[-1])
    e5 = fp8_dtype == E5
    keep = mx_launch.mxfp8_quantize(x2, e5, False, True, True, 0, [], True, False, True, False)
    whole = mx_launch.mxfp8_quantize(x2, e5, False, True, True, 0, [], True, False)
    assert keep[0].numel() == keep[1].numel() == keep[5].numel() == 0
    for i in (2, 3, 4):
        assert torch.equal(keep[i].view(torch.uint8), whole[i].view(torch.uint8)), i


@pytest.mark.parametrize("held", ["smaller", "larger", "nan", "zero"])
@pytest.mark.parametrize("usage", ["both", "row"])
@pytest.mark.parametrize("dist", ["normal", "special"])
def test_delayed_records_the_max_with_the_held_amax(held, usage, dist):
    """A delayed quantizer records max(held amax, amax(|x|)) (NaN sticking), in one launch
    and in the sliced path, as the reference does."""
    x = _input((256, 384), torch.bfloat16, dist, seed=11)
    amax = x.float().abs().max().item()
    start = {"smaller": amax / 2, "larger": amax * 2, "nan": float("nan"), "zero": 0.0}[held]

    def quantizer():
        return Float8Quantizer(torch.tensor([0.37], device="cuda"),
                               torch.full((1,), start, device="cuda"), E4).set_usage(
                                   *USAGES[usage])

    _matches_reference("delayed", usage, x, f"held {held}", quantizer(), quantizer())
    qk, qr = quantizer(), quantizer()
    qk.slice_quantizer(x.view(-1, 384))
    with reference_only():
        qr.slice_quantizer(x.view(-1, 384))
    _assert_same(qk.amax, qr.amax, "sliced recorded amax")
