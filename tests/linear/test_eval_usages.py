"""Under ``torch.no_grad`` and ``torch.inference_mode`` a Linear quantizes its input and
weight only in the direction the forward reads (rowwise): no columnwise copy is made for
a backward that cannot come."""

from __future__ import annotations

import pytest
import torch
from same_run import RECIPES

import lowprec
from lowprec.formats.base import Quantizer


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("rname", ["current", "delayed", "block", "mxfp8", "nvfp4"])
def test_eval_forward_quantizes_rowwise_only(rname, grad_mode, monkeypatch):
    seen = []
    quantize = Quantizer.quantize

    def spy(self, t, *args, **kwargs):
        seen.append((self.rowwise_usage, self.columnwise_usage))
        return quantize(self, t, *args, **kwargs)

    monkeypatch.setattr(Quantizer, "quantize", spy)
    m = lowprec.Linear(128, 128, name="l")
    with grad_mode(), lowprec.autocast(recipe=RECIPES[rname]()):
        m(torch.randn(32, 128))
    assert seen == [(True, False), (True, False)]  # the input, then the weight
