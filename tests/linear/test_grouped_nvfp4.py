"""The grouped path of NVFP4 (each expert's own global scales, grouped bf16 GEMMs over the
exact values): which quantizers it takes, its result against one quantized Linear per group
(CPU: within the bf16 rounding of the exact products; Hopper: bit for bit without
stochastic rounding), its stochastic rounding, and no host sync."""

from __future__ import annotations

import pytest
import torch
from grouped_helpers import (
    assert_grouped_equals_per_expert,
    assert_grouped_never_syncs,
    grouped_data,
    per_expert,
    run_grads,
)

import lowprec
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.grouped import group_alignment_for, grouped_linear
from lowprec.linear.grouped_engine import GroupedFunction, GroupedPlan
from lowprec.linear.grouped_nvfp4 import NVFP4, nvfp4_quantizers

SIZES = [(5, 0, 37, 22), (0, 0, 32, 0), (64, 1, 0, 31)]


def _nv(rht=True, two_d=True, sr=False, generator=None):
    """NVFP4BlockScaling's quantizers: RHT on the input's and dY's columnwise side, 16x16
    weight blocks, stochastic rounding of dY."""
    return LinearQuantizers(
        input=lowprec.NVFP4Quantizer(with_rht=rht),
        weight=lowprec.NVFP4Quantizer(with_2d_quantization=two_d),
        grad_output=lowprec.NVFP4Quantizer(with_rht=rht, stochastic_rounding=sr,
                                           generator=generator))


def test_takes_one_nvfp4_setting_whose_pairs_are_exact_in_bf16():
    q = _nv(sr=True)
    assert nvfp4_quantizers([q] * 3, 96, 64) == (q.input, q.weight, q.grad_output)
    assert nvfp4_quantizers([q, _nv(sr=True)], 96, 64) is not None  # equal settings
    assert group_alignment_for(q, 96, 64) == 16
    assert nvfp4_quantizers([q, _nv(sr=False)], 96, 64) is None
    assert nvfp4_quantizers([q], 96, 40) is None and nvfp4_quantizers([q], 88, 64) is None
    one_sided = _nv()
    one_sided.grad_output = lowprec.NVFP4Quantizer()  # RHT on x's wgrad side only
    assert nvfp4_quantizers([one_sided], 96, 64) is None
    rht_weight = _nv()
    rht_weight.weight = lowprec.NVFP4Quantizer(with_rht=True)
    assert nvfp4_quantizers([rht_weight], 96, 64) is None
    own = _nv(sr=True, generator=torch.Generator())  # another generator: not one setting
    assert nvfp4_quantizers([q, own], 96, 64) is None
    boundary = _nv()
    boundary.output = lowprec.NVFP4Quantizer()
    assert nvfp4_quantizers([boundary], 96, 64) is None
    hooked = _nv()
    hooked.input.quantize = hooked.input.quantize  # an instance attribute, as debug hooks set
    assert nvfp4_quantizers([hooked], 96, 64) is None
    mx = LinearQuantizers(lowprec.MXFP8Quantizer(), lowprec.MXFP8Quantizer(),
                          grad_output=lowprec.MXFP8Quantizer())
    assert nvfp4_quantizers([mx], 96, 64) is None


def _grouped(q, sizes):
    def fn(x, w):
        picked = nvfp4_quantizers([q] * w.shape[0], w.shape[1], w.shape[2])
        return GroupedFunction.apply(x, torch.tensor(sizes, device=x.device),
                                     GroupedPlan(NVFP4, picked), True, False, w)
    return fn


