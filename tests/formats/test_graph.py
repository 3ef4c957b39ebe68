"""The steps every traced linear shares (lowprec/formats/graph.py): the bf16 rounding
helpers that keep eager's values where inductor fuses neighbours."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats import graph

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_rounded_amax_is_the_amax_of_rounded_values():
    """``rounded_amax`` rounds once, after the reduction; inductor hands it the producer's
    unrounded fp32 values, so it must equal the amax of those values each rounded to bf16
    (eager's tensor): rounding to nearest is monotonic and symmetric. fp32 values of every
    magnitude, bf16 overflow (to inf), infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1 << 16, generator=g) * torch.exp2(
        torch.randint(-140, 128, (1 << 16,), generator=g).float())
    for extra in ([], [3.4e38], [-float("inf")], [float("nan"), 1.0]):
        t = torch.cat([v, torch.tensor(extra)]) if extra else v
        want = t.to(torch.bfloat16).abs().amax().float().reshape(1)
        got = graph.rounded_amax(t.to(torch.bfloat16))
        scalar = graph.rounded_amax(t.abs().amax().to(torch.bfloat16).reshape(1, 1))
        for x in (got, scalar):
            assert x.dtype == torch.float32 and x.shape == (1,)
            assert torch.equal(x, want) or (torch.isnan(x).all() and torch.isnan(want).all())
        # the order inductor may take: max of the unrounded values, rounded once
        once = graph.as_output(t.abs().amax().reshape(1), torch.bfloat16).float()
        assert torch.equal(once, want) or (torch.isnan(once).all() and torch.isnan(want).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_largest_magnitude_by_rows_is_the_whole_amax(device, dtype):
    """``largest_magnitude`` (rows first, then the rows' maxima) gives ``t.abs().amax()``'s
    bits: on one row, one column and unaligned shapes; with -0 alone (+0), an infinity,
    and a NaN anywhere (NaN)."""
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 1), (1, 300), (300, 1), (37, 129), (256, 512)):
        t = (torch.randn(shape, generator=g) * 100).to(dtype).to(device)
        cases = [t, torch.full(shape, -0.0, dtype=dtype, device=device)]
        for value in (float("inf"), float("nan")):
            c = t.clone()
            c[shape[0] // 2, shape[1] // 2] = value
            cases.append(c)
        for c in cases:
            got, want = graph.largest_magnitude(c), c.abs().amax()
            assert got.dtype == dtype and got.shape == ()
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)) \
                or (torch.isnan(got) and torch.isnan(want))


def test_bf16_rounding_helpers_are_exact():
    """``_rounded`` is the identity on every bf16 value and rounds fp32 as ``.to(bf16)``
    does; ``_output`` is ``.to(bf16)`` bit for bit, NaN, infinities and overflow included."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(graph.rounded(every).view(torch.int32),
                       every.float().view(torch.int32))
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1 << 18, generator=g) * torch.exp2(
        torch.randint(-149, 128, (1 << 18,), generator=g).float())
    v = torch.cat([v, torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4028235e38,
                                    -3.4028235e38, 1e-45, -0.0])])
    want = v.to(torch.bfloat16)
    got = graph.as_output(v, torch.bfloat16)
    assert torch.equal(got.view(torch.int16)[:-7], want.view(torch.int16)[:-7])
    assert torch.equal(got[-6:], want[-6:]) and torch.isnan(got[-7])
    half = v[:-7].to(torch.bfloat16)
    assert torch.equal(graph.rounded(half), half.float())


def _product_read(x, g, read):
    """A bf16 product (exact in fp32, so eager's tensor is it rounded once) read by a
    quantize's first step, and its amax."""
    y = x * g
    v = read(y)
    return v * 3.0, graph.rounded_amax(y)


@pytest.mark.parametrize("device", DEVICES)
def test_rounded_holds_under_inductor_fusion(device):
    """Compiled by inductor, ``rounded`` of a fused producer's output reads eager's rounded
    bf16 values, bit for bit; the same graph reading ``.float()`` instead gets the
    unrounded product in some elements (the check can fail: inductor does skip that
    rounding)."""
    torch.manual_seed(0)
    x = torch.randn(512, 1024, device=device, dtype=torch.bfloat16) * 3
    g = torch.randn(1024, device=device, dtype=torch.bfloat16)
    for read, same in ((graph.rounded, True), (lambda t: t.float(), False)):
        torch._dynamo.reset()
        want = _product_read(x, g, read)
        got = torch.compile(_product_read)(x, g, read)
        equal = [torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, got)]
        assert equal[1] and equal[0] is same


def test_kinds_are_made_once():
    """Each form hands out kinds made at import (a Kind built while dynamo traces costs it
    milliseconds), equal to the Kind of the same fields."""
    from lowprec.formats import (
        Float8BlockQuantizer,
        Float8CurrentScalingQuantizer,
        IdentityQuantizer,
        MXFP8Quantizer,
        NVFP4Quantizer,
    )
    from lowprec.formats.graph import Kind
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(128, 128)
    want = {Float8CurrentScalingQuantizer: Kind("fp8", e4m3),
            Float8BlockQuantizer: Kind("blocks", e4m3, 2),
            MXFP8Quantizer: Kind("exact"),
            # on the CPU NVFP4's values are the reference's fp32 ones, global scale applied
            NVFP4Quantizer: Kind("exact", bf16=False),
            IdentityQuantizer: Kind("plain", dtype=torch.float32)}
    for cls, kind in want.items():
        q = cls(e4m3) if cls in (Float8CurrentScalingQuantizer, Float8BlockQuantizer,
                                 MXFP8Quantizer) else cls()
        form = q.graph_operand(x)
        assert form.kind("rowwise") == kind, cls
        assert form.kind("rowwise") is form.kind("rowwise"), cls
