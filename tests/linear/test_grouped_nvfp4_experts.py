"""Experts that arrive NVFP4-quantized (``NVFP4Experts``, the unsharded weight of an FSDP2
quantized all-gather under NVFP4): the tensor itself (each expert is its own quantize, both
directions; what it supports and refuses), and grouped_linear over it against the same
experts in high precision, bit for bit."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import grouped_data, run_grads

import lowprec
from lowprec.formats.nvfp4.experts import NVFP4Experts, quantize_experts
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import grouped_linear
from lowprec.linear.grouped_engine import GroupedFunction, GroupedPlan
from lowprec.linear.grouped_nvfp4 import NVFP4, nvfp4_quantizers

SIZES = [(5, 0, 37, 22), (0, 0, 32, 0), (64, 1, 0, 31)]
K, N = 64, 96


def _nv(sr=False):
    """NVFP4BlockScaling's quantizers (dY's stochastic rounding where asked)."""
    return LinearQuantizers(
        input=lowprec.NVFP4Quantizer(with_rht=True),
        weight=lowprec.NVFP4Quantizer(with_2d_quantization=True),
        grad_output=lowprec.NVFP4Quantizer(with_rht=True, stochastic_rounding=sr))


def _experts(w):
    codes, scales, globals_ = quantize_experts(w, _nv().weight)
    return NVFP4Experts(w.shape, w.dtype, codes, scales, globals_)


def _data(sizes, device="cpu"):
    x, w, dy = grouped_data(sizes, K, N, device=device)
    w[-1] *= 1e3  # one expert far above the others: its own global scale
    return x, w, dy


HOPPER = pytest.mark.skipif(not (torch.cuda.is_available()
                                 and torch.cuda.get_device_capability() >= (9, 0)),
                            reason="needs a Hopper GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=HOPPER)])
def test_each_expert_is_its_own_quantize_both_directions(device):
    """On a GPU every expert is quantized in two launches (each expert's S, then the row
    kernel with one S a 16-row block), elsewhere one quantize an expert: both give each
    expert's own quantize, bit for bit."""
    _, w, _ = _data((1, 1, 1, 1), device)
    ne = _experts(w)
    q = _nv().weight
    q.set_usage(rowwise=True, columnwise=True)
    for g in range(4):
        own, mine = q.quantize(w[g]), ne.expert(g, columnwise=True)
        assert ne.expert(g).columnwise_data is None  # made only where asked
        assert mine.shape == (N, K) and mine.dtype == torch.bfloat16
        for name in ("rowwise_data", "columnwise_data", "rowwise_global", "columnwise_global"):
            assert torch.equal(getattr(mine, name), getattr(own, name)), (g, name)
        for name in ("rowwise_scale", "columnwise_scale"):
            assert torch.equal(getattr(mine, name).view(torch.uint8),
                               getattr(own, name).view(torch.uint8)), (g, name)
        assert torch.equal(ne.exact()[g], own.bf16_operand("rowwise")[0])
    assert torch.equal(ne.dequantize(torch.float32),
                       torch.stack([q.quantize(w[g]).dequantize(torch.float32)
                                    for g in range(4)]))


def test_refuses_other_quantizes_ops_and_bad_fields():
    _, w, _ = _data((1, 1))
    with pytest.raises(ValueError, match="16x16 blocks, rounded to nearest, without RHT"):
        quantize_experts(w, lowprec.NVFP4Quantizer())
    ne = _experts(w)
    assert ne.shape == (2, N, K)
    for alias in (ne.detach(), torch.nn.Parameter(ne), ne.float()):
        assert isinstance(alias, NVFP4Experts) and alias.codes is ne.codes
    with pytest.raises(TypeError, match="NVFP4Experts .* does not support aten.mul"):
        torch.mul(ne, 2)
    with pytest.raises(ValueError, match="N and K multiples of 16"):
        NVFP4Experts((2, 88, K), w.dtype, ne.codes, ne.scales, ne.globals)
    with pytest.raises(ValueError, match=r"globals must be torch.float32 of shape \(2,\)"):
        NVFP4Experts(ne.shape, w.dtype, ne.codes, ne.scales, ne.globals[:1])


def _compare(sizes, call, device="cpu", seed=None):
    """``call(x, w)`` over the high-precision experts and over them NVFP4-quantized: the
    same output and gradients bit for bit (``seed``: torch's generator seeded before each,
    for stochastic rounding's draws)."""
    x, w, dy = _data(sizes, device)
    if seed is not None:
        torch.manual_seed(seed)
    ref = run_grads(call, x, w, dy)
    ne = _experts(w).requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    y = call(xs, ne)
    y.backward(dy)
    assert torch.equal(y.detach(), ref[0]) and torch.equal(xs.grad, ref[1])
    assert type(ne.grad) is torch.Tensor and torch.equal(ne.grad, ref[2])


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "sr"])
def test_grouped_linear_over_nvfp4_experts_equals_the_weight_quantized_there(sizes, sr):
    """On the CPU each expert's Linear over its own quantized weight."""
    q = _nv(sr)
    _compare(sizes, lambda x, w: grouped_linear(x, w, torch.tensor(sizes), quantizers=q),
             seed=7 if sr else None)


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_nvfp4_path_over_nvfp4_experts_reads_their_values(sizes):
    """The grouped NVFP4 path (its torch forms off the GPU) over the gathered codes: the
    same bits as quantizing the weight there."""
    q = _nv()

    def call(x, w):
        picked = nvfp4_quantizers([q] * len(sizes), N, K)
        return GroupedFunction.apply(x, torch.tensor(sizes), GroupedPlan(NVFP4, picked), True,
                                     False, w)
    _compare(sizes, call)


@HOPPER
@pytest.mark.parametrize("sizes", SIZES + [(300, 2, 129, 33, 0, 64)])
def test_gpu_grouped_linear_over_nvfp4_experts_bit_identical(sizes, monkeypatch):
    """On a Hopper GPU the grouped NVFP4 kernels over the gathered codes (one dequantize
    pass): the same bits as the weight quantized in the grouped path, which both calls
    take (the per-group fallback would give the same bits)."""
    q = _nv()

    def refused(*args, **kwargs):
        raise AssertionError("the per-group path ran")
    monkeypatch.setattr(lowprec.linear.grouped, "_per_group", refused)
    _compare(sizes, lambda x, w: grouped_linear(
        x, w, torch.tensor(sizes, device="cuda"), quantizers=q), device="cuda")
