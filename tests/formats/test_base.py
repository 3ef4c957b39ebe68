"""QuantizedTensor / Quantizer base behaviours, with Float8Tensor as the example format.

The serialization tests run over ``QUANTIZER_FACTORIES``: add an entry
``(name, zero-arg factory, shape)`` to cover another format.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import lowprec
from lowprec.formats.base import QuantizedTensor, Quantizer, register_safe_globals
from lowprec.formats.float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

QUANTIZER_FACTORIES = [
    ("fp8_current_e4m3", lambda: Float8CurrentScalingQuantizer(E4M3), (16, 32)),
    ("fp8_current_e5m2_pow2_eps",
     lambda: Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True, amax_epsilon=1e-3),
     (4, 8, 32)),
    ("fp8_delayed_e4m3", lambda: Float8Quantizer(torch.tensor([0.75]), torch.zeros(1), E4M3),
     (16, 32)),
    ("fp8_delayed_e5m2", lambda: Float8Quantizer(torch.tensor([300.0]), torch.zeros(1), E5M2),
     (2, 3, 64)),
]
FACTORY_PARAMS = [pytest.param(f, s, id=n) for n, f, s in QUANTIZER_FACTORIES]

register_safe_globals(Float8Quantizer, Float8CurrentScalingQuantizer, Float8Tensor)


# ---- helpers ------------------------------------------------------------------------------
def int_bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def assert_same_quantized(a: QuantizedTensor, b: QuantizedTensor, *, shares_storage=None):
    """Same type, nominal shape/dtype, metadata, usages and inner tensors bit for bit."""
    assert type(a) is type(b)
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    assert a.metadata() == b.metadata()
    for name, t in a.inner_tensors().items():
        u = getattr(b, name)
        assert (t is None) == (u is None), name
        if t is None:
            continue
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(int_bits(t), int_bits(u)), name
        if shares_storage is not None:
            assert (t.data_ptr() == u.data_ptr()) == shares_storage, name
    for usage in ("rowwise", "columnwise"):
        if a.has_usage(usage):
            assert torch.equal(int_bits(a.dequantize(torch.float32, usage=usage)),
                               int_bits(b.dequantize(torch.float32, usage=usage)))


def data(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    x.view(-1)[3] = 200.0  # one outlier
    return x.to(dtype)


def torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


ROUND_TRIPS = {
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
    "deepcopy": copy.deepcopy,
    "torch_save": torch_save_load,
}
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}


@pytest.fixture
def quantizer():
    return Float8CurrentScalingQuantizer(E4M3)


@pytest.fixture
def qt(quantizer):
    return quantizer.quantize(data((4, 6, 8)))


# ---- serialization (parametrized over formats) ---------------------------------------------
@pytest.mark.parametrize("method", list(ROUND_TRIPS))
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("factory,shape", FACTORY_PARAMS)
def test_quantized_tensor_round_trip(factory, shape, dtype, usage, method):
    q = factory().set_usage(*USAGES[usage])
    qt = q.quantize(data(shape, dtype))
    out = ROUND_TRIPS[method](qt)
    assert_same_quantized(qt, out, shares_storage=False)
    assert out.requires_grad is False
    before = copy.deepcopy(qt)
    for t in out.inner_tensors().values():  # nothing aliases the original
        if t is not None:
            int_bits(t).zero_()
    assert_same_quantized(before, qt)


@pytest.mark.parametrize("method", list(ROUND_TRIPS))
@pytest.mark.parametrize("factory,shape", FACTORY_PARAMS)
def test_quantizer_round_trip(factory, shape, method):
    q = factory().set_usage(columnwise=False)
    q.quantize(data(shape, seed=1))  # a quantizer that has already been used
    out = ROUND_TRIPS[method](q)
    assert type(out) is type(q) and out is not q
    assert repr(out) == repr(q)
    assert (out.rowwise_usage, out.columnwise_usage) == (True, False)
    x = data(shape, seed=2)
    assert_same_quantized(q.quantize(x), out.quantize(x))
    out.set_usage(columnwise=True)
    assert not q.columnwise_usage


@pytest.mark.parametrize("factory,shape", FACTORY_PARAMS)
def test_torch_save_of_mixed_container(factory, shape):
    q = factory()
    qt = q.quantize(data(shape, torch.float16))
    out = torch_save_load({"q": q, "t": [qt, qt.detach()], "plain": torch.ones(2)})
    assert_same_quantized(qt, out["t"][0])
    assert_same_quantized(qt, out["t"][1])
    assert repr(out["q"]) == repr(q) and torch.equal(out["plain"], torch.ones(2))


def test_quantized_tensor_holds_its_quantizer_until_pickled(qt):
    """A tensor keeps the quantizer that made it (in-place ops outside its table re-quantize
    with it), through detach and views; a pickled or deep-copied one travels without it."""
    held = [v for v in vars(qt).values() if isinstance(v, Quantizer)]
    assert len(held) == 1
    assert [v for v in vars(qt.detach()).values() if isinstance(v, Quantizer)] == held
    for copied in (torch_save_load(qt), copy.deepcopy(qt)):
        assert not any(isinstance(v, Quantizer) for v in vars(copied).values())


# ---- detach / clone / copy_ ----------------------------------------------------------------
def test_detach_and_clone(qt):
    d = qt.detach()
    assert_same_quantized(qt, d, shares_storage=True)
    c = qt.clone()
    assert_same_quantized(qt, c, shares_storage=False)
    q1 = Float8CurrentScalingQuantizer(E4M3).set_usage(rowwise=False)
    col_only = q1.quantize(data((5, 8)))
    assert_same_quantized(col_only, col_only.clone(), shares_storage=False)


def test_copy_between_quantized_tensors(quantizer):
    src = quantizer.quantize(data((4, 6, 8), seed=1))
    dst = quantizer.quantize(data((4, 6, 8), seed=2))
    ptrs = [t.data_ptr() for t in dst.inner_tensors().values()]
    assert dst.copy_(src) is dst
    assert ptrs == [t.data_ptr() for t in dst.inner_tensors().values()]  # in place
    assert_same_quantized(src, dst, shares_storage=False)


def test_copy_between_quantized_tensors_validates(quantizer):
    src = quantizer.quantize(data((4, 8)))
    for bad in (Float8CurrentScalingQuantizer(E5M2).quantize(data((4, 8))),  # format
                quantizer.copy().set_usage(columnwise=False).quantize(data((4, 8))),  # usages
                quantizer.quantize(data((8, 4)))):  # shape
        with pytest.raises(TypeError):
            bad.copy_(src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_plain_copy_from_quantized_writes_dequantized_values(qt, dtype):
    plain = torch.full(qt.shape, 7.0, dtype=dtype)
    out = plain.copy_(qt)
    assert out is plain and type(plain) is torch.Tensor
    assert torch.equal(int_bits(plain), int_bits(qt.dequantize(dtype)))


def test_copy_high_precision_into_quantized_requantizes(qt):
    """copy_ of high-precision values re-quantizes with the tensor's quantizer, in place."""
    values = torch.randn(qt.shape)
    buffers = {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None}
    want = Float8CurrentScalingQuantizer(E4M3).quantize(values)
    assert qt.copy_(values) is qt
    assert {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None} == buffers
    assert torch.equal(qt.dequantize(), want.dequantize())


