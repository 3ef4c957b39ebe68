"""lowprec modules under ``torch.autocast`` with fp32 parameters (the Hugging Face Trainer's
``bf16=True``): they compute as ``torch.nn`` modules do there, GEMM operands in the
autocast dtype and quantized from it, gradients into fp32 ``.grad``."""

from __future__ import annotations

import copy

import pytest
import torch
from same_run import RECIPES

import lowprec
from lowprec.recipe.recipes import MXFP8BlockScaling

AMP = torch.bfloat16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _amp(recipe=None, device="cpu"):
    class _Both:
        def __enter__(self):
            self.a = torch.autocast(device, dtype=AMP)
            self.b = lowprec.autocast(enabled=recipe is not None, recipe=recipe)
            self.a.__enter__()
            self.b.__enter__()

        def __exit__(self, *exc):
            self.b.__exit__(*exc)
            self.a.__exit__(*exc)
    return _Both()


GEMM_MODULES = {
    "linear": (lambda: lowprec.Linear(128, 256), ()),
    "grouped_linear": (lambda: lowprec.GroupedLinear(2, 128, 256), ([128, 128],)),
    "ops_linear": (lambda: lowprec.ops.Sequential(lowprec.ops.Linear(128, 256)), ()),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(GEMM_MODULES))
def test_gemm_modules_compute_as_in_the_autocast_dtype(kind, rname, device):
    """fp32 module + fp32 input under torch.autocast == the bf16 module on the bf16 input:
    output, dX and dW (the fp32 .grad holds the bf16 gradient), bit for bit."""
    make, extra = GEMM_MODULES[kind]
    torch.manual_seed(0)
    fp32 = make().to(device)
    bf16 = copy.deepcopy(fp32).to(AMP)
    x = torch.randn(256, 128, device=device)
    g = torch.randn(256, 256, device=device)
    xa = x.clone().requires_grad_(True)
    torch.manual_seed(3)
    with _amp(RECIPES[rname](), device):
        ya = fp32(xa, *extra)
    ya.backward(g.to(AMP))
    xb = x.to(AMP).requires_grad_(True)
    torch.manual_seed(3)
    with lowprec.autocast(recipe=RECIPES[rname]()):
        yb = bf16(xb, *extra)
    yb.backward(g.to(AMP))
    assert ya.dtype == AMP and torch.equal(ya, yb)
    assert xa.grad.dtype == torch.float32 and torch.equal(xa.grad, xb.grad.float())
    for (name, p), (_, q) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert p.dtype == p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad.float()), name


@pytest.mark.parametrize("rname", ["current", "mxfp8", "nvfp4"])
def test_norm_modules_output_the_autocast_dtype(rname):
    """A fused norm + GEMM equals the norm module then the GEMM module, all under autocast;
    the norm runs in fp32 and rounds once to the autocast dtype."""
    torch.manual_seed(0)
    fused = lowprec.LayerNormLinear(128, 256)
    with torch.no_grad():
        fused.layer_norm_weight.normal_()
        fused.layer_norm_bias.normal_()
    norm, lin = lowprec.LayerNorm(128), lowprec.Linear(128, 256)
    with torch.no_grad():
        norm.weight.copy_(fused.layer_norm_weight)
        norm.bias.copy_(fused.layer_norm_bias)
        lin.weight.copy_(fused.weight)
        lin.bias.copy_(fused.bias)
    x = torch.randn(256, 128)
    with _amp(RECIPES[rname]()):
        h = norm(x)
        y_fused = fused(x)
        y_split = lin(h)
    want = torch.nn.functional.layer_norm(x.double(), (128,), norm.weight.double(),
                                          norm.bias.double()).to(AMP)
    assert h.dtype == AMP
    assert (h.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert torch.equal(y_fused, y_split)


@pytest.mark.parametrize("make", [
    lambda: lowprec.LayerNormMLP(128, 256, activation="swiglu"),
    lambda: lowprec.ops.Sequential(lowprec.ops.RMSNorm(128), lowprec.ops.BasicLinear(128, 256),
                                   lowprec.ops.Bias(256), lowprec.ops.GELU(),
                                   lowprec.ops.Linear(256, 128)),
    lambda: lowprec.RMSNorm(128),
], ids=["layernorm_mlp", "ops_sequential", "rmsnorm"])
def test_outputs_and_gradients_dtypes(make):
    m = make()
    x = torch.randn(2, 64, 128, requires_grad=True)
    with _amp(MXFP8BlockScaling()):
        y = m(x)
    y.float().sum().backward()
    assert y.dtype == AMP and x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


def test_cache_weights_under_autocast_matches_no_cache():
    torch.manual_seed(0)
    a = lowprec.Linear(128, 128)
    b = copy.deepcopy(a)
    x = torch.randn(128, 128)
    outs = []
    for m, cache in ((a, False), (b, True)):
        with torch.autocast("cpu", dtype=AMP), lowprec.autocast(recipe=MXFP8BlockScaling(),
                                                                 cache_weights=cache):
            outs.append([m(x) for _ in range(2)])
        # outside torch.autocast the same cache gives fp32 operands again
        with lowprec.autocast(recipe=MXFP8BlockScaling(), cache_weights=cache):
            outs[-1].append(m(x))
    for ya, yb in zip(*outs):
        assert torch.equal(ya, yb)
    assert outs[1][2].dtype == torch.float32


# ---- a Hugging Face model trained the AMP way ---------------------------------------------------
def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attention_dropout=0.0)
    return transformers.LlamaForCausalLM(cfg)


def _train(model, ids, recipe, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with _amp(recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_converted_hf_model_without_recipe_is_bit_identical():
    ref = _llama()
    model = lowprec.convert_model(copy.deepcopy(ref))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    assert _train(model, ids, None, 2) == _train(ref, ids, None, 2)


def test_converted_hf_model_trains_under_autocast_like_the_original():
    ref = _llama()
    model = lowprec.convert_model(copy.deepcopy(ref), recipe=MXFP8BlockScaling())
    ids = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(0))  # M=150
    want = _train(ref, ids, None, 8)
    got = _train(model, ids, MXFP8BlockScaling(), 8)
    assert got[-1] < got[0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05