def _close_to_bf16(got, ref):
    # both round an fp32 sum of the same exact products to bf16 once: at most one bf16 ulp
    # apart, plus the fp32 sums' own error
    tol = ref.double().abs() * 2.0 ** -7 + ref.double().abs().amax() * 2.0 ** -18 + 1e-30
    assert ((got.double() - ref.double()).abs() <= tol).all()


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("rht", [False, True])
def test_cpu_grouped_path_equals_per_expert_to_bf16_rounding(sizes, rht):
    """Off the GPU the path's pieces run their torch forms: the same quantized values as
    the per-expert Linears, products summed in another order."""
    x, w, dy = grouped_data(sizes, 64, 96)
    x[3] *= 1e3  # one group far above the others: its own global scale
    q = _nv(rht=rht)
    got = run_grads(_grouped(q, sizes), x, w, dy)
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    for a, b in zip(got, ref):
        _close_to_bf16(a, b)


def test_cpu_grouped_linear_stays_per_expert():
    sizes = (5, 0, 37, 22)
    x, w, dy = grouped_data(sizes, 64, 96)
    assert_grouped_equals_per_expert(x, w, dy, sizes, _nv())


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a Hopper GPU")


@gpu
@pytest.mark.parametrize("sizes", SIZES + [(300, 2, 129, 33, 0, 64)])
@pytest.mark.parametrize("rht,two_d", [(True, True), (False, False), (True, False)])
def test_nvfp4_grouped_gpu_bit_identical_to_per_expert(sizes, rht, two_d):
    x, w, dy = grouped_data(sizes, 256, 128, device="cuda")
    x[3] *= 1e3
    assert_grouped_equals_per_expert(x, w, dy, sizes, _nv(rht=rht, two_d=two_d))


@gpu
def test_nvfp4_grouped_gpu_takes_the_grouped_path():
    sizes = [64, 0, 17, 47]
    x, w, dy = grouped_data(sizes, 256, 128, device="cuda")
    calls = []
    orig = NVFP4.forward

    def spy(*args):
        calls.append(1)
        return orig(*args)
    NVFP4.forward = spy
    try:
        grouped_linear(x, w, torch.tensor(sizes, device="cuda"), quantizers=_nv())
    finally:
        del NVFP4.forward  # the class's own again
    assert calls


@gpu
def test_nvfp4_grouped_gpu_stochastic_rounding_repeats_under_a_seed():
    """With stochastic rounding each direction draws one key for every expert (the draws
    themselves are tested against the reference in tests/formats/test_nvfp4_grouped.py):
    the same seed gives the same bits, another seed other gradients, and the forward, which
    draws nothing, stays that of nearest rounding."""
    sizes = [64, 0, 17, 47]
    x, w, dy = grouped_data(sizes, 256, 128, device="cuda")
    sizes_t = torch.tensor(sizes, device="cuda")

    def run(seed, sr=True):
        torch.manual_seed(seed)
        q = _nv(sr=sr)
        return run_grads(lambda a, b: grouped_linear(a, b, sizes_t, quantizers=q), x, w, dy)
    first, again, other, nearest = run(1), run(1), run(2), run(1, sr=False)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[1], other[1]) and not torch.equal(first[2], other[2])
    assert torch.equal(first[0], nearest[0])
    assert not torch.equal(first[1], nearest[1])


@gpu
def test_nvfp4_grouped_gpu_never_syncs():
    sizes = [64, 0, 17, 47]
    x, w, dy = grouped_data(sizes, 256, 128, device="cuda")
    assert_grouped_never_syncs(x, w, dy, torch.tensor(sizes, device="cuda"), _nv(sr=True))


@gpu
def test_nvfp4_grouped_gpu_list_weights():
    sizes = [64, 0, 17, 47]
    x, w, dy = grouped_data(sizes, 256, 128, device="cuda")
    q = _nv()
    ref = run_grads(per_expert(q, sizes), x, w, dy)
    xs = x.clone().requires_grad_(True)
    ws = [w[g].clone().requires_grad_(True) for g in range(len(sizes))]
    y = grouped_linear(xs, ws, torch.tensor(sizes, device="cuda"), quantizers=q)
    y.backward(dy)
    assert torch.equal(y.detach(), ref[0]) and torch.equal(xs.grad, ref[1])
    assert torch.equal(torch.stack([t.grad for t in ws]), ref[2])