def test_copy_into_a_loaded_quantized_tensor_raises(qt):
    """A tensor that travelled through torch.save has no quantizer to re-quantize with."""
    loaded = torch_save_load(qt)
    with pytest.raises(TypeError, match="update_quantized"):
        loaded.copy_(torch.randn(qt.shape))
    with pytest.raises(TypeError, match="in-place"):
        loaded.add_(1)


# ---- to / view / reshape -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_to_dtype_changes_only_the_nominal_dtype(dtype):
    qt = Float8CurrentScalingQuantizer(E5M2).quantize(data((6, 10)))
    out = qt.to(dtype)
    assert type(out) is Float8Tensor and out.dtype == dtype and out.shape == qt.shape
    assert out.metadata() == qt.metadata()
    for name, t in qt.inner_tensors().items():
        assert torch.equal(int_bits(getattr(out, name)), int_bits(t))
    assert out.dequantize().dtype == dtype
    assert torch.equal(out.dequantize(), qt.dequantize(torch.float32).to(dtype))
    assert torch.equal(out.to(torch.float32).dequantize(), qt.dequantize(torch.float32))
    assert qt.dtype == torch.float32  # the original is unchanged
    with pytest.raises(TypeError, match="int8"):
        qt.to(torch.int8)


@pytest.mark.parametrize("new_shape", [(24, 8), (-1, 8), (2, 12, 8), (4, 6, 8), (1, 24, 8),
                                       (2, -1, 2, 8)], ids=str)
