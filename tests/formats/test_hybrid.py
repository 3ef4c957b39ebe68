"""HybridQuantizer / HybridQuantizedTensor and IdentityQuantizer at the format level.

* usages: rowwise-only / columnwise-only hybrids, update_usage, each direction equal (bit for bit)
  to the plain quantizer of that direction, a missing direction raises;
* mixed-format GEMMs through ``lowprec.gemm.gemm`` against the float64 product of the
  dequantized operands (and, for the semantics, against the product of the original values);
* constructor errors;
* pickle / deepcopy / torch.save round trips; CustomRecipe pickling;
* make_empty + update_quantized equals quantize.

Expectations come from the plain (non-hybrid) quantizers, run on their own, and from float64
arithmetic; never from the hybrid code path itself.
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from helpers import randn, sqnr_db

import lowprec
from lowprec import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    HybridQuantizedTensor,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from lowprec.formats.base import QuantizedTensor
from lowprec.gemm.dispatch import gemm
from lowprec.recipe import factories

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
R, C = "rowwise", "columnwise"
FP32_U = 2.0 ** -24  # unit roundoff of fp32 (round to nearest)


# ================================================================================================
# helpers
# ================================================================================================


# Plain quantizer builders by short name. Each call returns a fresh object.
PLAIN = {
    "fp8": lambda: Float8CurrentScalingQuantizer(E4M3),
    "fp8_e5m2": lambda: Float8CurrentScalingQuantizer(E5M2),
    "block1": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "block2": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2),
    "mxfp8": lambda: MXFP8Quantizer(E4M3),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True),
    "nvfp4_rht_sr": lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "identity": lambda: IdentityQuantizer(),
    "identity_bf16": lambda: IdentityQuantizer(torch.bfloat16),
}
TENSOR_CLASS = {
    "fp8": lowprec.Float8Tensor, "fp8_e5m2": lowprec.Float8Tensor,
    "block1": lowprec.Float8BlockwiseTensor, "block2": lowprec.Float8BlockwiseTensor,
    "mxfp8": lowprec.MXFP8Tensor, "nvfp4": lowprec.NVFP4Tensor, "nvfp4_rht": lowprec.NVFP4Tensor,
    "nvfp4_rht_sr": lowprec.NVFP4Tensor, "nvfp4_2d": lowprec.NVFP4Tensor,
    "identity": lowprec.IdentityTensor, "identity_bf16": lowprec.IdentityTensor,
}

# (rowwise format, columnwise format) pairs a hybrid is built from. Same-format pairs are
# included: a hybrid of q and q.copy() must reproduce q's own directions.
HYBRID_PAIRS = [
    ("mxfp8", "nvfp4_rht"),       # mxfp8_fwd_nvfp4_bwd's input
    ("mxfp8", "nvfp4_2d"),        # ... and its weight
    ("fp8", "mxfp8"),             # fp8_row_mxfp8_col
    ("block1", "nvfp4_rht_sr"),   # stochastic rounding on the columnwise side only
    ("nvfp4_rht_sr", "block2"),   # ... on the rowwise side only
    ("identity", "mxfp8"),        # high-precision forward, MXFP8 backward
    ("nvfp4", "identity_bf16"),
    ("fp8_e5m2", "fp8"),
    ("mxfp8", "mxfp8"),
    ("nvfp4_rht_sr", "nvfp4_rht_sr"),
]
PAIR_IDS = [f"{r}-{c}" for r, c in HYBRID_PAIRS]
# Block FP8 needs M and K multiples of 128 (M = 2*64, K = 256); the others need 32 (MXFP8) or 16
# (NVFP4), so they run on a smaller tensor (M = 32, K = 64) to keep the CPU run short.
BLOCK_SHAPE, SMALL_SHAPE = (2, 64, 256), (2, 16, 64)


def shape_for(*names: str) -> tuple:
    return BLOCK_SHAPE if any("block" in n for n in names) else SMALL_SHAPE


def hybrid(rname: str, cname: str) -> HybridQuantizer:
    return HybridQuantizer(PLAIN[rname](), PLAIN[cname]())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaN-safe, dtype-agnostic exact comparison)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality of plain or quantized tensors (recursing into hybrids)."""
    assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if isinstance(a, QuantizedTensor):
        assert a.metadata() == b.metadata(), what
        for name, ta in a.inner_tensors().items():
            tb = getattr(b, name)
            assert (ta is None) == (tb is None), f"{what}.{name}: held by one side only"
            if ta is not None:
                assert_same_tensor(ta, tb, f"{what}.{name}")
    else:
        assert torch.equal(bits(a), bits(b)), f"{what}: bits differ"


