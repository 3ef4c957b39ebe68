"""dY's quantize in a compiled graph (``Tensorwise._graph_quantize``): eager's amax and cast
kernels, launched by inductor itself (``launch.fp8_current_quantize_graph``), give the
reference's codes, scale and decode scale bit for bit, on unaligned shapes and on inputs a
fused producer hands over in another layout."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.float8 import graph as fp8_graph
from lowprec.kernels import triton_available

pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                       reason="needs CUDA with Triton"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same(got, want_codes, want_scale, want_decode, transposed=False):
    codes = want_codes.t().contiguous() if transposed else want_codes
    assert got.data.shape == codes.shape
    assert torch.equal(got.data.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.int32), want_scale.view(torch.int32))
    assert got.decode.shape == ()
    assert torch.equal(got.decode.view(torch.int32), want_decode.view(torch.int32))


@pytest.mark.parametrize("shape", [(1, 16), (257, 131), (1000, 769), (4096, 768)])
@pytest.mark.parametrize("fmt", [(E4M3, False, 0.0), (E5M2, True, 1e-4)])
@pytest.mark.parametrize("usages", [(True, True), (True, False), (False, True)])
def test_compiled_graph_quantize_is_the_reference(shape, fmt, usages):
    dtype, pow2, eps = fmt
    row, col = usages
    form = fp8_graph.Tensorwise(dtype, pow2, eps, kernel=True)
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    x[0, 0] = 0.0
    codes, scale, decode = fp8_graph.fp8_tensorwise(x, dtype, pow2, eps, True)

    def quantize(t):
        return form.grad(t * 2, row, col)  # a producer inductor fuses into the copy

    got_row, got_col = torch.compile(quantize, fullgraph=True)(x / 2)
    assert (got_row is not None) == row and (got_col is not None) == col
    if row:
        _same(got_row, codes, scale, decode)
    if col:
        _same(got_col, codes, scale, decode, transposed=True)


def test_a_transposed_producer_and_special_values():
    """dY that arrives transposed (as from attention's layout), with Inf: NaN codes, as
    the reference gives them."""
    form = fp8_graph.Tensorwise(E4M3, kernel=True)
    x = torch.randn(96, 200, device="cuda", dtype=torch.bfloat16)
    for special in (None, float("inf"), float("nan")):
        t = x.clone()
        if special is not None:
            t[5, 7] = special
        want = fp8_graph.fp8_tensorwise(t.t().contiguous(), E4M3, False, 0.0, True)
        got = torch.compile(lambda a: form.grad(a.t(), True, True), fullgraph=True)(t)
        _same(got[0], *want)
        _same(got[1], *want, transposed=True)
        torch._dynamo.reset()


def test_inductor_launches_the_kernels_itself():
    """No call into Python per quantize: the generated code launches the amax and cast
    kernels as it launches its own."""
    from torch._inductor.utils import run_and_get_code

    form = fp8_graph.Tensorwise(E4M3, kernel=True)
    x = torch.randn(64, 80, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda a: form.grad(a + 1, True, True), fullgraph=True)
    _, code = run_and_get_code(fn, x)
    text = "\n".join(code)
    assert "amax_kernel" in text and "cast_kernel" in text
    assert "ops.lowprec.fp8_current_quantize_graph" not in text
