"""lowprec.debug.Recorder on a small model trained a few steps under each recipe: the rows,
their numbers against independent computations, which steps are recorded, and that
recording changes nothing."""

from __future__ import annotations

import csv
import math
import pickle
import sys
import types

import pytest
import torch
from debug_helpers import RECIPES, batches, make_model, state_quantizers, train
from torch.utils._python_dispatch import TorchDispatchMode

import lowprec
from lowprec.debug import COLUMNS, Recorder
from lowprec.modules.base import LowprecModule

ORIGINAL_GEMM_QUANTIZERS = LowprecModule.__dict__["gemm_quantizers"]

#: (layer, role, direction) of one step: fc1's input needs no gradient (no dgrad, so no
#: columnwise weight and no rowwise dY there)
KEYS = {("fc1", "input", "rowwise"), ("fc1", "input", "columnwise"), ("fc1", "weight", "rowwise"),
        ("fc1", "grad_output", "columnwise"),
        ("fc2", "input", "rowwise"), ("fc2", "input", "columnwise"),
        ("fc2", "weight", "rowwise"), ("fc2", "weight", "columnwise"),
        ("fc2", "grad_output", "rowwise"), ("fc2", "grad_output", "columnwise")}

FORMATS = {  # (fc2 input rowwise, fc2 grad_output columnwise)
    "current": ("fp8_current(e4m3)", "fp8_current(e5m2)"),
    "delayed": ("fp8_delayed(e4m3)", "fp8_delayed(e5m2)"),
    "mxfp8": ("mxfp8(e4m3)", "mxfp8(e4m3)"),
    "nvfp4": ("nvfp4", "nvfp4+rht+sr"),
}


def _rows(rec: Recorder, step: int) -> dict:
    return {(r["layer"], r["role"], r["direction"]): r for r in rec.rows if r["step"] == step}


def _hooks_gone(model) -> bool:
    return (LowprecModule.__dict__["gemm_quantizers"] is ORIGINAL_GEMM_QUANTIZERS
            and all(not {"quantize", "_quantize_exact", "quantize_fused", "share_key"}
                        & set(q.__dict__)
                    for q in state_quantizers(model)))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_rows_per_step_layer_role_direction(name):
    model = make_model()
    rec = Recorder(model, every=2)
    train(model, RECIPES[name](), batches(3), rec)
    rec.close()
    assert {r["step"] for r in rec.rows} == {0, 2}
    for step in (0, 2):
        rows = _rows(rec, step)
        assert set(rows) == KEYS
        for r in rows.values():
            assert tuple(r) == COLUMNS
            assert r["calls"] == 1 and r["shape"] == "128x128" and r["nonfinite"] == 0
            assert 0.0 <= r["saturated"] < 0.1 and 0.0 <= r["flushed"] < 0.5
            assert 10.0 < r["sqnr_db"] < 40.0 and r["amax"] > 0
            per_tensor = name in ("current", "delayed", "nvfp4")
            assert (r["scale"] is not None) == per_tensor
            blocks = name in ("mxfp8", "nvfp4")
            assert (r["block_scale_min"] is not None) == blocks
            if blocks:
                assert 0 <= r["block_scale_min"] <= r["block_scale_max"]
    rows = _rows(rec, 2)
    assert (rows["fc2", "input", "rowwise"]["format"],
            rows["fc2", "grad_output", "columnwise"]["format"]) == FORMATS[name]
    assert _hooks_gone(model)


def test_only_every_nth_step_is_hooked():
    model = make_model()
    rec = Recorder(model, every=3)
    for i, x in enumerate(batches(7)):
        with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
            model(x).square().mean().backward()
        # between steps nothing is hooked unless the next step is recorded
        rec.step()
        hooked = LowprecModule.__dict__["gemm_quantizers"] is not ORIGINAL_GEMM_QUANTIZERS
        assert hooked == ((i + 1) % 3 == 0)
        assert all(not {"quantize", "_quantize_exact"} & set(q.__dict__)
                   for q in state_quantizers(model))
    rec.close()
    assert sorted({r["step"] for r in rec.rows}) == [0, 3, 6]
    assert rec.step_index == 7
    assert _hooks_gone(model)
    pickle.dumps(model)  # nothing left on the modules or quantizers


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recording_leaves_training_bit_identical(name):
    xs = batches(3)
    plain = make_model()
    want_losses, want_grads = train(plain, RECIPES[name](), xs)
    recorded = make_model()
    rec = Recorder(recorded, every=1)
    losses, grads = train(recorded, RECIPES[name](), xs, rec)
    rec.close()
    assert len(rec.rows) == 3 * len(KEYS)
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    for got, want in zip(grads, want_grads):
        assert all(torch.equal(got[k], want[k]) for k in want)
    for p, q in zip(recorded.parameters(), plain.parameters()):
        assert torch.equal(p, q)