@pytest.mark.parametrize("op", ["view", "reshape"])
def test_view_reshape_with_same_last_dim(qt, op, new_shape):
    out = getattr(qt, op)(*new_shape)
    want = qt.dequantize(torch.float32).reshape(new_shape)
    assert type(out) is Float8Tensor and out.shape == want.shape
    for usage in ("rowwise", "columnwise"):
        assert torch.equal(out.dequantize(torch.float32, usage=usage), want)


@pytest.mark.parametrize("new_shape", [(-1,), (192,), (8, 24), (4, 6, 2, 4), (4, 12, 4),
                                       (5, 8), (-1, 16)], ids=str)
@pytest.mark.parametrize("op", ["view", "reshape"])
def test_view_reshape_changing_last_dim_raises(qt, op, new_shape):
    with pytest.raises(RuntimeError, match="last dimension"):
        getattr(qt, op)(*new_shape)


def test_view_of_1d_tensor():
    qt = Float8CurrentScalingQuantizer(E4M3).quantize(data((16,)))
    out = qt.view(1, 1, 16)
    assert out.shape == (1, 1, 16) and out.view(16).shape == (16,)
    assert torch.equal(out.dequantize(usage="columnwise").flatten(), qt.dequantize())


# ---- unsupported ops -----------------------------------------------------------------------
#: Ops outside the table: run on the dequantized values, with a plain result.
OUT_OF_PLACE = [
    ("add_scalar", lambda t: t + 1),
    ("add_tensor", lambda t: torch.add(t, t)),
    ("mul", lambda t: t * 2),
    ("matmul", lambda t: t @ torch.ones(8, 3)),
    ("linear", lambda t: torch.nn.functional.linear(torch.ones(2, 8), t.view(24, 8))),
    ("sum", lambda t: t.sum()),
    ("sum_dim", lambda t: t.sum(dim=1)),
    ("index", lambda t: t[0]),
    ("slice", lambda t: t[1:3]),
    ("slice_last_dim", lambda t: t[..., :2]),
    ("transpose", lambda t: t.transpose(0, 1)),
    ("chunk", lambda t: torch.cat(torch.chunk(t, 2))),
    ("new_empty_strided", lambda t: t.new_empty_strided((2, 3), (3, 1)).fill_(1)),
]


@pytest.mark.parametrize("fn", [pytest.param(f, id=n) for n, f in OUT_OF_PLACE])
def test_ops_outside_the_table_run_on_the_dequantized_values(qt, fn):
    got = fn(qt)
    assert type(got) is torch.Tensor
    assert torch.equal(got, fn(qt.dequantize()))


@pytest.mark.parametrize("name,fn", [
    ("add_", lambda t: t.add_(1)), ("mul_", lambda t: t.mul_(0.5)),
    ("clamp_", lambda t: t.clamp_(min=0)), ("fill_", lambda t: t.fill_(0.25)),
    ("zero_", lambda t: t.zero_())])
def test_in_place_ops_requantize_with_the_tensors_quantizer(qt, name, fn):
    """An in-place op dequantizes, applies the op and re-quantizes into the same buffers
    with the quantizer that made the tensor."""
    values = fn(qt.dequantize())
    want = Float8CurrentScalingQuantizer(E4M3).quantize(values)
    buffers = {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None}
    assert fn(qt) is qt
    assert {n: t.data_ptr() for n, t in qt.inner_tensors().items() if t is not None} == buffers
    assert torch.equal(qt.dequantize(), want.dequantize())


def test_in_place_random_init_requantizes(qt):
    torch.manual_seed(3)
    qt.uniform_(-1, 1)
    torch.manual_seed(3)
    want = Float8CurrentScalingQuantizer(E4M3).quantize(torch.empty(qt.shape).uniform_(-1, 1))
    assert torch.equal(qt.dequantize(), want.dequantize())


# ---- nn.Parameter / repr -------------------------------------------------------------------
def test_parameter_keeps_the_type(qt):
    p = torch.nn.Parameter(qt, requires_grad=False)
    assert isinstance(p, Float8Tensor) and isinstance(p, torch.nn.Parameter)
    assert not p.requires_grad
    assert_same_quantized(qt, p, shares_storage=True)
    lin = torch.nn.Linear(8, 24, bias=False)
    lin.weight = torch.nn.Parameter(qt.view(24, 8), requires_grad=False)
    assert isinstance(lin.weight, Float8Tensor) and "weight" in dict(lin.named_parameters())
    # state_dict round trip through torch.save(weights_only) and load_state_dict (copy_).
    sd = torch_save_load(lin.state_dict())
    other = torch.nn.Linear(8, 24, bias=False)
    other.weight = torch.nn.Parameter(Float8CurrentScalingQuantizer(E4M3).quantize(
        data((24, 8), seed=5)), requires_grad=False)
    other.load_state_dict(sd)
    assert isinstance(other.weight, Float8Tensor)
    assert_same_quantized(qt.view(24, 8), other.weight.detach())


