"""A linear plan's prepared quantizes (``LinearPlan.quantize_x/_w/_dy``) change no bit: a
Linear trained for several steps (the plan's first call quantizes the usual way, the
second binds the launches, the rest run bound) gives the outputs and gradients of the same
steps with every launch on Triton's ordinary path (``slow_launches``, where the prepared
quantizes fall back)."""

from __future__ import annotations

import pytest
import torch

import lowprec
import lowprec.kernels
from lowprec.kernels.launch import slow_launches
from lowprec.recipe.recipes import Recipe

pytestmark = pytest.mark.skipif(not lowprec.kernels.triton_available(),
                                reason="needs a CUDA device and Triton")


def _steps(recipe_name, shape, bias):
    torch.manual_seed(0)
    k, n = shape[-1], 96
    mod = lowprec.Linear(k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    recipe = Recipe.from_name(recipe_name)
    out = []
    for step in range(4):
        x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * (step + 1)
             ).requires_grad_(True)
        with lowprec.autocast(recipe=recipe):
            y = mod(x)
        y.backward(torch.randn_like(y))
        out += [y.detach(), x.grad, mod.weight.grad.clone()]
        mod.weight.grad = None
    return out


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "block", "mxfp8"])
@pytest.mark.parametrize("shape,bias", [((2, 64, 128), False), ((100, 256), True)])
def test_prepared_plan_is_bit_identical(recipe_name, shape, bias):
    fast = _steps(recipe_name, shape, bias)
    with slow_launches():
        usual = _steps(recipe_name, shape, bias)
    for a, b in zip(fast, usual):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_prepared_block_quantize_binds_and_keeps_every_bit(dim, rowwise, columnwise):
    """Block FP8's prepared quantize (``formats.block.launch.PreparedBlock``): the first
    call is left to the usual path, the second binds the launches, later ones run them
    bound, each the usual quantize's tensor bit for bit."""
    from lowprec.formats.block import Float8BlockQuantizer, Float8BlockwiseTensor
    from lowprec.formats.block.launch import PreparedBlock
    q = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=dim)
    shape = torch.Size((256, 384))
    prepared = PreparedBlock(q, shape, torch.bfloat16, torch.device("cuda"), rowwise,
                             columnwise)
    for call in range(4):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * (call + 1)
        fields = prepared(x)
        with q.usages(rowwise=rowwise, columnwise=columnwise):
            want = q.quantize(x)
        if call == 0:
            assert fields is None  # the usual path compiles the kernels first
            continue
        assert isinstance(prepared.launches, tuple), "the launches were bound"
        got = Float8BlockwiseTensor(shape, torch.bfloat16, **fields)
        for name, t in want.inner_tensors().items():
            other = getattr(got, name)
            assert (t is None) == (other is None), name
            if t is not None:
                assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                                   other.view(torch.uint8) if other.dtype.itemsize == 1
                                   else other), (call, name)
        usage = "rowwise" if rowwise else "columnwise"
        assert torch.equal(got.decode_scale(usage), want.decode_scale(usage))