def plain_direction(name: str, usage: str, x: torch.Tensor) -> QuantizedTensor:
    """``x`` quantized by a fresh plain quantizer with only ``usage`` on."""
    q = PLAIN[name]().set_usage(rowwise=usage == R, columnwise=usage == C)
    return q.quantize(x)


# ================================================================================================
# usages
# ================================================================================================
@pytest.mark.parametrize("rname,cname", HYBRID_PAIRS, ids=PAIR_IDS)
def test_each_direction_equals_its_plain_quantizer(rname, cname):
    x = randn(*shape_for(rname, cname), seed=1)
    torch.manual_seed(11)
    qt = hybrid(rname, cname).quantize(x)
    # Independent expectation: the plain quantizers, one direction each, in the same order the
    # spec gives for stochastic-rounding draws (rowwise first, then columnwise).
    torch.manual_seed(11)
    want_r = plain_direction(rname, R, x)
    want_c = plain_direction(cname, C, x)

    assert type(qt) is HybridQuantizedTensor
    assert qt.shape == x.shape and qt.dtype == x.dtype
    assert qt.has_usage(R) and qt.has_usage(C)
    assert type(qt.sub_tensor(R)) is TENSOR_CLASS[rname]
    assert type(qt.sub_tensor(C)) is TENSOR_CLASS[cname]
    # The sub-tensors carry the hybrid's nominal (3-D) shape and dtype.
    assert_same_tensor(qt.sub_tensor(R), want_r, "rowwise sub-tensor")
    assert_same_tensor(qt.sub_tensor(C), want_c, "columnwise sub-tensor")
    for dtype in (None, torch.float32, torch.bfloat16):
        got_r, got_c = qt.dequantize(dtype), qt.dequantize(dtype, usage=C)
        assert got_r.shape == x.shape and got_c.shape == x.shape
        assert got_r.dtype == (dtype or x.dtype) and got_c.dtype == (dtype or x.dtype)
        assert torch.equal(bits(got_r), bits(want_r.dequantize(dtype)))
        assert torch.equal(bits(got_c), bits(want_c.dequantize(dtype, usage=C)))


def test_halves_keep_what_their_quantizer_noted():
    """A half keeps its quantizer's derived records (here: power-of-two block scales), so a
    GEMM that needs them need not read the scales back (a host sync a GEMM in eager)."""
    for dim in (1, 2):
        q = HybridQuantizer(Float8CurrentScalingQuantizer(),
                            Float8BlockQuantizer(block_scaling_dim=dim))
        half = q.quantize(randn(256, 384, seed=0, dtype=torch.bfloat16)).columnwise_data
        assert half.shape == (256, 384) and half.dtype == torch.bfloat16
        assert half.pow2_scales("columnwise")
    half = HybridQuantizer(Float8CurrentScalingQuantizer(),
                           Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False)
                           ).quantize(randn(256, 384, seed=1)).columnwise_data
    assert not half.pow2_scales("columnwise")


