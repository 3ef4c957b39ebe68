"""reset_parameters() and meta-device init (``device="meta"`` → ``to_empty`` →
``reset_parameters``): the result equals a module built on the device from the same seed,
weights (plain or quantized) and forward outputs bit for bit."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import lowprec
from lowprec.formats import QuantizedTensor
from lowprec.recipe.recipes import MXFP8BlockScaling, Recipe

KINDS = {
    "linear": lambda d: lowprec.Linear(128, 256, device=d),
    "layernorm_linear": lambda d: lowprec.LayerNormLinear(128, 256, zero_centered_gamma=True,
                                                          device=d),
    "layernorm_mlp": lambda d: lowprec.LayerNormMLP(128, 256, normalization="RMSNorm",
                                                    activation="swiglu", device=d),
    "grouped_linear": lambda d: lowprec.GroupedLinear(2, 128, 256, device=d),
    "layernorm": lambda d: lowprec.LayerNorm(128, device=d),
    "rmsnorm": lambda d: lowprec.RMSNorm(128, zero_centered_gamma=True, device=d),
    "ops": lambda d: lowprec.ops.Sequential(lowprec.ops.LayerNorm(128, device=d),
                                            lowprec.ops.Linear(128, 256, device=d),
                                            lowprec.ops.Bias(256, device=d)),
}
RECIPES = {name: functools.partial(Recipe.from_name, name)
           for name in ("current", "delayed", "block", "mxfp8", "nvfp4")}


def _reset_all(model: torch.nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _values(t):
    return t.dequantize(torch.float32) if isinstance(t, QuantizedTensor) else t


def _run(model, kind, recipe):
    x = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(1))
    args = (x, [128, 128]) if kind == "grouped_linear" else (x,)
    if recipe is None or kind in ("layernorm", "rmsnorm"):
        return model(*args)
    with lowprec.autocast(recipe=recipe):
        return model(*args)


CASES = [pytest.param(kind, rname, quantized,
                      id=f"{kind}-{rname}-{'quantized_weights' if quantized else 'plain'}")
         for kind in KINDS for rname in RECIPES for quantized in (False, True)
         if not (quantized and kind in ("layernorm", "rmsnorm"))]  # norms: no GEMM weights


@pytest.mark.parametrize("kind,rname,quantized", CASES)
def test_meta_init_matches_construction(kind, rname, quantized):
    recipe = RECIPES[rname]()
    init = ((lambda: lowprec.quantized_model_init(recipe=recipe)) if quantized
            else contextlib.nullcontext)
    torch.manual_seed(0)
    with init():
        want = KINDS[kind](None)
    with init():
        got = KINDS[kind]("meta")
    assert all(p.device.type == "meta" for p in got.parameters())
    got.to_empty(device="cpu")
    torch.manual_seed(0)
    _reset_all(got)
    sd_want, sd_got = want.state_dict(), got.state_dict()
    for name, w in sd_want.items():
        if isinstance(w, torch.Tensor):
            g = sd_got[name]
            assert type(g) is type(w), name
            assert torch.equal(_values(g), _values(w)), name
            if isinstance(w, QuantizedTensor):
                assert [g.has_usage(u) for u in ("rowwise", "columnwise")] == \
                    [w.has_usage(u) for u in ("rowwise", "columnwise")]
    for _ in range(2):  # the second step reads delayed-scaling state the first one wrote
        assert torch.equal(_run(got, kind, recipe), _run(want, kind, recipe))


def test_every_module_has_reset_parameters():
    """Every module of an ops Sequential (activations, quantize ops and the Sequentials,
    which hold no parameters of their own, included) has ``reset_parameters``, so meta-device
    init resets every module of the model, each its own parameters, as construction drew
    them."""
    def build(d):
        return lowprec.ops.Sequential(
            lowprec.ops.LayerNorm(128, device=d), lowprec.ops.Linear(128, 256, device=d),
            lowprec.ops.GELU(), lowprec.ops.Quantize(),
            lowprec.ops.Sequential(lowprec.ops.Linear(256, 128, device=d), lowprec.ops.SwiGLU()))
    torch.manual_seed(0)
    want = build(None)
    got = build("meta").to_empty(device="cpu")
    torch.manual_seed(0)
    for m in got.modules():
        m.reset_parameters()
    for (name, w), (_, g) in zip(want.state_dict().items(), got.state_dict().items(),
                                 strict=True):
        assert torch.equal(g, w), name


def test_reset_parameters_redraws_in_place():
    with lowprec.quantized_model_init(recipe=MXFP8BlockScaling()):
        m = lowprec.LayerNormMLP(128, 256)
    w = m.fc1_weight
    data = w.rowwise_data
    before = w.dequantize(torch.float32).clone()
    with torch.no_grad():
        m.layer_norm_weight.mul_(3)
    m.reset_parameters()
    assert m.fc1_weight is w and w.rowwise_data is data  # same buffers, re-quantized
    assert not torch.equal(w.dequantize(torch.float32), before)
    assert torch.equal(m.layer_norm_weight, torch.ones(128))


@pytest.mark.parametrize("rname", ["fp8_delayed", "fp8_current", "fp8_block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("make", [
    lambda: lowprec.Linear(128, 128, device="meta"),
    lambda: lowprec.LayerNormLinear(128, 128, device="meta"),
    lambda: lowprec.LayerNormMLP(128, 256, device="meta"),
], ids=["linear", "layernorm_linear", "layernorm_mlp"])
def test_meta_forward_and_backward(rname, make):
    """Shape inference and FLOP counters run a model on the meta device: forward and
    backward under every recipe give the right shapes (torch has no autocast on meta, so
    lowprec's backward does not try to switch it off there)."""
    m = make()
    x = torch.randn(2, 32, 128, device="meta", requires_grad=True)
    with lowprec.autocast(recipe=Recipe.from_name(rname)):
        y = m(x)
    y.sum().backward()
    assert y.shape == (2, 32, 128) and y.device.type == "meta"
    assert x.grad.shape == x.shape
    assert all(p.grad.shape == p.shape for p in m.parameters())