@pytest.mark.parametrize("method", list(ROUND_TRIPS))
def test_parameter_survives_round_trip(qt, method):
    p = torch.nn.Parameter(qt, requires_grad=False)
    out = ROUND_TRIPS[method](p)
    assert isinstance(out, Float8Tensor) and isinstance(out, torch.nn.Parameter)


def test_repr_does_not_crash(quantizer, qt):
    nan_qt = quantizer.quantize(torch.tensor([[1.0, float("nan")]]))
    row_only = quantizer.copy().set_usage(columnwise=False).quantize(data((3, 4)))
    for obj in (qt, nan_qt, row_only, torch.nn.Parameter(qt, requires_grad=False),
                qt.to(torch.bfloat16)):
        for text in (repr(obj), str(obj), f"{obj}"):
            assert "Float8Tensor" in text
    assert "Float8CurrentScalingQuantizer" in repr(quantizer)
    assert "Float8Quantizer" in repr(Float8Quantizer(torch.ones(1), torch.zeros(1)))


# ---- usage validation ----------------------------------------------------------------------
def test_dequantize_missing_direction_raises(quantizer):
    row_only = quantizer.set_usage(columnwise=False).quantize(data((4, 8)))
    with pytest.raises(RuntimeError, match="columnwise"):
        row_only.dequantize(usage="columnwise")
    col_only = quantizer.set_usage(rowwise=False, columnwise=True).quantize(data((4, 8)))
    with pytest.raises(RuntimeError, match="rowwise"):
        col_only.dequantize(usage="rowwise")


def test_dequantize_reads_columnwise_where_rowwise_is_not_held(quantizer):
    x = data((4, 8))
    both = quantizer.quantize(x)
    col_only = quantizer.set_usage(rowwise=False, columnwise=True).quantize(x)
    assert torch.equal(col_only.dequantize(), both.dequantize(usage="columnwise"))
    assert torch.equal(col_only.float(), both.dequantize(torch.float32, usage="columnwise"))


def test_usage_names_are_validated(qt):
    for bad in ("both", "row", "ROWWISE", ""):
        with pytest.raises(ValueError, match="usage"):
            qt.dequantize(usage=bad)
        with pytest.raises(ValueError, match="usage"):
            qt.has_usage(bad)


def test_update_usage_cannot_leave_no_data(quantizer):
    qt = quantizer.quantize(data((4, 8)))
    with pytest.raises(ValueError, match="no data"):
        qt.update_usage(rowwise_usage=False, columnwise_usage=False)
    assert qt.has_usage("rowwise") and qt.has_usage("columnwise")  # unchanged
    row_only = quantizer.copy().set_usage(columnwise=False).quantize(data((4, 8)))
    with pytest.raises(ValueError, match="no data"):
        row_only.update_usage(rowwise_usage=False)
    assert row_only.has_usage("rowwise")


# ---- input validation ----------------------------------------------------------------------
def test_both_usages_off_raises(quantizer):
    quantizer.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="usages"):
        quantizer.quantize(data((4, 8)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool,
                                   torch.float64, torch.float8_e4m3fn, torch.complex64], ids=str)
def test_non_float_input_dtype_raises_naming_it(quantizer, dtype):
    x = torch.ones(4, 8).to(dtype)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        quantizer.quantize(x)


def test_quantizing_a_quantized_tensor_raises(quantizer, qt):
    with pytest.raises(TypeError, match="Float8Tensor"):
        quantizer.quantize(qt)
    with pytest.raises(TypeError):
        quantizer.quantize([1.0, 2.0])


@pytest.mark.parametrize("make", [lambda: Float8CurrentScalingQuantizer(E4M3),
                                  lambda: Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3),
                                  lambda: lowprec.IdentityQuantizer()],
                         ids=["current", "delayed", "identity"])