def test_bf16_input_keeps_nominal_dtype_per_direction():
    x = randn(*SMALL_SHAPE, seed=2, dtype=torch.bfloat16)
    qt = hybrid("fp8", "nvfp4_rht").quantize(x)
    assert qt.dtype == torch.bfloat16
    assert qt.sub_tensor(R).dtype == torch.bfloat16 and qt.sub_tensor(C).dtype == torch.bfloat16
    assert torch.equal(bits(qt.dequantize()), bits(plain_direction("fp8", R, x).dequantize()))
    assert torch.equal(bits(qt.dequantize(usage=C)),
                       bits(plain_direction("nvfp4_rht", C, x).dequantize(usage=C)))


def test_rowwise_only_hybrid_runs_only_the_rowwise_quantizer():
    hq = HybridQuantizer(MXFP8Quantizer(E4M3), NVFP4Quantizer(stochastic_rounding=True))
    assert hq.rowwise_usage and hq.columnwise_usage  # a new quantizer has both usages on
    hq.set_usage(rowwise=True, columnwise=False)
    x = randn(*SMALL_SHAPE, seed=3)
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    qt = hq.quantize(x)
    # The stochastic-rounding columnwise quantizer never ran: no draw was taken.
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert qt.has_usage(R) and not qt.has_usage(C) and qt.columnwise_data is None
    assert_same_tensor(qt.sub_tensor(R), plain_direction("mxfp8", R, x))
    with pytest.raises(RuntimeError, match="columnwise"):
        qt.dequantize(usage=C)
    with pytest.raises(RuntimeError, match="columnwise"):
        qt.sub_tensor(C)
    # The columnwise quantizer's block constraint does not apply: M = 3 is fine for a rowwise
    # MXFP8 (1x32 along K) although 32x1 columnwise blocks could not be formed.
    x_odd = randn(3, 64, seed=4)
    got = hq.quantize(x_odd)
    assert_same_tensor(got.sub_tensor(R), plain_direction("mxfp8", R, x_odd))


def test_columnwise_only_hybrid():
    hq = HybridQuantizer(NVFP4Quantizer(stochastic_rounding=True),
                         Float8BlockQuantizer(E4M3, block_scaling_dim=1))
    hq.set_usage(rowwise=False, columnwise=True)
    x = randn(*BLOCK_SHAPE, seed=5)
    rng_before = torch.get_rng_state()
    qt = hq.quantize(x)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the SR rowwise quantizer never ran
    assert not qt.has_usage(R) and qt.rowwise_data is None and qt.has_usage(C)
    assert_same_tensor(qt.sub_tensor(C), plain_direction("block1", C, x))
    assert torch.equal(qt.dequantize(usage=C), plain_direction("block1", C, x).dequantize(usage=C))
    with pytest.raises(RuntimeError, match="rowwise"):
        qt.dequantize(usage=R)  # asked for by name, not held
    # without a name, the direction held
    assert torch.equal(qt.dequantize(), qt.dequantize(usage=C))
    with pytest.raises(RuntimeError):
        gemm(qt, R, qt, C, out_dtype=torch.float32)  # a GEMM asking for the missing direction


def test_both_usages_off_raises():
    hq = hybrid("mxfp8", "nvfp4").set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError):
        hq.quantize(randn(*SMALL_SHAPE, seed=6))


def test_each_direction_takes_its_own_partial_blocks():
    x = randn(3, 40, seed=7)  # neither dimension divisible by 32 or 16
    qt = hybrid("fp8", "mxfp8").quantize(x)  # the MXFP8 columnwise side: partial blocks of M=3
    assert_same_tensor(qt.sub_tensor(C), plain_direction("mxfp8", C, x))
    # Per-tensor FP8 fits any shape; with only its direction on, the hybrid quantizes.
    qt = hybrid("fp8", "mxfp8").set_usage(rowwise=True, columnwise=False).quantize(x)
    assert_same_tensor(qt.sub_tensor(R), plain_direction("fp8", R, x))


