"""Under ``torch.no_grad`` and ``torch.inference_mode`` a Linear quantizes its input and
weight only in the direction the forward reads (rowwise): no columnwise copy is made for
a backward that cannot come."""

from __future__ import annotations

import pytest
import torch
from same_run import RECIPES

import lowprec
from lowprec.formats.base import Quantizer


def _spy_usages(monkeypatch) -> list:
    """(rowwise, columnwise) usages of every quantize from now on, in order."""
    seen = []
    quantize = Quantizer.quantize

    def spy(self, t, *args, **kwargs):
        seen.append((self.rowwise_usage, self.columnwise_usage))
        return quantize(self, t, *args, **kwargs)

    monkeypatch.setattr(Quantizer, "quantize", spy)
    return seen


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("rname", ["current", "delayed", "block", "mxfp8", "nvfp4"])
def test_eval_forward_quantizes_rowwise_only(rname, grad_mode, monkeypatch):
    seen = _spy_usages(monkeypatch)
    m = lowprec.Linear(128, 128, name="l")
    with grad_mode(), lowprec.autocast(recipe=RECIPES[rname]()):
        m(torch.randn(32, 128))
    assert seen == [(True, False), (True, False)]  # the input, then the weight


MODULES = {
    "LayerNormLinear": (lambda: lowprec.LayerNormLinear(128, 128, name="l"), 2),
    "LayerNormMLP": (lambda: lowprec.LayerNormMLP(128, 256, name="l"), 4),
    "GroupedLinear": (lambda: lowprec.GroupedLinear(2, 128, 128, name="l"), 4),
}


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("rname", ["current", "delayed", "block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("module", list(MODULES))
def test_eval_forward_of_every_module_quantizes_rowwise_only(module, rname, grad_mode,
                                                             monkeypatch):
    """The norm modules and GroupedLinear too: every quantize of an evaluation forward
    (each GEMM's input and weight) makes the rowwise direction alone."""
    seen = _spy_usages(monkeypatch)
    build, quantizes = MODULES[module]
    m = build()
    x = torch.randn(32, 128)
    with grad_mode(), lowprec.autocast(recipe=RECIPES[rname]()):
        m(x, [16, 16]) if module == "GroupedLinear" else m(x)
    assert seen == [(True, False)] * quantizes
