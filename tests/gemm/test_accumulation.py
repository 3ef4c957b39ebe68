"""Fast accumulation of per-tensor FP8 GEMMs (``MMParams``, ``lowprec.gemm.accumulation``).

On the CPU, CUDA's routes (``gemm.cuda_routes``) show which GEMM direction asks cuBLAS for
fast accumulation, eager and compiled; on the GPU, fast accumulation stays within the
tolerance ``docs/formats.md`` states of the fp32-accumulated product, and compiled steps
equal eager ones bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_ONLY

import lowprec
from lowprec import recipe as R
from lowprec.gemm import cuda_routes
from lowprec.recipe import MMParams, gemm_fast_accum

FAST, SPLIT = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)


def test_recipes_carry_te_defaults_and_check_them():
    for recipe in (R.Float8CurrentScaling(), R.DelayedScaling()):
        assert (recipe.fp8_gemm_fprop, recipe.fp8_gemm_dgrad, recipe.fp8_gemm_wgrad) == \
            (FAST, SPLIT, SPLIT)
        assert gemm_fast_accum(recipe) == (True, False, False)
    assert gemm_fast_accum(R.CustomRecipe(lambda role: lowprec.IdentityQuantizer())) == \
        (False, False, False)
    assert gemm_fast_accum(R.MXFP8BlockScaling()) == (False, False, False)
    assert gemm_fast_accum(R.Float8CurrentScaling(fp8_gemm_fprop=SPLIT,
                                                  fp8_gemm_wgrad=FAST)) == (False, False, True)
    with pytest.raises(TypeError, match="fp8_gemm_dgrad must be a lowprec.recipe.MMParams"):
        R.DelayedScaling(fp8_gemm_dgrad=False)
    with pytest.raises(ValueError, match="use_split_accumulator"):
        MMParams(use_split_accumulator="yes")


def _current_factory(role):
    if role is None or role.tensor_type not in ("input", "weight", "grad_output"):
        return lowprec.IdentityQuantizer()
    dtype = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
    return lowprec.Float8CurrentScalingQuantizer(dtype)


CASES = {
    "current": (R.Float8CurrentScaling(), (True, False, False)),
    "delayed": (R.DelayedScaling(), (True, False, False)),
    "current_all_split": (R.Float8CurrentScaling(fp8_gemm_fprop=SPLIT), (False, False, False)),
    "custom_default": (R.CustomRecipe(_current_factory), (False, False, False)),
    "custom_fast_dgrad": (R.CustomRecipe(_current_factory, fp8_gemm_dgrad=FAST),
                          (False, True, False)),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_direction_asks_cublas_as_its_recipe_says(monkeypatch, name, compiled):
    """(fprop, dgrad, wgrad) fast accumulation reaches ``torch._scaled_mm`` on CUDA's
    routes, eager and through a traced graph."""
    recipe, want = CASES[name]
    calls = []
    real = torch._scaled_mm

    def spy(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), kwargs.get("use_fast_accum")))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch.manual_seed(0)
    lin = lowprec.Linear(64, 32, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(lin, backend="aot_eager", fullgraph=True) if compiled else lin
    with cuda_routes():
        with lowprec.autocast(recipe=recipe):
            y = fn(x)
        y.float().sum().backward()
    # cuBLAS's operands (M, K) x (K, N): fprop x W^T, dgrad dY W, wgrad dY^T x
    got = {(a, b): fast for a, b, fast in calls}
    assert got == {((48, 64), (64, 32)): want[0], ((48, 32), (32, 64)): want[1],
                   ((32, 48), (48, 64)): want[2]}


def _step(lin, x, dy, recipe, fn):
    x = x.detach().clone().requires_grad_(True)
    lin.weight.grad = None
    with lowprec.autocast(recipe=recipe):
        y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad


@GPU_ONLY[0]
@GPU_ONLY[1]
@pytest.mark.parametrize("k", [1024, 4096, 8192])
def test_fast_fprop_within_its_stated_tolerance(k):
    """Fast accumulation in fprop against the fp32-accumulated product of the same FP8
    operands: normwise relative error at most 2**-8 (docs/formats.md; measured on an H200
    1.4e-3, 2.3e-3 and 2.9e-3 for these K), and compiled equal to eager bit for bit;
    dgrad and wgrad, split by default, equal the all-split recipe's exactly."""
    torch.manual_seed(0)
    lin = lowprec.Linear(k, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    fast, split = R.Float8CurrentScaling(), R.Float8CurrentScaling(fp8_gemm_fprop=SPLIT)
    yf, dxf, dwf = _step(lin, x, dy, fast, lin)
    ys, dxs, dws = _step(lin, x, dy, split, lin)
    err = ((yf.float() - ys.float()).norm() / ys.float().norm()).item()
    print(f"k={k}: fast-accumulation fprop normwise relative error {err:.3e}")
    assert err <= 2 ** -8
    assert torch.equal(dxf, dxs) and torch.equal(dwf, dws)
    compiled = torch.compile(lin)
    for got, want in zip(_step(lin, x, dy, fast, compiled), (yf, dxf, dwf)):
        assert torch.equal(got, want)
