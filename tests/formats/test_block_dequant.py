"""The block FP8 bf16 dequantize (``formats/block/dequant.py``): the kernel against the
reference's fp32 division and cast on the same GPU, bit for bit, for rowwise and
columnwise codes of 1x128 and 128x128 blocks, power-of-two scales and not, E4M3 and E5M2,
NaN blocks and unaligned row counts; off the GPU the reference itself."""

from __future__ import annotations

import pytest
import torch
from format_inputs import spread

import lowprec.kernels
from lowprec.formats.block.dequant import dequantize_bf16
from lowprec.formats.block.quantizer import Float8BlockQuantizer
from lowprec.formats.block.reference import dequantize_blocks
from lowprec.kernels import reference_only

GPU = pytest.mark.skipif(not lowprec.kernels.triton_available(),
                         reason="needs a CUDA device and Triton")


def _quantized(m, k, dim, fp8, pow2, dist, device):
    g = torch.Generator(device=device).manual_seed(m + k + dim)
    x = spread(torch.randn(m, k, generator=g, device=device), torch.bfloat16, dist, g)
    x[0, 3] = float("nan")  # its block's codes and scale are NaN
    q = Float8BlockQuantizer(fp8, block_scaling_dim=dim, force_pow_2_scales=pow2)
    q.set_usage(rowwise=True, columnwise=m % 128 == 0)  # columnwise blocks run along M
    return q.quantize(x)


def _usages(m):
    return ("rowwise", "columnwise") if m % 128 == 0 else ("rowwise",)


def _cases():
    for dim, shapes in ((1, [(200, 384), (128, 128), (1, 256)]), (2, [(256, 384)])):
        for m, k in shapes:
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                for pow2 in (True, False):
                    yield dim, m, k, fp8, pow2


@pytest.mark.parametrize("dim,m,k,fp8,pow2", list(_cases()))
def test_cpu_is_the_reference(dim, m, k, fp8, pow2):
    qt = _quantized(m, k, dim, fp8, pow2, "wide", "cpu")
    for usage in _usages(m):
        data, scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
        ref = dequantize_blocks(data, scale, dim).to(torch.bfloat16)
        got = dequantize_bf16(data, scale, dim)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["wide", "tiny"])
@pytest.mark.parametrize("dim,m,k,fp8,pow2", list(_cases()))
def test_gpu_kernel_bit_identical_to_reference_ops(dim, m, k, fp8, pow2, dist):
    qt = _quantized(m, k, dim, fp8, pow2, dist, "cuda")
    for usage in _usages(m):
        data, scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
        got = dequantize_bf16(data, scale, dim)
        with reference_only():
            ref = dequantize_bf16(data, scale, dim)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), usage
        assert bool(got.isnan().any())  # the NaN block came through
        assert torch.equal(qt.bf16_operand(usage)[0].view(torch.int16), got.view(torch.int16))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dim,m,k,fp8,pow2", [c for c in _cases() if c[3] == torch.float8_e4m3fn])
def test_gpu_inline_op_compiled_bit_identical(dim, m, k, fp8, pow2):
    """The ``triton_op`` a compiled graph launches from inductor's code: called eagerly and
    compiled, the kernel's bits."""
    from lowprec.formats.block.dequant import dequantize_bf16_inline

    qt = _quantized(m, k, dim, fp8, pow2, "wide", "cuda")
    compiled = torch.compile(lambda d, s: dequantize_bf16_inline(d, s, dim) * 1,
                             fullgraph=True)
    for usage in _usages(m):
        data, scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
        want = dequantize_bf16(data, scale, dim).view(torch.int16)
        assert torch.equal(dequantize_bf16_inline(data, scale, dim).view(torch.int16), want)
        assert torch.equal(compiled(data, scale).view(torch.int16), want), usage
