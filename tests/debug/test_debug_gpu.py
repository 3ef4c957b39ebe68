"""lowprec.debug on the GPU paths: Triton quantize kernels, fused norm/activation quantizes
(recorded unfused), dY kept as exact values (MXFP8/NVFP4 on Hopper), TensorBoard."""

from __future__ import annotations

import warnings

import pytest
import torch
from debug_helpers import RECIPES
from helpers import GPU_ONLY

import lowprec
import lowprec.kernels
from lowprec.debug import Recorder
from lowprec.debug.hooks import QuantizerHooks

pytestmark = GPU_ONLY


def _model():
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    return torch.nn.Sequential(lowprec.LayerNormLinear(256, 256, name="qkv", **kw),
                               lowprec.LayerNormMLP(256, 512, name="mlp", **kw))


def _train(model, recipe, rec=None, steps=2):
    torch.manual_seed(123)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        with lowprec.autocast(recipe=recipe):
            loss = model(x.requires_grad_(True)).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        model.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step()
    return losses, grads


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recording_on_gpu_is_bit_identical_and_complete(name):
    want = _train(_model(), RECIPES[name]())
    model = _model()
    rec = Recorder(model, every=1)
    got = _train(model, RECIPES[name](), rec)
    rec.close()
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    for ga, gb in zip(got[1], want[1]):
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
    keys = {(r["layer"], r["role"], r["direction"]) for r in rec.rows if r["step"] == 1}
    for layer in ("qkv", "mlp.fc1", "mlp.fc2"):
        for role in ("input", "weight", "grad_output"):
            assert {(layer, role, "rowwise"), (layer, role, "columnwise")} <= keys
    for r in rec.rows:
        assert r["saturated"] is not None and 0 <= r["saturated"] < 0.1
        assert r["sqnr_db"] < 45 and r["nonfinite"] == 0
        # delayed scaling's first step quantizes with scale 1: small gradients flush
        assert r["sqnr_db"] > 10 or (name == "delayed" and r["step"] == 0)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_exact_value_operands_read_like_quantized_ones(name):
    """Where dY is kept as exact values only, its rows match those of a run whose dY keeps
    its codes and scales (the same bits)."""
    seen = []
    model = _model()
    hooks = QuantizerHooks(model, lambda site, q, x, qt: seen.append(type(qt).__name__),
                           every_operand=True)
    hooks.follow_calls()
    try:
        _train(model, RECIPES[name](), steps=1)
    finally:
        hooks.remove()
    if "ExactTensor" not in seen:
        pytest.skip("this GPU keeps dY's codes (no exact-value operands)")
    rows = {}
    for exact in (True, False):
        model = _model()
        rec = Recorder(model, every=1)
        if exact:
            _train(model, RECIPES[name](), rec, steps=1)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(lowprec.Quantizer, "_quantize_exact", lambda self, x: None)
                _train(model, RECIPES[name](), rec, steps=1)
        rec.close()
        rows[exact] = {(r["layer"], r["role"], r["direction"]): r for r in rec.rows}
    assert rows[True].keys() == rows[False].keys()
    for key, a in rows[True].items():
        b = rows[False][key]
        for col in ("amax", "scale", "block_scale_min", "block_scale_max", "saturated",
                    "flushed"):
            assert a[col] == b[col], (key, col)
        assert a["sqnr_db"] == pytest.approx(b["sqnr_db"], rel=1e-9)


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    model = _model()
    rec = Recorder(model, every=1, tensorboard_dir=tmp_path / "tb")
    _train(model, lowprec.MXFP8BlockScaling(), rec, steps=1)
    rec.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def _syncs(fn) -> int:
    """Host synchronizations ``fn`` makes (``torch.cuda.set_sync_debug_mode``'s warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recorded_step_synchronizes_once_at_its_end(name):
    """While a recorded step runs it synchronizes as often as an unrecorded one (the
    statistics stay on the GPU); its end reads them back at most once."""
    def step(model):
        return _syncs(lambda: _train(model, RECIPES[name](), steps=1))

    plain = _model()
    step(plain)  # the first step creates the states
    want = step(plain)
    model = _model()
    step(model)
    rec = Recorder(model, every=1)
    got = step(model)
    at_end = _syncs(rec.step)
    rec.close()
    assert got == want and at_end <= 1, (got, want, at_end)
    assert {r["step"] for r in rec.rows} == {0}
