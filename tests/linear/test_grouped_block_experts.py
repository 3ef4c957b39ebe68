"""Experts that arrive block-quantized (``Float8BlockExperts``, the unsharded weight of an
FSDP2 quantized all-gather under FP8 block scaling): the tensor itself (its blocks are the
stacked weight's quantize, each expert's its own; what it supports and refuses), and
grouped_linear over it against the same experts in high precision, bit for bit."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import grouped_data, run_grads

import lowprec
from lowprec.formats.block.experts import Float8BlockExperts
from lowprec.kernels import triton_available
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import grouped_linear
from lowprec.linear.grouped_block_fp8 import BLOCK_FP8, block_fp8_quantizers
from lowprec.linear.grouped_engine import GroupedFunction, GroupedPlan

E4M3 = torch.float8_e4m3fn
SIZES = [(5, 0, 200, 130), (0, 0, 16, 0), (128, 1, 0, 255)]


def _block(w_dim=2):
    return LinearQuantizers(
        input=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1),
        weight=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=w_dim),
        grad_output=lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1))


def _experts(w, quantizer=None):
    """``w`` (E, N, K) as the gather brings it: its stacked rows quantized rowwise."""
    q = (quantizer or _block().weight).copy()
    q.set_usage(rowwise=True, columnwise=False)
    part = q.quantize(w.reshape(-1, w.shape[-1]))
    return Float8BlockExperts(w.shape, w.dtype, part.rowwise_data, part.rowwise_scale,
                              q.force_pow_2_scales)


def _bits(t):
    return t.view(torch.uint8)


def test_blocks_are_the_stacked_weights_quantize_and_each_experts_own():
    _, w, _ = grouped_data((4, 4, 4), 256, 384, w_scale=0.05)
    fbe = _experts(w)
    q = _block().weight
    q.set_usage(rowwise=True, columnwise=True)
    whole = q.quantize(w.reshape(-1, 256))
    got = fbe.blocks(columnwise=True)
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(_bits(getattr(got, name)), _bits(getattr(whole, name))), name
    for name in ("rowwise_scale", "columnwise_scale"):
        assert torch.equal(getattr(got, name), getattr(whole, name)), name
    assert got.pow2_scales("rowwise") and got.pow2_scales("columnwise")
    assert fbe.blocks().columnwise_data is None  # the weight's own codes untouched
    for g in range(3):
        own = q.quantize(w[g])
        mine = fbe.expert(g)
        assert mine.shape == (384, 256) and mine.dtype == torch.bfloat16
        assert torch.equal(_bits(mine.rowwise_data), _bits(own.rowwise_data))
        assert torch.equal(mine.rowwise_scale, own.rowwise_scale)
        assert torch.equal(mine.dequantize(), own.dequantize())
    assert torch.equal(fbe.dequantize(torch.float32),
                       whole.dequantize(torch.float32).view(3, 384, 256))


def test_holds_codes_and_scales_and_refuses_other_ops():
    _, w, _ = grouped_data((1, 1), 128, 256)
    fbe = _experts(w)
    assert fbe.shape == (2, 256, 128) and fbe.fp8_dtype == E4M3 and fbe.pow2
    for alias in (fbe.detach(), torch.ops.aten.alias(fbe),
                  torch.as_strided(fbe, (2, 256, 128), (256 * 128, 128, 1), 0),
                  torch.nn.Parameter(fbe)):
        assert isinstance(alias, Float8BlockExperts) and alias.codes is fbe.codes
        assert alias.scales is fbe.scales and alias.pow2
    assert repr(fbe) == ("Float8BlockExperts(shape=(2, 256, 128), dtype=torch.bfloat16, "
                         "fp8=torch.float8_e4m3fn, "
                         "pow2=True, device=cpu)")
    as_fp32 = fbe.float()
    assert isinstance(as_fp32, Float8BlockExperts) and as_fp32.dtype == torch.float32
    assert as_fp32.codes is fbe.codes
    with pytest.raises(TypeError, match="Float8BlockExperts .* does not support aten.add"):
        torch.add(fbe, 1)
    with pytest.raises(TypeError, match="does not support aten._to_copy"):
        fbe.to("meta")
    with pytest.raises(ValueError, match="N and K multiples of 128"):
        Float8BlockExperts((2, 192, 128), w.dtype, fbe.codes, fbe.scales, True)
    with pytest.raises(ValueError, match=r"scales must be fp32 of shape \(4, 1\)"):
        Float8BlockExperts(fbe.shape, w.dtype, fbe.codes, fbe.scales[:2], True)
    with pytest.raises(ValueError, match=r"codes must be float8 of shape \(512, 128\)"):
        Float8BlockExperts(fbe.shape, w.dtype, w.reshape(512, 128), fbe.scales, True)


#: (K, N): contractions cuBLAS takes 128x128 weight scales for (multiples of 512: the
#: block-scaled kernel) and ones it does not (the exact bf16 emulation)
SHAPES = [(512, 512), (256, 384)]


def _compare(device, sizes, call, k=256, n=384):
    """``call(x, w)`` over the high-precision experts and over them block-quantized: the
    same output and input gradient, and the weight gradient reaches the quantized experts
    as a plain tensor, bit for bit."""
    x, w, dy = grouped_data(sizes, k, n, w_scale=0.05, device=device)
    ref = run_grads(call, x, w, dy)
    fbe = _experts(w).requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    y = call(xs, fbe)
    y.backward(dy)
    assert torch.equal(y.detach(), ref[0]) and torch.equal(xs.grad, ref[1])
    assert type(fbe.grad) is torch.Tensor and torch.equal(fbe.grad, ref[2])


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_linear_over_block_experts_equals_the_weight_quantized_there(sizes):
    """On the CPU each expert's Linear over its own blocks: the per-group path's bits."""
    q = _block()
    _compare("cpu", sizes, lambda x, w: grouped_linear(
        x, w, torch.tensor(sizes), quantizers=q))


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_grouped_block_path_over_block_experts_reads_their_codes(sizes, k, n):
    """The grouped block-scaled path (its kernel's sum in torch ops off the GPU) over the
    gathered codes and scales: the same bits as quantizing the weight there."""
    q = _block()

    def call(x, w):
        picked = block_fp8_quantizers([q] * len(sizes), n, k)
        return GroupedFunction.apply(x, torch.tensor(sizes), GroupedPlan(BLOCK_FP8, picked),
                                     True, False, w)
    _compare("cpu", sizes, call, k, n)


def test_experts_without_power_of_two_scales_stay_per_group(monkeypatch):
    """Experts gathered without power-of-two scales are not the grouped path's operands
    (it takes their values as exact in bf16): each expert's Linear runs instead."""
    sizes = (3, 0, 5)
    x, w, _ = grouped_data(sizes, 512, 512)
    fbe = _experts(w, lowprec.Float8BlockQuantizer(E4M3, force_pow_2_scales=False))
    assert not fbe.pow2
    calls = []
    per_group = lowprec.linear.grouped._per_group
    monkeypatch.setattr(lowprec.linear.grouped, "_per_group",
                        lambda *a, **kw: calls.append(1) or per_group(*a, **kw))
    monkeypatch.setattr(lowprec.linear.grouped_block_fp8, "runs_on", lambda x, q: True)
    grouped_linear(x, fbe, list(sizes), quantizers=_block())
    assert calls == [1]


def test_outside_the_recipe_each_expert_is_a_quantized_weight():
    """Without quantizers (outside autocast) or under another recipe, each group runs as a
    Linear with that expert's quantized weight, as a quantized_model_init weight does."""
    sizes = (3, 0, 5)
    x, w, _ = grouped_data(sizes, 128, 256)
    fbe = _experts(w)
    for quantizers in (None, LinearQuantizers(lowprec.Float8CurrentScalingQuantizer(E4M3),
                                              lowprec.Float8CurrentScalingQuantizer(E4M3))):
        y = grouped_linear(x, fbe, list(sizes), quantizers=quantizers)
        ref = torch.cat([lowprec.linear.function.quantized_linear(
            xg, fbe.expert(g), quantizers=quantizers)
            for g, xg in enumerate(torch.split(x, list(sizes)))])
        assert torch.equal(y, ref)
    plain = grouped_linear(x, fbe, list(sizes))
    deq = fbe.dequantize()
    for g, (xg, yg) in enumerate(zip(torch.split(x, list(sizes)), torch.split(plain, list(sizes)))):
        torch.testing.assert_close(yg, xg @ deq[g].t(), rtol=2 ** -7, atol=1e-2)


HOPPER = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
         and triton_available()),
    reason="needs a Hopper GPU with Triton")


@HOPPER
@pytest.mark.parametrize("sizes", SIZES + [(300, 2, 129, 33, 0, 64)])
@pytest.mark.parametrize("k,n", SHAPES)
def test_gpu_grouped_linear_over_block_experts_bit_identical(sizes, k, n, monkeypatch):
    """On a Hopper GPU the grouped block-scaled FP8 kernels (and the exact bf16 emulation
    where cuBLAS takes no 128x128 scales) over the gathered codes: the same bits as the
    weight quantized in the grouped path, which both calls take (the per-group fallback
    would give the same bits)."""
    q = _block()

    def refused(*args, **kwargs):
        raise AssertionError("the per-group path ran")
    monkeypatch.setattr(lowprec.linear.grouped, "_per_group", refused)
    _compare("cuda", sizes, lambda x, w: grouped_linear(
        x, w, torch.tensor(sizes, device="cuda"), quantizers=q), k, n)