@pytest.mark.parametrize("drop", [R, C])
def test_update_usage_drops_a_direction_and_cannot_re_derive_it(drop):
    keep = C if drop == R else R
    x = randn(*SMALL_SHAPE, seed=8)
    qt = hybrid("mxfp8", "nvfp4_rht").quantize(x)
    kept_sub = qt.sub_tensor(keep)
    kept_before = qt.dequantize(usage=keep).clone()
    assert qt.update_usage(**{f"{drop}_usage": False}) is qt
    assert not qt.has_usage(drop) and getattr(qt, f"{drop}_data") is None
    assert qt.sub_tensor(keep) is kept_sub  # the other direction is untouched
    assert torch.equal(qt.dequantize(usage=keep), kept_before)
    with pytest.raises(RuntimeError, match=drop):
        qt.dequantize(usage=drop)
    # An MXFP8 rowwise cannot be derived from NVFP4 columnwise data (or vice versa).
    with pytest.raises(RuntimeError):
        qt.update_usage(**{f"{drop}_usage": True})
    assert not qt.has_usage(drop)
    with pytest.raises(ValueError):
        qt.update_usage(**{f"{keep}_usage": False})  # would leave nothing
    assert qt.has_usage(keep)


# ================================================================================================
# mixed-format GEMMs
# ================================================================================================
# (a format, b format). Hybrids are named "rowwise+columnwise".
GEMM_PAIRS = [
    ("mxfp8", "nvfp4"),
    ("fp8", "mxfp8"),
    ("block1", "nvfp4_rht"),
    ("identity", "nvfp4_rht"),
    ("identity_bf16", "mxfp8"),
    ("mxfp8+nvfp4_rht", "fp8_e5m2"),  # hybrid x plain
    ("nvfp4", "fp8+mxfp8"),           # plain x hybrid
    ("fp8+block1", "nvfp4+mxfp8"),    # hybrid x hybrid
]
LAYOUT_NAMES = ["fprop", "dgrad", "wgrad"]