#: relative tolerance of an SQNR against an fp64 computation: the recorder accumulates its
#: sums of squares in fp32 (about 1e-7 relative each; a wrong value is off by far more)
FP32_SUMS = 1e-6


def _fp64_sqnr(x: torch.Tensor, approx: torch.Tensor) -> float:
    x, approx = x.double(), approx.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - approx) ** 2).sum()))


def _first_input_row(name: str, x: torch.Tensor) -> dict:
    model = make_model()
    rec = Recorder(model, every=1)
    train(model, RECIPES[name](), [x], rec)
    rec.close()
    return _rows(rec, 0)["fc1", "input", "rowwise"]


def test_sqnr_matches_an_fp64_computation_current_scaling():
    x = batches(1)[0]
    amax = x.abs().amax()
    scale = (448.0 / amax.double()).float()  # the spec's fp32 scale, correctly rounded
    deq = (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
    row = _first_input_row("current", x)
    assert row["scale"] == float(scale) and row["amax"] == float(amax)
    assert row["sqnr_db"] == pytest.approx(_fp64_sqnr(x, deq), rel=FP32_SUMS)


def test_sqnr_matches_an_fp64_computation_mxfp8():
    x = batches(1)[0]
    blocks = x.reshape(128, 4, 32)
    # smallest power of two >= amax / 448 per 1x32 block
    e = torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).double() / 448.0))
    q = (blocks.double() * 2.0 ** -e).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.double() * 2.0 ** e).reshape(128, 128)
    row = _first_input_row("mxfp8", x)
    assert row["sqnr_db"] == pytest.approx(_fp64_sqnr(x, deq), rel=FP32_SUMS)
    assert row["block_scale_min"] == float(2.0 ** e.min()) and row["saturated"] == 0.0


def test_saturation_under_a_stale_delayed_scale():
    """Step 0 sets the scale from its amax; step 1's input is three times larger, so the
    stale scale clips every value above the old amax."""
    x0, x1 = batches(2, seed=5)
    x1 = x1 * 3
    model = make_model()
    rec = Recorder(model, every=1)
    train(model, lowprec.DelayedScaling(), [x0, x1], rec)
    rec.close()
    scale = torch.tensor([448.0]) / x0.abs().amax().reshape(1)  # the state's update, fp32
    clipped = int(((x1 * scale).abs() > 448).sum())
    assert clipped > 100
    for usage in ("rowwise", "columnwise"):
        row = _rows(rec, 1)["fc1", "input", usage]
        assert row["scale"] == float(scale)
        assert row["saturated"] == clipped / x1.numel()
    assert _rows(rec, 0)["fc1", "input", "rowwise"]["saturated"] == 0.0  # scale 1 at step 0


def test_flush_to_zero_fraction():
    """Current scaling with amax 448 (scale 1): magnitudes below half the smallest E4M3
    subnormal (2^-10) come back as zero; exact zeros do not count."""
    x = batches(1, seed=7)[0]
    tiny = torch.rand(128, 128, generator=torch.Generator().manual_seed(3)) < 0.1
    x = torch.where(tiny, torch.full_like(x, 2.0 ** -12), x)
    x[5, :64] = 0.0
    x[0, 0] = 448.0
    q = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    nonzero = x != 0
    want = int((nonzero & (q == 0)).sum()) / int(nonzero.sum())
    assert want > 0.05
    row = _first_input_row("current", x)
    assert row["scale"] == 1.0 and row["flushed"] == want


def test_check_only_steps_record_no_rows():
    model = make_model()
    rec = Recorder(model, every=100, check_every=1)
    train(model, lowprec.MXFP8BlockScaling(), batches(3), rec)
    rec.close()
    assert {r["step"] for r in rec.rows} == {0}
    assert rec.report().steps == [0, 1, 2]


def test_step_scope():
    model = make_model()
    with Recorder(model, every=1) as rec:
        for x in batches(2):
            with rec.step_scope():
                with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
                    model(x).square().mean().backward()
        assert rec.step_index == 2
    assert {r["step"] for r in rec.rows} == {0, 1}
    assert _hooks_gone(model)
    with pytest.raises(RuntimeError, match="closed"):
        rec.step()


