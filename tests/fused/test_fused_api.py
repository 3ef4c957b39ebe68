"""The fused-quantize API where it does not apply (CPU, formats without a fused kernel):
it must say so, never silently compute something else."""

from __future__ import annotations

import threading

import pytest
import torch

import lowprec
from lowprec import fused
from lowprec.formats.float8.quantizer import Float8CurrentScalingQuantizer
from lowprec.formats.nvfp4.quantizer import NVFP4Quantizer


def test_cpu_input_is_not_fusable_and_quantize_fused_raises():
    q = Float8CurrentScalingQuantizer()
    x = torch.randn(16, 32)
    assert not q.supports_fused(x)
    assert not fused.can_fuse(q, x, "default")
    with pytest.raises(NotImplementedError, match="supports_fused"):
        q.quantize_fused(x, fused.activation_prologue("gelu"))


def test_formats_without_a_fused_kernel_say_so():
    x = torch.randn(16, 32)
    assert not NVFP4Quantizer().supports_fused(x)
    assert not fused.can_fuse(None, x, "default")


def test_gated_prologue_needs_even_width():
    with pytest.raises(ValueError, match="even"):
        fused.activation_prologue("swiglu").out_features(7)
    assert fused.activation_prologue("swiglu").out_features(8) == 4
    assert fused.activation_prologue("gelu").out_features(7) == 7
    assert fused.activation_prologue("no_such") is None


def test_unfused_context_restores_the_switch():
    assert fused.switch.enabled()
    with fused.unfused():
        assert not fused.switch.enabled()
        assert not fused.can_fuse(Float8CurrentScalingQuantizer(), torch.randn(2, 2), "default")
    assert fused.switch.enabled()


def test_unfused_is_a_setting_of_its_thread():
    """Another thread's forwards fuse while one thread runs unfused."""
    seen = []
    with fused.unfused():
        worker = threading.Thread(target=lambda: seen.append(fused.switch.enabled()))
        worker.start()
        worker.join()
        assert not fused.switch.enabled()
    assert seen == [True]


def test_cpu_modules_unchanged_under_autocast():
    """On CPU LayerNormMLP runs norm and activation apart, as the unfused path does."""
    torch.manual_seed(0)
    mod = lowprec.LayerNormMLP(64, 128)
    x = torch.randn(8, 64, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y1 = mod(x)
    with fused.unfused(), lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y2 = mod(x)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "srelu", "qgelu", "swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_activation_backward_equals_autograd(act, dtype):
    """The fused activation's backward (``activations.activation_grad``) is bit-identical
    to autograd through the unfused one."""
    from lowprec.activations import activation_grad
    from lowprec.modules.activations import get_activation
    fn, gated = get_activation(act)
    g0 = torch.Generator().manual_seed(1)
    h = (torch.randn(16, 64, generator=g0) * 3).to(dtype)
    h[0, :3] = torch.tensor([0.0, float("nan"), -float("inf")])
    hh = h.clone().requires_grad_(True)
    y = fn(hh)
    g = torch.randn(y.shape, generator=g0).to(dtype)
    (want,) = torch.autograd.grad(y, hh, g)
    got = activation_grad(act, h, g)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_activation_registry_is_the_kernels_numbering():
    """The fused kernels' prologue codes (``load_tile``): gated codes from 20, each gated
    activation applying silu (swiglu) or gelu (geglu) to its first half."""
    from lowprec.activations import REGISTRY, activation_fp32
    from lowprec.fused.prologue import ACT_CODES
    assert {n: a.code for n, a in REGISTRY.items()} == {
        "gelu": 10, "relu": 11, "silu": 12, "srelu": 13, "qgelu": 14, "swiglu": 20, "geglu": 21}
    assert ACT_CODES == {n: a.code for n, a in REGISTRY.items()}
    assert all(a.gated == (a.code >= 20) for a in REGISTRY.values())
    assert all(fused.activation_prologue(n).gated == a.gated for n, a in REGISTRY.items())
    x = torch.randn(4, 16)
    for gated, base in (("swiglu", "silu"), ("geglu", "gelu")):
        assert torch.equal(activation_fp32(gated, x), activation_fp32(base, x[:, :8]) * x[:, 8:])
