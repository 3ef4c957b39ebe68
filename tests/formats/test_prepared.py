"""``Quantizer.prepare``: a prepared quantize gives the tensor ``quantize_for_gemm`` gives,
bit for bit, on every call (the first through the usual path, the second binding the
launches, the rest through the bound launches), and falls back to the usual quantize for
a call of another kind. On the CPU every call takes the usual path."""

from __future__ import annotations

import pytest
import torch

import lowprec.kernels
from lowprec import Float8CurrentScalingQuantizer, Float8Quantizer
from lowprec.formats.float8.launch import PreparedCurrent, PreparedDelayed, PreparedPart

DEVICES = ["cpu"] + (["cuda"] if lowprec.kernels.triton_available() else [])


def _same(a, b):
    for name in ("rowwise_data", "columnwise_data"):
        da, db = getattr(a, name), getattr(b, name)
        assert (da is None) == (db is None), name
        if da is not None:
            assert torch.equal(da.view(torch.uint8), db.view(torch.uint8)), name
    for ta, tb in ((a.shared_scale, b.shared_scale), (a.decode_scale(), b.decode_scale())):
        assert torch.equal(ta.reshape(-1).view(torch.int32), tb.reshape(-1).view(torch.int32))
    assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("usages", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(3, 40, 96), (130, 72)])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_prepared_current_matches_quantize(device, usages, shape, fp8_dtype):
    rowwise, columnwise = usages
    q = Float8CurrentScalingQuantizer(fp8_dtype)
    ref_q = Float8CurrentScalingQuantizer(fp8_dtype).set_usage(rowwise=rowwise,
                                                              columnwise=columnwise)
    prepared = q.prepare(torch.Size(shape), torch.bfloat16, torch.device(device),
                         rowwise=rowwise, columnwise=columnwise)
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    for step in range(5):
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * 10 ** step
        if step == 4:
            x.view(-1)[7] = float("inf")  # a non-finite input: NaN codes and scale, both ways
        # another usage setting on the shared quantizer must not leak into the prepared call
        q.set_usage(rowwise=not rowwise, columnwise=True)
        got = prepared(x)
        _same(got, ref_q.quantize(x))
        assert got.has_usage("rowwise") == rowwise and got.has_usage("columnwise") == columnwise


@pytest.mark.parametrize("device", DEVICES)
def test_prepared_falls_back_for_another_kind_of_call(device):
    q = Float8CurrentScalingQuantizer()
    prepared = q.prepare(torch.Size((64, 32)), torch.bfloat16, torch.device(device),
                         rowwise=True, columnwise=True)
    ref_q = Float8CurrentScalingQuantizer()
    for _ in range(3):  # bind on the way
        prepared(torch.randn(64, 32, device=device, dtype=torch.bfloat16))
    for x in (torch.randn(32, 32, device=device, dtype=torch.bfloat16),       # another shape
              torch.randn(64, 32, device=device, dtype=torch.float32),        # another dtype
              torch.randn(32, 64, device=device, dtype=torch.bfloat16).t(),   # not contiguous
              torch.randn(64 * 32 + 1, device=device,
                          dtype=torch.bfloat16)[1:].view(64, 32)):           # misaligned
        _same(prepared(x), ref_q.quantize(x))