def test_csv_file(tmp_path):
    path = tmp_path / "precision.csv"
    model = make_model()
    rec = Recorder(model, every=2, csv_path=path)
    train(model, lowprec.NVFP4BlockScaling(), batches(3), rec)
    rec.close()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    assert len(rows) == len(rec.rows) == 2 * len(KEYS)
    for got, want in zip(rows, rec.rows):
        assert got["layer"] == want["layer"] and int(got["step"]) == want["step"]
        assert float(got["sqnr_db"]) == want["sqnr_db"]
        assert float(got["saturated"]) == want["saturated"]


def test_tensorboard_scalars(monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    model = make_model()
    rec = Recorder(model, every=1, tensorboard_dir="runs/x")
    train(model, lowprec.MXFP8BlockScaling(), batches(1), rec)
    rec.close()
    tags = {tag: (v, s) for tag, v, s in scalars}
    want = _rows(rec, 0)["fc2", "grad_output", "rowwise"]
    assert tags["fc2/grad_output/rowwise/sqnr_db"] == (want["sqnr_db"], 0)
    assert "fc2/grad_output/rowwise/scale" not in tags  # MXFP8 has no per-tensor scale


def test_tensorboard_missing_is_skipped_with_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    model = make_model()
    with pytest.warns(RuntimeWarning, match="TensorBoard is not installed"):
        rec = Recorder(model, every=1, tensorboard_dir="runs/x")
    train(model, lowprec.MXFP8BlockScaling(), batches(1), rec)
    rec.close()
    assert len(rec.rows) == len(KEYS)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"every": 0}, ValueError, r"every=0: expected a positive int"),
    ({"every": 2.5}, ValueError, r"every=2.5"),
    ({"every": True}, ValueError, r"every=True"),
    ({"check_every": -1}, ValueError, r"check_every=-1"),
    ({"check_finite": "sometimes"}, ValueError, r"check_finite='sometimes': use True or 'warn'"),
    ({"csv_path": 3}, TypeError, r"csv_path=3: expected a path"),
    ({"csv_path": "/no/such/folder/x.csv"}, ValueError, r"folder '/no/such/folder' does not"),
    ({"tensorboard_dir": ["runs"]}, TypeError, r"tensorboard_dir=\['runs'\]"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Recorder(make_model(), **kwargs)


def test_bad_model():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        Recorder("model")
    with pytest.warns(RuntimeWarning, match="holds no lowprec module"):
        Recorder(torch.nn.Linear(4, 4)).close()


class _HostReads(TorchDispatchMode):
    """Counts the ways a tensor's values reach the host: ``item``, ``tolist``, ``cpu``,
    ``numpy``, ``bool``/``float``/``int`` of a tensor (patched on ``torch.Tensor``) and
    ``aten._local_scalar_dense`` (any scalar read, also from C++). On CPU no transfer is
    seen otherwise; test_debug_gpu checks the CUDA side with the sync debug mode."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.n = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def method(t, *args, **kwargs):
            self.n += 1
            return original(t, *args, **kwargs)
        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _reads_of_a_step(model, recipe, x, rec, monkeypatch) -> tuple[int, int]:
    """Host reads of one training step's forward, backward and optimizer step, and of the
    ``rec.step()`` that ends it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with monkeypatch.context() as mp:
        reads = _HostReads(mp)
        with reads:
            with lowprec.autocast(recipe=recipe):
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        in_step = reads.n
        with reads:
            if rec is not None:
                rec.step()
        return in_step, reads.n - in_step


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_one_host_transfer_per_recorded_step(name, monkeypatch):
    """A recorded or checked step reads nothing back while it runs (the same host reads
    as an unrecorded step: those of the quantizers themselves) and once when it ends; an
    unrecorded step not at all."""
    x = batches(1)[0]
    kinds = ["recorded", "none", "recorded", "checked", "recorded"]
    # the quantizers' own reads, step by step (delayed scaling's first update reads the
    # scales back once, to know each used slot has one)
    plain = make_model()
    plain_reads = [_reads_of_a_step(plain, RECIPES[name](), x, None, monkeypatch)[0]
                   for _ in kinds]
    model = make_model()
    rec = Recorder(model, every=2, check_every=3)
    for step, kind in enumerate(kinds):
        in_step, at_end = _reads_of_a_step(model, RECIPES[name](), x, rec, monkeypatch)
        assert in_step == plain_reads[step], (step, kind)
        assert at_end == (0 if kind == "none" else 1), (step, kind)
    rec.close()
    assert sorted({r["step"] for r in rec.rows}) == [0, 2, 4]
    assert len(rec.rows) == 3 * len(KEYS)
