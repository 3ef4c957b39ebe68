"""Experts that arrive in FP8 (``Float8Experts``, the unsharded weight of an FSDP2
quantized all-gather): the tensor itself (what it supports, what it refuses), and
grouped_linear over it against the same experts in high precision, bit for bit."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import grouped_data, run_grads

import lowprec
from lowprec.formats.float8.experts import Float8Experts
from lowprec.formats.float8.grouped import quantize_experts
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import grouped_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [(5, 0, 37, 22), (0, 0, 32, 0), (64, 1, 0, 31)]


def _current(grad=E4M3):
    return LinearQuantizers(lowprec.Float8CurrentScalingQuantizer(E4M3),
                            lowprec.Float8CurrentScalingQuantizer(E4M3),
                            grad_output=lowprec.Float8CurrentScalingQuantizer(grad))


def _experts(w, q=None):
    codes, scales = quantize_experts(w, (q or _current()).weight)
    return Float8Experts(codes, scales, w.dtype)


def test_holds_codes_and_scales_and_refuses_other_ops():
    w = (torch.randn(3, 32, 16) * 0.1).bfloat16()
    fe = _experts(w)
    assert fe.shape == (3, 32, 16) and fe.dtype == torch.bfloat16 and fe.fp8_dtype == E4M3
    assert torch.equal(fe.dequantize(torch.float32),
                       fe.codes.float() / fe.scales[:, None, None])
    for alias in (fe.detach(), torch.ops.aten.alias(fe),
                  torch.as_strided(fe, (3, 32, 16), (512, 16, 1), 0),
                  torch.nn.Parameter(fe)):
        assert isinstance(alias, Float8Experts) and alias.codes is fe.codes
    as_fp32 = fe.float()  # a module computing in another dtype: the same codes
    assert isinstance(as_fp32, Float8Experts) and as_fp32.dtype == torch.float32
    assert as_fp32.codes is fe.codes
    with pytest.raises(TypeError, match="does not support aten._to_copy"):
        fe.to("meta")
    with pytest.raises(TypeError, match="does not support aten.add"):
        torch.add(fe, 1)
    with pytest.raises(TypeError, match="does not support aten.as_strided"):
        torch.as_strided(fe, (3, 16, 16), (256, 16, 1), 0)
    with pytest.raises(ValueError, match="3-D float8"):
        Float8Experts(w, fe.scales, torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp32 of shape \(3,\)"):
        Float8Experts(fe.codes, fe.scales[:2], torch.bfloat16)


def _compare(device, sizes, grad=E4M3):
    x, w, dy = grouped_data(sizes, 64, 96, device=device)
    q = _current(grad)
    sizes_t = torch.tensor(sizes, device=device)
    ref = run_grads(lambda a, b: grouped_linear(a, b, sizes_t, quantizers=q), x, w, dy)
    fe = _experts(w, q).requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    y = grouped_linear(xs, fe, sizes_t, quantizers=q)
    y.backward(dy)
    assert torch.equal(y.detach(), ref[0]) and torch.equal(xs.grad, ref[1])
    assert type(fe.grad) is torch.Tensor and torch.equal(fe.grad, ref[2])


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_linear_over_fp8_experts_equals_the_weight_quantized_there(sizes):
    _compare("cpu", sizes)


def test_fp8_experts_refused_where_they_are_not_the_recipes_weights():
    x, w, _ = grouped_data((4, 4), 64, 96)
    fe = _experts(w)
    mx = LinearQuantizers(lowprec.MXFP8Quantizer(), lowprec.MXFP8Quantizer(),
                          grad_output=lowprec.MXFP8Quantizer())
    for quantizers in (None, mx):
        with pytest.raises(ValueError, match="FP8 current-scaling recipe"):
            grouped_linear(x, fe, [4, 4], quantizers=quantizers)
    e5m2 = LinearQuantizers(lowprec.Float8CurrentScalingQuantizer(E4M3),
                            lowprec.Float8CurrentScalingQuantizer(E5M2),
                            grad_output=lowprec.Float8CurrentScalingQuantizer(E5M2))
    with pytest.raises(ValueError, match="gathered as torch.float8_e4m3fn"):
        grouped_linear(x, fe, [4, 4], quantizers=e5m2)
    with pytest.raises(ValueError, match="no bias"):
        grouped_linear(x, fe, [4, 4], torch.zeros(2, 96), quantizers=_current())


@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("sizes", SIZES + [(300, 2, 129, 33, 0, 64)])
@pytest.mark.parametrize("grad", [E4M3, E5M2], ids=["e4m3", "hybrid"])
def test_gpu_grouped_linear_over_fp8_experts_bit_identical(sizes, grad):
    _compare("cuda", sizes, grad)
