"""Recorder.report(): what ran quantized under which recipe and format, what ran in high
precision and why, and which nn.Linear convert_model left alone."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import lowprec
from lowprec.debug import Recorder
from lowprec.debug.report import OUTSIDE_AUTOCAST


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 100))
        self.twin = self.body[2]           # one module at two places: left alone
        self.aux = nn.Linear(128, 128)     # called outside autocast
        self.keep = nn.Linear(128, 128)    # left alone by the filter
        self.spare = nn.Linear(128, 128)   # never called

    def forward(self, x):
        with lowprec.autocast(enabled=False):
            a = self.aux(x)
        return self.body(x).sum() + a.sum() + self.keep(x).sum()


def _converted_net(recipe) -> Net:
    torch.manual_seed(0)
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convert_model warns about the skipped Linear
        return lowprec.convert_model(net, recipe=recipe,
                                     module_filter_fn=lambda m, name: name != "keep")


def test_report_lists_quantized_high_precision_and_unconverted_modules():
    recipe = lowprec.MXFP8BlockScaling()
    net = _converted_net(recipe)
    rec = Recorder(net, every=1)
    for _ in range(2):
        with lowprec.autocast(recipe=recipe):
            net(torch.randn(64, 128)).backward()
        rec.step()
    rec.close()
    report = rec.report()
    assert report.steps == [0, 1]
    assert set(report.quantized) == {"body.0"}
    run = report.quantized["body.0"]
    assert (run.kind, run.quantized_calls, run.recipes, run.backward_modes) == (
        "Linear", 2, ["MXFP8BlockScaling"], ["default"])
    assert run.formats[("body.0", "input", "rowwise")] == "mxfp8(e4m3)"
    assert run.formats[("body.0", "grad_output", "columnwise")] == "mxfp8(e4m3)"
    assert report.high_precision == {"aux": OUTSIDE_AUTOCAST}
    assert report.not_run == ["spare"]
    assert set(report.unconverted) == {"body.2", "keep"}
    assert "more than one place" in report.unconverted["body.2"]
    assert report.unconverted["keep"] == "module_filter_fn returned False"
    assert sorted(report.converted) == ["aux", "body.0", "spare"]
    text = str(report)
    for part in ("body.0 (Linear): 2 quantized call(s) under MXFP8BlockScaling",
                 "body.0 input: rowwise mxfp8(e4m3), columnwise mxfp8(e4m3)",
                 f"aux: {OUTSIDE_AUTOCAST}", "not run on a hooked step (1):\n  spare",
                 "body.2: the module object is used at more than one place"):
        assert part in text, (part, text)


def test_report_marks_roles_kept_in_high_precision():
    def qfactory(role):
        if role is not None and role.tensor_type == "weight":
            return lowprec.IdentityQuantizer()
        grad = role is not None and role.tensor_type.startswith("grad")
        return lowprec.Float8CurrentScalingQuantizer(
            torch.float8_e5m2 if grad else torch.float8_e4m3fn)

    model = nn.Sequential(lowprec.Linear(128, 128, name="fc"))
    rec = Recorder(model, every=1)
    with lowprec.autocast(recipe=lowprec.CustomRecipe(qfactory=qfactory)):
        model(torch.randn(32, 128, requires_grad=True)).sum().backward()
    rec.close()
    run = rec.report().quantized["0"]
    assert run.recipes == ["CustomRecipe"]
    assert run.formats[("fc", "weight", "rowwise")] == "identity"
    assert "fc weight: rowwise high precision (identity), columnwise high precision" \
        in str(rec.report())
    weight_rows = [r for r in rec.rows if r["role"] == "weight"]
    assert all(r["sqnr_db"] == float("inf") and r["saturated"] == 0.0 for r in weight_rows)


def test_report_without_convert_model():
    model = nn.Sequential(lowprec.Linear(128, 128, name="fc"), nn.Linear(128, 8))
    rec = Recorder(model, every=1)
    rec.close()
    report = rec.report()
    assert report.unconverted == {"1": "convert_model was not run on this model"}
    assert report.not_run == ["0"] and report.steps == []
