"""The GEMM dispatcher's registry: ``gemm.use_backends`` and the backends' direct calls."""

import pytest
import torch

import lowprec
from lowprec.formats.float8.tensor import Float8Tensor
from lowprec.gemm import dispatch as G


def test_use_backends_keeps_the_direct_calls_with_their_backends():
    names = [b.name for b in G.BACKENDS]
    assert G._direct_calls().get(Float8Tensor) is not None  # cublas_fp8's direct call
    with G.use_backends(("plain", "emulated_fp32")):
        assert [b.name for b in G.BACKENDS] == ["plain", "emulated_fp32"]
        assert G._direct_calls() == {}  # no direct call skips the emulation
    assert [b.name for b in G.BACKENDS] == names
    assert G._direct_calls().get(Float8Tensor) is not None


def test_direct_calls_follow_an_edit_of_the_registry():
    """``BACKENDS`` edited in place (not through ``use_backends``): the direct calls are
    those of the backends it now holds, and come back when it is restored."""
    saved = list(G.BACKENDS)
    try:
        G.BACKENDS[:] = [b for b in saved if b.direct is None]
        assert G._direct_calls() == {}
        q = lowprec.Float8CurrentScalingQuantizer()
        a, b = q.quantize(torch.randn(32, 64)), q.quantize(torch.randn(48, 64))
        assert G.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32).shape == (32, 48)
    finally:
        G.BACKENDS[:] = saved
    assert G._direct_calls().get(Float8Tensor) is not None


def test_use_backends_needs_the_emulation():
    names = [b.name for b in G.BACKENDS]
    with pytest.raises(ValueError, match="emulated_fp32"):
        with G.use_backends(("plain",)):
            pass
    assert [b.name for b in G.BACKENDS] == names


def test_direct_call_declines_what_its_backend_declines():
    # CPU operands: cublas_fp8 takes none, so the direct call gives None and the emulation runs
    q = lowprec.Float8CurrentScalingQuantizer()
    a, b = q.quantize(torch.randn(32, 64)), q.quantize(torch.randn(48, 64))
    assert G._direct_calls()[Float8Tensor](a, "rowwise", b, "rowwise", torch.float32) is None
    got = G.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32)
    want = a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
