"""lowprec.cpu_offload: saved activations wait in CPU memory as their own bytes (quantized
tensors as codes and scales), weights stay on the device, gradients are bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from same_run import RECIPES, assert_same_run

import lowprec

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MODULES = {
    "linear": lambda: lowprec.Linear(128, 256),
    "layernorm_mlp": lambda: lowprec.LayerNormMLP(128, 256, activation="swiglu"),
    "ops": lambda: lowprec.ops.Sequential(lowprec.ops.LayerNorm(128), lowprec.ops.Linear(128, 256),
                                          lowprec.ops.GELU(), lowprec.ops.Linear(256, 128)),
}


def _step(m, x, recipe, offload):
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(5)
    with (offload if offload is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)), lowprec.autocast(recipe=recipe):
        y = m(x)
    y.backward(torch.ones_like(y))
    return x, y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_offload_is_bit_identical(kind, rname, device):
    torch.manual_seed(0)
    a = MODULES[kind]().to(device)
    b = copy.deepcopy(a)
    x = torch.randn(2, 64, 128, device=device)
    for _ in range(2):  # delayed scaling: the second step reads the first one's amaxes
        xa, ya = _step(a, x, RECIPES[rname](), None)
        off = lowprec.cpu_offload(pin_memory=device == "cuda")
        xb, yb = _step(b, x, RECIPES[rname](), off)
        assert off.offloaded_bytes > 0
        assert_same_run(a, b, xa, xb, ya, yb)


#: bytes per element of a saved (M, K) input: its codes and scales
BYTES_PER_ELEMENT = {None: 4.0, "current": 1.0, "block": 1 + 4 / 128, "mxfp8": 1 + 1 / 32,
                     "nvfp4": 0.5 + 1 / 16}


@pytest.mark.parametrize("rname", list(BYTES_PER_ELEMENT))
def test_offloaded_bytes_are_the_quantized_input_only(rname):
    m = lowprec.Linear(1024, 512)
    x = torch.randn(256, 1024, requires_grad=True)
    off = lowprec.cpu_offload()
    with off, lowprec.autocast(enabled=rname is not None,
                               recipe=RECIPES[rname]() if rname else None):
        y = m(x)
    # the columnwise input for wgrad, nothing of the weight (plus at most a global scale)
    want = BYTES_PER_ELEMENT[rname] * x.numel()
    assert want <= off.offloaded_bytes <= want + 8
    y.sum().backward()


def test_parameters_and_weight_copies_stay():
    m = lowprec.Linear(128, 128)
    seen = []
    off = lowprec.cpu_offload()
    pack = off._pack

    def spy(t):
        out = pack(t)
        seen.append((t, out is t))
        return out

    off.pack_hook = spy
    with off, lowprec.autocast(recipe=RECIPES["current"]()):
        m(torch.randn(64, 128, requires_grad=True)).sum().backward()
    kept = [t for t, stayed in seen if stayed]
    moved = [t for t, stayed in seen if not stayed]
    assert len(kept) == 1 and tuple(kept[0].shape) == (128, 128)  # the quantized weight copy
    assert len(moved) == 1 and tuple(moved[0].shape) == (64, 128)  # the quantized input


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_torch_save_on_cpu_pinned_names_cpu_offload():
    m = lowprec.Linear(128, 128).cuda()
    with pytest.raises(TypeError, match=r"lowprec\.cpu_offload"):
        with torch.autograd.graph.save_on_cpu(pin_memory=True), \
                lowprec.autocast(recipe=RECIPES["mxfp8"]()):
            m(torch.randn(64, 128, device="cuda", requires_grad=True))


def test_bad_arguments():
    with pytest.raises(TypeError, match="pin_memory"):
        lowprec.cpu_offload(pin_memory="yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            lowprec.cpu_offload(pin_memory=True)
