"""QuantizerHooks, the quantizer hooks lowprec.debug and lowprec compare share."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from debug_helpers import batches, make_model

import lowprec
from lowprec.debug.hooks import QuantizerHooks, _Hook
from lowprec.modules.base import LowprecModule


def test_a_hooked_quantizer_pickles_and_copies_unhooked():
    model = make_model()
    seen = []
    hooks = QuantizerHooks(model, lambda *a: seen.append(a))
    hooks.hook_states(lowprec.NVFP4BlockScaling(), torch.device("cpu"))
    try:
        q = hooks.wrapped[0]
        assert isinstance(q.__dict__["quantize"], _Hook)
        x = batches(1)[0]
        for twin in (pickle.loads(pickle.dumps(q)), copy.deepcopy(q)):
            assert not isinstance(twin.__dict__.get("quantize"), _Hook)
            twin.quantize(x)
        assert seen == []
        q.quantize(x)
        assert len(seen) == 1 and seen[0][0].layer == "fc1" and seen[0][0].role == "input"
        torch.save(model, io.BytesIO())
    finally:
        hooks.remove()
    assert "quantize" not in q.__dict__


def test_following_calls_is_exclusive_and_undone():
    original = LowprecModule.__dict__["gemm_quantizers"]
    model = make_model()
    first = QuantizerHooks(model, lambda *a: None)
    first.follow_calls()
    assert LowprecModule.__dict__["gemm_quantizers"] is not original
    with pytest.raises(RuntimeError, match="already followed by another"):
        QuantizerHooks(model, lambda *a: None).follow_calls()
    other = QuantizerHooks(make_model(), lambda *a: None)
    other.follow_calls()  # another model: fine
    first.remove()
    assert LowprecModule.__dict__["gemm_quantizers"] is not original  # still following other
    other.remove()
    assert LowprecModule.__dict__["gemm_quantizers"] is original


def test_each_layer_reading_one_input_is_seen():
    """q/k/v-like Linears reading one tensor share one quantize of it under a stateless
    format; with every_operand=True each is quantized (the same values) and seen."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(lowprec.Linear(128, 128, name=n) for n in "qkv")
    x = batches(1)[0].requires_grad_(True)
    recipe = lowprec.MXFP8BlockScaling()

    def run():
        with lowprec.autocast(recipe=recipe):
            out = sum(layer(x).square().sum() for layer in layers)
        out.backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
        x.grad = None
        layers.zero_grad(set_to_none=True)
        return grads

    want = run()
    seen = []
    hooks = QuantizerHooks(layers, lambda site, *a: seen.append((site.layer, site.role)),
                           every_operand=True)
    hooks.follow_calls()
    try:
        got = run()
        q = hooks.wrapped[0]
        assert q.share_key() is None
    finally:
        hooks.remove()
    assert q.share_key() is not None
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {layer for layer, role in seen if role == "input"} == {"q", "k", "v"}
