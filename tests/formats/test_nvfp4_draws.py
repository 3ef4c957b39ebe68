"""The counter-based uniforms of NVFP4 stochastic rounding (lowprec/formats/nvfp4/draws.py).

The hash is checked against a plain-Python model of its definition (the torch version splits
its multiplies to stay inside int64), and the draws for their statistical properties and
for how they are keyed from torch's generator.
"""

import pytest
import torch

from lowprec.formats.nvfp4 import NVFP4Quantizer
from lowprec.formats.nvfp4.draws import draw_key, mix32, uniforms, uniforms_at

M32 = 0xFFFFFFFF


def _mix_py(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x7FEB352D) & M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & M32
    return h ^ (h >> 16)


def _uniform_py(k0: int, k1: int, i: int) -> float:
    pre = ((i & M32) * 0x9E3779B9 + ((i >> 32) & M32) * 0x85EBCA6B + k0) & M32
    return ((_mix_py(pre) ^ k1) >> 10) / 2.0 ** 22


def test_mix32_matches_plain_python_on_extreme_and_random_words():
    g = torch.Generator().manual_seed(0)
    words = torch.cat([torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, M32, 0xDEADBEEF]),
                       torch.randint(0, 1 << 32, (2000,), generator=g)])
    got = mix32(words)
    assert got.dtype == torch.int64
    assert got.tolist() == [_mix_py(w) for w in words.tolist()]


def test_uniforms_match_plain_python_including_indices_past_2_pow_32():
    key = torch.tensor([0xC0FFEE11, 0xFFFFFFF0])
    idx = torch.tensor([0, 1, 2, 12345, (1 << 31) - 1, 1 << 31, M32, 1 << 32, (1 << 32) + 7,
                        (1 << 40) + 3, (1 << 62) + 99])
    got = uniforms_at(key, idx)
    assert got.dtype == torch.float32
    assert got.tolist() == [_uniform_py(0xC0FFEE11, 0xFFFFFFF0, i) for i in idx.tolist()]
    # the element 2**32 past another one gets another draw
    assert got[7] != got[0] and got[8] != uniforms_at(key, torch.tensor([7]))[0]


def test_uniforms_are_row_major_draws_of_the_index():
    key = torch.tensor([5, 9])
    u = uniforms(key, 7, 13)
    assert u.shape == (7, 13)
    assert torch.equal(u.flatten(), uniforms_at(key, torch.arange(91)))


def test_one_key_gives_distinct_hashes_for_distinct_indices():
    # For a fixed key the map index -> 32-bit hash is a bijection on each 2**32 range, so
    # 2**20 consecutive indices give 2**20 distinct hashes.
    key = torch.tensor([0x12345678, 0x9ABCDEF0])
    lo = torch.arange(1 << 20, dtype=torch.int64)
    pre = (lo * 0x9E3779B9 + key[0]) & M32   # < 2**52: no int64 overflow here
    h = mix32(pre) ^ key[1]
    assert torch.unique(h).numel() == lo.numel()


def test_uniforms_are_uniform_and_uncorrelated():
    n = 1 << 20
    u = uniforms(torch.tensor([31337, 4242]), 1, n).flatten().to(torch.float64)
    assert ((u >= 0) & (u < 1)).all()
    # mean and variance of U[0,1): sd of the mean is 1/sqrt(12 n) ~ 2.8e-4
    assert abs(u.mean().item() - 0.5) < 5 * (12 * n) ** -0.5
    assert abs(u.var().item() - 1 / 12) < 2e-3
    # 256 equal bins: chi-square with 255 dof, mean 255, sd ~22.6; 400 is ~6.4 sd out
    counts = torch.bincount((u * 256).long(), minlength=256).to(torch.float64)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 400, chi2
    # neighbours (in a row, and one row of 4096 apart) are uncorrelated: sd ~ 1/sqrt(n)
    for lag in (1, 4096):
        c = torch.corrcoef(torch.stack((u[:-lag], u[lag:])))[0, 1].item()
        assert abs(c) < 5 * n ** -0.5, (lag, c)


def test_keys_come_from_the_generator_and_differ_between_draws():
    g = torch.Generator().manual_seed(7)
    a, b = draw_key(g, "cpu"), draw_key(g, "cpu")
    assert a.dtype == torch.int64 and a.shape == (2,)
    assert ((a >= 0) & (a < (1 << 32))).all()
    assert not torch.equal(a, b)
    assert torch.equal(a, draw_key(torch.Generator().manual_seed(7), "cpu"))


@pytest.mark.parametrize("use_generator", [False, True])
def test_stochastic_rounding_is_repeatable_per_seed_and_advances_the_generator(use_generator):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 3

    def quantize(seed):
        gen = torch.Generator().manual_seed(seed) if use_generator else None
        if gen is None:
            torch.manual_seed(seed)
        q = NVFP4Quantizer(stochastic_rounding=True, with_rht=True, generator=gen)
        return q.quantize(x), q.quantize(x)

    (a1, a2), (b1, _), (c1, _) = quantize(3), quantize(3), quantize(4)
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(getattr(a1, name), getattr(b1, name)), name     # same seed
        assert not torch.equal(getattr(a1, name), getattr(c1, name)), name  # other seed
        assert not torch.equal(getattr(a1, name), getattr(a2, name)), name  # next draws
