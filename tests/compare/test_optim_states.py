"""``lowprec compare --optim-states``: every recipe again under each optimizer-state
variant (lowprec.optim.AdamW), resumable bit for bit like the default runs."""

from __future__ import annotations

import pytest

from lowprec.compare import cli, report
from lowprec.compare.progress import Progress

ARGS = ["--model", "tiny", "--steps", "6", "--device", "cpu", "--seed", "0", "--save-every",
        "2", "--recipes", "bf16,fp8_current", "--optim-states", "fp32,bf16-sr",
        "--no-noise-floor"]


def _run(args, capsys, interrupt=None):
    captured = {}
    with pytest.MonkeyPatch.context() as mp:
        write_csv, update = report.write_csv, Progress.update
        mp.setattr(report, "write_csv",
                   lambda path, results: captured.update(results=list(results))
                   or write_csv(path, results))
        if interrupt is not None:
            def stop(self, step, loss, ms, note=""):
                update(self, step, loss, ms, note)
                if (self.label, step) == interrupt:
                    raise KeyboardInterrupt
            mp.setattr(Progress, "update", stop)
        code = cli.main(["compare", *args])
    return code, capsys.readouterr().err, captured.get("results")


def _numbers(r):
    return (r.name, r.status, [(s.step, s.loss) for s in r.steps], r.val_losses,
            [(q.layer, q.role, q.rowwise_db, q.columnwise_db) for q in r.sqnr])


def test_variants_run_and_resume_bit_identical(tmp_path, capsys):
    code, err, whole = _run([*ARGS, "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err[-2000:]
    assert [r.name for r in whole] == ["bf16", "fp8_current", "bf16+bf16-sr",
                                       "fp8_current+bf16-sr"]
    assert all(r.ok for r in whole)
    assert "bf16 weights updated with stochastic rounding" in whole[2].description
    # the variant's updates differ from the fp32-state run's: it is not the same run
    assert whole[2].val_losses != whole[0].val_losses

    out = [*ARGS, "--out", str(tmp_path / "b")]
    code, _, _ = _run(out, capsys, interrupt=("fp8_current+bf16-sr", 5))
    assert code == 130
    code, err, resumed = _run([*out, "--resume"], capsys)
    assert code == 0, err[-2000:]
    assert [_numbers(r) for r in resumed] == [_numbers(r) for r in whole]


def test_unknown_variant_is_refused(tmp_path, capsys):
    code = cli.main(["compare", "--model", "tiny", "--optim-states", "fp32,int3",
                     "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "int3" in err and "bf16-sr" in err
