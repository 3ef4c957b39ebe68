"""The routed rows' gates of ``GroupedExperts`` (``_RowGates``): forward the indexed and
masked gates, backward the bits of indexing's own backward (a scatter-add from zero),
with padding rows, signed zeros and NaN in the gradient."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels.moe_route import route
from lowprec.modules.experts import _RowGates


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_gates_are_indexing_bit_for_bit(align, dtype):
    torch.manual_seed(0)
    tokens, experts, k = 300, 8, 2
    idx = torch.randint(0, experts, (tokens, k))
    counts, token_of, slot_of, valid, rows_of = route(idx, experts, align)
    padded = align > 1
    weights = torch.rand(tokens, k, dtype=dtype)

    w_ref = weights.clone().requires_grad_(True)
    ref = w_ref.reshape(-1)[slot_of]
    if padded:
        ref = ref.masked_fill(~valid, 0)
    w = weights.clone().requires_grad_(True)
    got = _RowGates.apply(w, slot_of, valid if padded else None, rows_of)
    assert torch.equal(got, ref)

    grad = torch.randn(ref.shape, dtype=dtype)
    real = valid.nonzero().flatten()
    grad[real[:7]] = -0.0  # slots whose only gradient is -0: indexing's sum gives +0
    grad[real[7]] = float("nan")
    if padded:
        assert bool((~valid).any())  # padding rows present, all on slot 0
        grad[~valid] = torch.randn(int((~valid).sum()), dtype=dtype)  # masked out
    ref.backward(grad)
    got.backward(grad)
    # the same bits, NaN where indexing's has NaN (the payload of a NaN plus zero differs
    # between torch's vectorized and scalar CPU adds)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = w_ref.grad.isnan()
    assert int(nan.sum()) == 1 and torch.equal(w.grad.isnan(), nan)
    assert torch.equal(w.grad[~nan].view(bits), w_ref.grad[~nan].view(bits))
    assert bool((w.grad.view(-1)[slot_of[real[:7]]].view(bits) == 0).all())  # +0, not -0