def test_prepare_checks_like_quantize():
    q = Float8CurrentScalingQuantizer()
    prepared = q.prepare(torch.Size((4, 4)), torch.bfloat16, torch.device("cpu"),
                         rowwise=True, columnwise=False)
    with pytest.raises(TypeError, match="expects fp32, bf16 or fp16"):
        prepared(torch.ones(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("usages", [(True, True), (True, False), (False, True)])
def test_prepared_delayed_matches_quantize(device, usages):
    """Delayed scaling: the same codes and scale, and the same amax recorded into the state,
    call after call (the state's scale moving in between)."""
    rowwise, columnwise = usages
    q, ref_q = _delayed(), _delayed()
    for quantizer in (q, ref_q):
        quantizer.scale, quantizer.amax = quantizer.scale.to(device), quantizer.amax.to(device)
    ref_q.set_usage(rowwise=rowwise, columnwise=columnwise)
    prepared = q.prepare(torch.Size((2, 48, 64)), torch.bfloat16, torch.device(device),
                         rowwise=rowwise, columnwise=columnwise)
    for step in range(5):
        x = torch.randn(2, 48, 64, device=device, dtype=torch.bfloat16) * (step + 1)
        if step == 4:
            x[0, 0, 0] = float("nan")
        _same(prepared(x), ref_q.quantize(x))
        assert torch.equal(q.amax.view(torch.int32), ref_q.amax.view(torch.int32))
        for quantizer in (q, ref_q):
            quantizer.scale.fill_(0.5 * (step + 2))
            quantizer.amax.zero_()


def test_only_plain_per_tensor_classes_bind():

    assert isinstance(_delayed()._prepared(torch.Size((4, 4)), torch.bfloat16,
                                           torch.device("cpu"), True, True), PreparedDelayed)

    class Sub(Float8CurrentScalingQuantizer):
        pass
    assert Sub()._prepared(torch.Size((4, 4)), torch.bfloat16, torch.device("cpu"), True,
                           True) is None
    assert isinstance(Float8CurrentScalingQuantizer()._prepared(
        torch.Size((4, 4)), torch.bfloat16, torch.device("cpu"), True, True), PreparedCurrent)


def _delayed():
    return Float8Quantizer(torch.full((1,), 3.0), torch.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [Float8CurrentScalingQuantizer, _delayed])
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_prepared_usage_like_matches(device, make, usage):
    """``prepare_usage_like`` gives ``quantize_usage_like``'s tensor on every call, sharing
    ``like``'s scale."""
    q, ref_q = make(), make()
    if isinstance(q, Float8Quantizer):
        q.scale, q.amax = q.scale.to(device), q.amax.to(device)
        ref_q.scale, ref_q.amax = ref_q.scale.to(device), ref_q.amax.to(device)
    other = "columnwise" if usage == "rowwise" else "rowwise"
    prepared = q.prepare_usage_like(torch.Size((96, 48)), torch.bfloat16, torch.device(device),
                                    usage)
    for step in range(4):
        x = torch.randn(96, 48, device=device, dtype=torch.bfloat16) * (step + 1)
        like = ref_q.set_usage(**{usage: False, other: True}).quantize(x)
        got = prepared(x, like)
        _same(got, ref_q.quantize_usage_like(x, like, usage))
        assert got.shared_scale is like.shared_scale
        assert got.has_usage(usage) and not got.has_usage(other)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("usages", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(40, 96), (130, 72)])
def test_prepared_part_matches_quantize_part(device, usages, shape):
    """``prepare_part`` gives ``quantize_part``'s tensor (the part quantized with the whole
    tensor's amax) on every call, whatever usages the quantizer is set to meanwhile."""
    rowwise, columnwise = usages
    q = Float8CurrentScalingQuantizer()
    ref_q = Float8CurrentScalingQuantizer().set_usage(rowwise=rowwise, columnwise=columnwise)
    prepared = q.prepare_part(torch.Size(shape), torch.bfloat16, torch.device(device),
                              rowwise=rowwise, columnwise=columnwise)
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    for step in range(5):
        whole = torch.randn(2 * shape[0], shape[1], device=device, dtype=torch.bfloat16,
                            generator=gen) * 10 ** step
        if step == 4:
            whole[-1, 3] = float("inf")  # in the other part: NaN codes and scale here too
        part = whole[:shape[0]]
        statistic = torch.maximum(ref_q.part_statistic(part),
                                  ref_q.part_statistic(whole[shape[0]:]))
        q.set_usage(rowwise=not rowwise, columnwise=True)
        got = prepared(part, statistic)
        _same(got, ref_q.quantize_part(part, statistic))
        assert got.has_usage("rowwise") == rowwise and got.has_usage("columnwise") == columnwise
    with pytest.raises(ValueError, match="needs the statistic"):
        prepared(part, None)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and Triton")
def test_prepared_paths_bind_their_launches_on_cuda():
    """On CUDA the third call of each prepared path runs bound launches (it is not left to
    the usual path for good), and they give the usual quantize's fields."""
    from lowprec.formats.float8.launch import PreparedUsageLike
    shape, dev = torch.Size((64, 96)), torch.device("cuda")
    delayed, ref_delayed = _delayed(), _delayed()
    for q in (delayed, ref_delayed):
        q.scale, q.amax = q.scale.to(dev), q.amax.to(dev)
    current = Float8CurrentScalingQuantizer()
    like = current.quantize(torch.randn(shape, device=dev, dtype=torch.bfloat16))
    bits = current.part_statistic(torch.randn(shape, device=dev, dtype=torch.bfloat16) * 3)
    cases = [(PreparedCurrent(current, shape, torch.bfloat16, dev, True, True), (),
              lambda x: Float8CurrentScalingQuantizer().quantize(x)),
             (PreparedDelayed(delayed, shape, torch.bfloat16, dev, True, True), (),
              lambda x: ref_delayed.quantize(x)),
             (PreparedUsageLike(current, shape, torch.bfloat16, dev, False, True), (like,),
              lambda x: Float8CurrentScalingQuantizer().quantize_usage_like(x, like,
                                                                             "columnwise")),
             (PreparedPart(current, shape, torch.bfloat16, dev, True, False), (bits,),
              lambda x: Float8CurrentScalingQuantizer().set_usage(
                  rowwise=True, columnwise=False).quantize_part(x, bits))]
    for prepared, extra, usual in cases:
        for _ in range(3):
            x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            fields = prepared(x, *extra)
            ref = usual(x)
        assert isinstance(prepared.launches, tuple), type(prepared).__name__
        got = type(ref)(x.shape, x.dtype, **fields)
        _same(got, ref)