def layout(name: str, p: int, k: int, n: int):
    """((a usage, a shape), (b usage, b shape)) of a GEMM whose result is (p, n) with
    contraction k; operand a is 3-D (its leading dims flatten into M)."""
    return {
        "fprop": ((R, (2, p // 2, k)), (R, (n, k))),   # a @ b.T
        "dgrad": ((R, (2, p // 2, k)), (C, (k, n))),   # a @ b
        "wgrad": ((C, (2, k // 2, p)), (C, (k, n))),   # a.T @ b
    }[name]


def gemm_dims(*specs: str) -> tuple:
    """(p, k, n): k differs from p and n, so a mixed-up contraction fails; multiples of 128
    with block FP8 (n = p there, to keep it small), else of 32 (MXFP8; NVFP4 needs 16)."""
    return (128, 256, 128) if any("block" in s for s in specs) else (32, 64, 96)


def make_quantizer(spec: str):
    if "+" in spec:
        return hybrid(*spec.split("+"))
    return PLAIN[spec]()


def consumed_format(spec: str, usage: str) -> str:
    return spec.split("+")[0 if usage == R else 1] if "+" in spec else spec


# Minimum SQNR (dB) of the GEMM result against the product of the *original* values, by the
# coarsest format a consumed direction uses; measured 19.3-20.5 (NVFP4), 24.6 (E5M2),
# 28.5-31.5 (E4M3 / MXFP8) on these N(0,1) operands, thresholds ~3 dB below. A product in the
# wrong domain (RHT not undone, scale missing, wrong direction) lands near 0 dB.
SQNR_MIN = {"nvfp4": 17.0, "fp8_e5m2": 21.0, "e4m3": 25.0}


def sqnr_floor(fmt: str) -> float:
    """Floor contributed by one operand's format (an identity operand contributes none)."""
    if fmt.startswith("nvfp4"):
        return SQNR_MIN["nvfp4"]
    if fmt == "fp8_e5m2":
        return SQNR_MIN["fp8_e5m2"]
    if fmt.startswith("identity"):
        return math.inf
    return SQNR_MIN["e4m3"]


def mat(t: torch.Tensor, usage: str) -> torch.Tensor:
    m2 = t.reshape(-1, t.shape[-1])
    return m2 if usage == R else m2.t()


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("a_spec,b_spec", GEMM_PAIRS, ids=[f"{a}-x-{b}" for a, b in GEMM_PAIRS])
def test_mixed_format_gemm_equals_fp64_product_of_dequantized(a_spec, b_spec, layout_name):
    p, k, n = gemm_dims(a_spec, b_spec)
    (ua, sa), (ub, sb) = layout(layout_name, p, k, n)
    xa, xb = randn(*sa, seed=20), randn(*sb, seed=21)
    torch.manual_seed(0)
    # Both usages are held, so a GEMM that read the wrong direction would get other values.
    qa, qb = make_quantizer(a_spec).quantize(xa), make_quantizer(b_spec).quantize(xb)
    out = gemm(qa, ua, qb, ub, out_dtype=torch.float32)
    assert out.shape == (p, n) and out.dtype == torch.float32

    a64 = mat(qa.dequantize(torch.float64, usage=ua), ua)
    b64 = mat(qb.dequantize(torch.float64, usage=ub), ub)
    want = a64 @ b64.t()
    # fp32 accumulation of K products of exactly representable fp32 values: the standard
    # bound |err| <= gamma_K * (|A| |B|^T), gamma_K = K u / (1 - K u), plus the final rounding.
    gamma = k * FP32_U / (1 - k * FP32_U)
    bound = gamma * (a64.abs() @ b64.abs().t()) + FP32_U * want.abs()
    excess = ((out.double() - want).abs() - bound).max()
    assert excess <= 0, f"error exceeds the fp32-accumulation bound by {excess}"

    # Semantics: the product is of the original-domain values (RHT undone, scales applied).
    true = mat(xa.double(), ua) @ mat(xb.double(), ub).t()
    floor = min(sqnr_floor(consumed_format(a_spec, ua)), sqnr_floor(consumed_format(b_spec, ub)))
    assert sqnr_db(true, out.double()) > floor


def test_hybrid_operand_uses_the_sub_tensor_of_the_consumed_direction():
    # The two directions of this hybrid hold different values (MXFP8 vs NVFP4), so the GEMM
    # result tells which one was used: exactly the plain GEMM on that direction's tensor.
    xa, xb = randn(32, 64, seed=30), randn(96, 64, seed=31)
    qa = hybrid("mxfp8", "nvfp4_rht").quantize(xa)
    qb = MXFP8Quantizer(E4M3).quantize(xb)
    plain_r, plain_c = plain_direction("mxfp8", R, xa), plain_direction("nvfp4_rht", C, xa)
    assert torch.equal(gemm(qa, R, qb, R, out_dtype=torch.float32),
                       gemm(plain_r, R, qb, R, out_dtype=torch.float32))
    xc = randn(32, 16, seed=32)
    qc = NVFP4Quantizer(with_rht=True).quantize(xc)
    got = gemm(qa, C, qc, C, out_dtype=torch.float32)  # (64, 16) = xa.T @ xc, both RHT'd
    assert torch.equal(got, gemm(plain_c, C, qc, C, out_dtype=torch.float32))
    assert not torch.equal(qa.dequantize(), qa.dequantize(usage=C))  # the directions differ


def test_gemm_with_a_missing_hybrid_direction_raises():
    q = hybrid("mxfp8", "nvfp4").set_usage(rowwise=True, columnwise=False)
    qa = q.quantize(randn(128, 64, seed=33))
    qb = MXFP8Quantizer(E4M3).quantize(randn(128, 32, seed=34))
    with pytest.raises(RuntimeError, match="columnwise"):
        gemm(qa, C, qb, C, out_dtype=torch.float32)


# ================================================================================================
# constructor errors
# ================================================================================================
def test_same_quantizer_object_twice_raises_value_error():
    q = MXFP8Quantizer(E4M3)
    with pytest.raises(ValueError):
        HybridQuantizer(q, q)
    with pytest.raises(ValueError):
        HybridQuantizer(rowwise_quantizer=q, columnwise_quantizer=q)
    # A copy is a distinct object: fine.
    hq = HybridQuantizer(rowwise_quantizer=q, columnwise_quantizer=q.copy())
    assert hq.rowwise_quantizer is q and hq.columnwise_quantizer is not q


@pytest.mark.parametrize("position", ["rowwise", "columnwise"])
def test_nested_hybrid_raises_value_error(position):
    inner = hybrid("mxfp8", "nvfp4")
    other = NVFP4Quantizer()
    args = (inner, other) if position == "rowwise" else (other, inner)
    with pytest.raises(ValueError, match="nested|Hybrid"):
        HybridQuantizer(*args)


@pytest.mark.parametrize("bad", [None, "mxfp8", torch.float8_e4m3fn, MXFP8Quantizer,
                                 torch.zeros(2), lowprec.MXFP8BlockScaling(),
                                 factories.mxfp8_factory],
                         ids=["none", "str", "dtype", "class", "tensor", "recipe", "factory"])
@pytest.mark.parametrize("position", ["rowwise", "columnwise"])
def test_non_quantizer_argument_raises_type_error(bad, position):
    good = MXFP8Quantizer(E4M3)
    args = (bad, good) if position == "rowwise" else (good, bad)
    with pytest.raises(TypeError):
        HybridQuantizer(*args)


def test_identity_quantizer_rejects_low_precision_dtype():
    with pytest.raises(ValueError):
        IdentityQuantizer(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        IdentityQuantizer(torch.int8)


# ================================================================================================
# pickling, deepcopy, torch.save
# ================================================================================================
def _pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def _torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


ROUND_TRIPS = {"pickle": _pickle, "deepcopy": copy.deepcopy, "torch_save": _torch_save_load}
SERIAL_PAIRS = [("mxfp8", "nvfp4_rht_sr"), ("fp8", "block2"), ("identity_bf16", "nvfp4_2d")]


def _quantizer_state(q) -> dict:
    """Comparable settings of a quantizer (a generator is compared through its state)."""
    out = {"type": type(q)}
    for k, v in vars(q).items():
        if isinstance(v, torch.Generator):
            v = ("generator", str(v.device), bytes(v.get_state().numpy()))
        elif isinstance(v, lowprec.Quantizer):
            v = _quantizer_state(v)
        elif isinstance(v, torch.Tensor):
            v = ("tensor", v.dtype, tuple(v.shape), bytes(bits(v).numpy()))
        out[k] = v
    return out


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("rname,cname", SERIAL_PAIRS, ids=[f"{r}-{c}" for r, c in SERIAL_PAIRS])
def test_hybrid_quantizer_round_trip(rname, cname, how):
    hq = hybrid(rname, cname)
    hq.set_usage(rowwise=True, columnwise=False)  # a non-default usage must survive
    got = ROUND_TRIPS[how](hq)
    assert type(got) is HybridQuantizer and got is not hq
    assert got.rowwise_quantizer is not hq.rowwise_quantizer
    assert (got.rowwise_usage, got.columnwise_usage) == (True, False)
    assert _quantizer_state(got) == _quantizer_state(hq)
    # Functionally the same: quantizing gives the same bits.
    x = randn(*shape_for(rname, cname), seed=40)
    for q in (hq, got):
        q.set_usage(rowwise=True, columnwise=True)
    torch.manual_seed(1)
    want = hq.quantize(x)
    torch.manual_seed(1)
    assert_same_tensor(got.quantize(x), want)


def test_hybrid_quantizer_with_generator_round_trip():
    # An NVFP4 stochastic-rounding side with its own generator: the state travels.
    gen = torch.Generator().manual_seed(123)
    hq = HybridQuantizer(MXFP8Quantizer(E4M3), NVFP4Quantizer(stochastic_rounding=True,
                                                              generator=gen))
    x = randn(*SMALL_SHAPE, seed=41)
    for how, fn in ROUND_TRIPS.items():
        got = fn(hq)
        assert got.columnwise_quantizer.generator is not gen, how
        assert_same_tensor(got.quantize(x), copy.deepcopy(hq).quantize(x), how)


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("usage", ["both", R, C])
@pytest.mark.parametrize("rname,cname", SERIAL_PAIRS, ids=[f"{r}-{c}" for r, c in SERIAL_PAIRS])
def test_hybrid_tensor_round_trip(rname, cname, usage, how):
    x = randn(*shape_for(rname, cname), seed=42, dtype=torch.bfloat16)
    hq = hybrid(rname, cname)
    if usage != "both":
        hq.set_usage(rowwise=usage == R, columnwise=usage == C)
    torch.manual_seed(2)
    qt = hq.quantize(x)
    qt.requires_grad_(True)
    got = ROUND_TRIPS[how](qt)
    assert got is not qt and got.requires_grad
    assert_same_tensor(got, qt)
    for u in (R, C):
        assert got.has_usage(u) == qt.has_usage(u)
        if qt.has_usage(u):
            assert torch.equal(bits(got.dequantize(usage=u)), bits(qt.dequantize(usage=u)))
            # A real copy: the buffers are not shared.
            sub_got, sub_qt = got.sub_tensor(u), qt.sub_tensor(u)
            for name, t in sub_qt.inner_tensors().items():
                if isinstance(t, torch.Tensor) and t.numel():
                    assert getattr(sub_got, name).data_ptr() != t.data_ptr(), name


def test_hybrid_parameter_round_trip():
    qt = hybrid("mxfp8", "nvfp4_2d").quantize(randn(64, 128, seed=43))
    param = torch.nn.Parameter(qt, requires_grad=True)
    for how, fn in ROUND_TRIPS.items():
        got = fn(param)
        assert isinstance(got, torch.nn.Parameter) and isinstance(got, HybridQuantizedTensor), how
        assert_same_tensor(got.sub_tensor(R), qt.sub_tensor(R), how)
        assert_same_tensor(got.sub_tensor(C), qt.sub_tensor(C), how)


def _module_level_hybrid_factory(role):
    if role is None:
        return IdentityQuantizer()
    return HybridQuantizer(MXFP8Quantizer(E4M3), NVFP4Quantizer(with_rht=True))


@pytest.mark.parametrize("factory", [factories.mxfp8_fwd_nvfp4_bwd_factory,
                                     factories.fp8_row_mxfp8_col_factory,
                                     _module_level_hybrid_factory])
def test_custom_recipe_with_module_level_factory_pickles(factory):
    recipe = lowprec.CustomRecipe(qfactory=factory, backward_mode="dequantized")
    for got in (_pickle(recipe), copy.deepcopy(recipe)):
        assert got == recipe and got.qfactory is factory
        assert got.backward_mode == "dequantized"
    role = lowprec.QuantizerRole("linear", "input", "fc")
    assert _quantizer_state(_pickle(recipe).qfactory(role)) == _quantizer_state(factory(role))


def test_custom_recipe_with_lambda_does_not_pickle():
    recipe = lowprec.CustomRecipe(qfactory=lambda role: HybridQuantizer(MXFP8Quantizer(),
                                                                        NVFP4Quantizer()))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(recipe)


# ================================================================================================
# make_empty + update_quantized
# ================================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("usage", ["both", R, C])
@pytest.mark.parametrize("rname,cname", HYBRID_PAIRS, ids=PAIR_IDS)
def test_make_empty_then_update_quantized_equals_quantize(rname, cname, usage, dtype):
    shape = shape_for(rname, cname)
    hq = hybrid(rname, cname)
    if usage != "both":
        hq.set_usage(rowwise=usage == R, columnwise=usage == C)
    empty = hq.make_empty(shape, dtype=dtype, device="cpu")
    assert type(empty) is HybridQuantizedTensor
    assert empty.shape == shape and empty.dtype == dtype
    for u in (R, C):
        assert empty.has_usage(u) == (usage in ("both", u))
        if empty.has_usage(u):
            sub = empty.sub_tensor(u)
            assert type(sub) is TENSOR_CLASS[rname if u == R else cname]
            assert sub.shape == shape and sub.dtype == dtype
    ptrs = {(u, n): t.data_ptr() for u in (R, C) if empty.has_usage(u)
            for n, t in empty.sub_tensor(u).inner_tensors().items()
            if isinstance(t, torch.Tensor) and t.numel()}

    x = randn(*shape, seed=50, dtype=dtype)
    torch.manual_seed(3)
    assert hq.update_quantized(x, empty) is empty
    torch.manual_seed(3)
    want = hq.quantize(x)
    assert_same_tensor(empty, want)
    # In place: the same buffers.
    for (u, n), p in ptrs.items():
        assert getattr(empty.sub_tensor(u), n).data_ptr() == p, (u, n)
    # And the quantizer's own usages are what they were.
    assert (hq.rowwise_usage, hq.columnwise_usage) == (usage in ("both", R), usage in ("both", C))

    # A second update with other values reuses the buffers again.
    x2 = randn(*shape, seed=51, dtype=dtype) * 3
    torch.manual_seed(4)
    hq.update_quantized(x2, empty)
    torch.manual_seed(4)
    assert_same_tensor(empty, hq.quantize(x2))


def test_update_quantized_into_a_hybrid_with_more_usages_than_the_quantizer():
    # update_quantized fills the usages the *tensor* holds, whatever the quantizer's are.
    hq = hybrid("fp8", "mxfp8")
    empty = hq.make_empty(SMALL_SHAPE)
    hq.set_usage(rowwise=True, columnwise=False)
    x = randn(*SMALL_SHAPE, seed=52)
    hq.update_quantized(x, empty)
    assert empty.has_usage(R) and empty.has_usage(C)
    assert_same_tensor(empty.sub_tensor(R), plain_direction("fp8", R, x))
    assert_same_tensor(empty.sub_tensor(C), plain_direction("mxfp8", C, x))


def test_update_quantized_with_other_formats_raises():
    empty = hybrid("mxfp8", "nvfp4").make_empty(SMALL_SHAPE)
    with pytest.raises((TypeError, ValueError)):
        hybrid("fp8", "nvfp4").update_quantized(randn(*SMALL_SHAPE, seed=53), empty)
    with pytest.raises(TypeError):
        MXFP8Quantizer(E4M3).update_quantized(randn(*SMALL_SHAPE, seed=53), empty)
    with pytest.raises(ValueError):
        hybrid("mxfp8", "nvfp4").update_quantized(randn(2, 16, 32, seed=54), empty)


@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_hybrid_moves_device_with_its_sub_tensors(device):
    """``.to(device)`` moves a hybrid and its quantized sub-tensors (``module.cuda()`` of a
    hybrid quantized weight); on a real device the values are unchanged."""
    q = HybridQuantizer(MXFP8Quantizer(), Float8CurrentScalingQuantizer(torch.float8_e4m3fn))
    t = q.quantize(torch.randn(64, 64))
    moved = t.to(device)
    assert isinstance(moved, HybridQuantizedTensor) and moved.device.type == device
    for usage in ("rowwise", "columnwise"):
        sub = moved.sub_tensor(usage)
        assert type(sub) is type(t.sub_tensor(usage)) and sub.device.type == device
        if device != "meta":
            assert torch.equal(sub.dequantize(usage=usage).cpu(),
                               t.sub_tensor(usage).dequantize(usage=usage))
