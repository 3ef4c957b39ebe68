"""Stochastic rounding to bf16 (lowprec/optim/rounding.py)."""

from __future__ import annotations

import torch

from lowprec.optim.rounding import mix32, random_bits, round_to_bf16_stochastic, stream_key


def _neighbours(x: torch.Tensor):
    """The bf16 values just below and above |x| in magnitude (sign kept)."""
    bits = x.view(torch.int32).to(torch.int64)
    down = ((bits >> 16) << 16).to(torch.int32).view(torch.float32)
    up_bits = (((bits >> 16) + 1) << 16)
    up_bits = torch.where(up_bits >= 2 ** 31, up_bits - 2 ** 32, up_bits)
    up = up_bits.to(torch.int32).view(torch.float32)
    return down, up


def test_rounds_to_a_neighbour_and_keeps_bf16_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 14, generator=g) * torch.exp2(
        torch.randint(-60, 60, (1 << 14,), generator=g).float())
    r = round_to_bf16_stochastic(x, key=7).float()
    down, up = _neighbours(x)
    assert torch.all((r == down) | (r == up))
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(round_to_bf16_stochastic(exact, key=7).float(), exact)


def test_unbiased():
    """1 + 2**-10 lies an eighth of a unit above 1: about an eighth of the elements round
    up, and the mean is the value."""
    n = 1 << 16
    x = torch.full((n,), 1.0 + 2.0 ** -10)
    r = round_to_bf16_stochastic(x, key=stream_key(3, 1, 0)).float()
    frac_up = (r > 1).float().mean().item()
    sigma = (0.125 * 0.875 / n) ** 0.5
    assert abs(frac_up - 0.125) < 5 * sigma
    assert abs(r.mean().item() - x[0].item()) < 5 * sigma * 2.0 ** -7
    neg = round_to_bf16_stochastic(-x, key=stream_key(3, 1, 0)).float()
    assert torch.equal(neg, -r)  # the magnitude rounds, the sign stays


def test_reproducible_and_keyed():
    x = torch.randn(4096)
    a = round_to_bf16_stochastic(x, key=stream_key(0, 5, 2))
    assert torch.equal(a, round_to_bf16_stochastic(x, key=stream_key(0, 5, 2)))
    for other in (stream_key(1, 5, 2), stream_key(0, 6, 2), stream_key(0, 5, 3)):
        assert not torch.equal(a, round_to_bf16_stochastic(x, key=other))


def test_offset_is_the_index_in_the_whole_tensor():
    x = torch.randn(64, 33)
    key = stream_key(0, 1, 0)
    whole = round_to_bf16_stochastic(x, key)
    part = round_to_bf16_stochastic(x[20:], key, offset=20 * 33)
    assert torch.equal(whole[20:], part)


def test_specials():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3.4e38])
    r = round_to_bf16_stochastic(x, key=1)
    assert r[0] == float("inf") and r[1] == -float("inf") and torch.isnan(r[2])
    assert r[3] == 0 and r[4] == 0 and torch.signbit(r[4]) and not torch.signbit(r[3])
    assert r[5] >= torch.finfo(torch.bfloat16).max  # the largest finite or infinity


def test_hash_is_32_bit_and_the_same_for_ints_and_tensors():
    vals = [0, 1, 2 ** 31, 2 ** 32 - 1, 123456789]
    t = mix32(torch.tensor(vals, dtype=torch.int64))
    assert t.tolist() == [mix32(v) for v in vals]
    assert all(0 <= v < 2 ** 32 for v in t.tolist())
    bits = random_bits(1 << 16, key=5, offset=0, device="cpu")
    assert 0.45 < (bits & 1).float().mean().item() < 0.55