def test_zero_dim_tensor_is_one_scaling_unit(make):
    """A 0-d tensor quantizes as the one-element tensor of its value."""
    quantizer = make()
    x = torch.tensor(3.3)
    qt = quantizer.quantize(x)
    assert qt.shape == () and qt.dtype == x.dtype
    want = make().quantize(x.reshape(1))
    assert torch.equal(qt.dequantize(), want.dequantize().reshape(()))
    assert torch.equal(qt.dequantize(usage="columnwise"), want.dequantize().reshape(()))
    empty = quantizer.make_empty(())
    assert empty.shape == () and quantizer.update_quantized(x, empty) is empty
    assert torch.equal(empty.dequantize(), qt.dequantize())


def test_make_empty_validates_dtype(quantizer):
    with pytest.raises(TypeError, match="int32"):
        quantizer.make_empty((4, 8), dtype=torch.int32)


# ---- torch.compile -------------------------------------------------------------------------
def test_compile_dequantize_fullgraph(qt):
    # aot_eager traces the subclass through dynamo and AOT autograd (flatten/unflatten)
    # without inductor's C++ build, which costs ~30 s cold on CPU.
    torch._dynamo.reset()
    fn = torch.compile(lambda t: t.dequantize(), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(qt), qt.dequantize())
    other = Float8CurrentScalingQuantizer(E4M3).set_usage(columnwise=False).quantize(
        data((4, 6, 8), seed=3))
    assert torch.equal(fn(other), other.dequantize())


# ---- plain-tensor conversions ----------------------------------------------------------------
@pytest.mark.parametrize("method,dtype", [("float", torch.float32), ("bfloat16", torch.bfloat16),
                                          ("half", torch.float16)])
@pytest.mark.parametrize("factory,shape", FACTORY_PARAMS)
def test_float_bfloat16_half_dequantize(factory, shape, method, dtype):
    qt = factory().quantize(data(shape, torch.bfloat16))
    out = getattr(qt, method)()
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == qt.shape
    assert torch.equal(out, qt.dequantize(dtype))


def test_float_is_differentiable_to_the_quantized_tensor(quantizer):
    w = torch.nn.Parameter(quantizer.quantize(data((4, 8), torch.bfloat16)))
    g = data((4, 8), torch.float32, seed=3)
    (w.float() * g).sum().backward()
    assert type(w.grad) is torch.Tensor and w.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad, g.to(torch.bfloat16))


def test_to_dtype_stays_quantized_where_float_does_not(qt):
    assert isinstance(qt.to(torch.float32), QuantizedTensor)
    assert not isinstance(qt.float(), QuantizedTensor)


def test_usage_copy_leaves_the_tensor_as_it_is():
    q = lowprec.Float8CurrentScalingQuantizer()
    with q.usages(rowwise=True, columnwise=False):
        qt = q.quantize(torch.randn(48, 32))
    col = qt.usage_copy("columnwise")  # derived (per-tensor FP8: a transpose)
    assert not qt.has_usage("columnwise") and col.has_usage("columnwise")
    assert not col.has_usage("rowwise") and col.shared_scale is qt.shared_scale
    assert torch.equal(col.dequantize(usage="columnwise"), qt.dequantize())
    # a held but transposed (non-contiguous) direction comes back contiguous
    view = type(qt)(qt.shape, qt.dtype, rowwise_data=None,
                    columnwise_data=col.columnwise_data.t().contiguous().t(),
                    shared_scale=qt.shared_scale, fp8_dtype=qt.fp8_dtype)
    assert not view.holds_gemm_layout("columnwise")
    fixed = view.usage_copy("columnwise")
    assert fixed.holds_gemm_layout("columnwise")
    assert torch.equal(fixed.dequantize(usage="columnwise"), qt.dequantize())
    mx = lowprec.MXFP8Quantizer()
    with mx.usages(rowwise=True, columnwise=False):
        with pytest.raises(RuntimeError, match="cannot derive its columnwise"):
            mx.quantize(torch.randn(64, 64)).usage_copy("columnwise")


def test_as_strided_is_the_identity_only():
    qt = lowprec.Float8CurrentScalingQuantizer()(torch.randn(8, 32))
    same = torch.as_strided(qt, (8, 32), (32, 1), 0)
    assert type(same) is type(qt) and torch.equal(same.dequantize(), qt.dequantize())
    with pytest.raises(NotImplementedError, match="as_strided only as the identity"):
        torch.as_strided(qt, (4, 32), (32, 1), 0)
