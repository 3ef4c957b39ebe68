"""``Quantizer.quantize`` and ``QuantizedTensor.dequantize`` are differentiable, as Transformer
Engine's are (its ``test_quantized_tensor.py::test_quantize_dequantize_autograd``): where
autograd records, the quantized tensor has a ``grad_fn`` and the gradient reaches the input
unchanged (straight through); under ``no_grad`` or for an input that needs no gradient no
graph is built."""

from __future__ import annotations

import pytest
import torch

from lowprec import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from lowprec.formats.base import QuantizedTensor

E4M3 = torch.float8_e4m3fn
QUANTIZERS = {
    "fp8_delayed": lambda: Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3),
    "fp8_current": lambda: Float8CurrentScalingQuantizer(E4M3),
    "fp8_block": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "mxfp8": lambda: MXFP8Quantizer(),
    "nvfp4": lambda: NVFP4Quantizer(with_rht=True),
    "identity": lambda: IdentityQuantizer(),
    "hybrid": lambda: HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(),
                                      columnwise_quantizer=NVFP4Quantizer()),
}
PARAMS = pytest.mark.parametrize("name", list(QUANTIZERS))


def _input(requires_grad=True):
    torch.manual_seed(0)
    return torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=requires_grad)


@PARAMS
@pytest.mark.parametrize("call", ["quantize", "__call__"])
def test_quantize_dequantize_round_trip_is_differentiable(name, call):
    x = _input()
    qt = getattr(QUANTIZERS[name](), call)(x)
    assert isinstance(qt, QuantizedTensor)
    assert qt.grad_fn is not None and qt.requires_grad
    (qt.dequantize().float() ** 2).sum().backward()
    assert x.grad is not None and x.grad.norm() > 0


@PARAMS
def test_gradient_goes_straight_through(name):
    x = _input()
    dy = torch.randn(32, 64, dtype=torch.bfloat16)
    QUANTIZERS[name]().quantize(x).dequantize().backward(dy)
    assert x.grad.dtype == x.dtype and torch.equal(x.grad, dy)
    x.grad = None
    # both directions' values, and the plain-tensor conversions, lead back to x the same way
    qt = QUANTIZERS[name]().quantize(x)
    (qt.dequantize(usage="columnwise").float().sum() + qt.float().sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@PARAMS
def test_no_graph_without_grad(name):
    q = QUANTIZERS[name]()
    with torch.no_grad():
        qt = q.quantize(_input())
    assert qt.grad_fn is None and not qt.requires_grad
    assert not qt.dequantize().requires_grad
    qt = q.quantize(_input(requires_grad=False))
    assert qt.grad_fn is None and not qt.requires_grad
    with torch.inference_mode():
        assert q.quantize(_input()).grad_fn is None


def test_quantized_tensor_keeps_its_quantizer_under_autograd():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = _input()
    qt = q.quantize(x)
    assert qt._quantizer is q
    with torch.no_grad():
        qt.mul_(2)  # in place, re-quantized with the tensor's own quantizer
    torch.testing.assert_close(qt.dequantize(), q.quantize(2 * x.detach()).dequantize())


def test_non_tensor_input_named():
    with pytest.raises(TypeError, match="expects a torch.Tensor, got list"):
        MXFP8Quantizer().quantize([1.0, 2.0])


@pytest.mark.parametrize("cast", ["to", "type"])
def test_dtype_cast_keeps_codes_and_gradient(cast):
    """``qt.to(dtype)`` / ``qt.type(dtype)`` change only the nominal dtype (a documented
    difference from TE, docs/formats.md); the gradient still reaches x, in x's dtype."""
    x = _input()
    qt = MXFP8Quantizer().quantize(x)
    half = getattr(qt, cast)(torch.float16)
    assert isinstance(half, QuantizedTensor) and half.dtype == torch.float16
    assert torch.equal(half.rowwise_data.view(torch.uint8), qt.rowwise_data.view(torch.uint8))
    half.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, torch.ones_like(x))
    # a dtype no quantized tensor carries gives the values, as in TE
    wide = qt.double()
    assert type(wide) is torch.Tensor and torch.equal(wide, qt.dequantize().double())
