"""``lowprec compare --save-every N`` / ``--resume``: an interrupted comparison continued from
its checkpoints is the uninterrupted one bit for bit; a finished recipe is not trained again;
a checkpoint of other settings is refused; the outputs are never half-written.

The reference is an uninterrupted run of the same command in another --out. Recipes:
bf16, fp8_current, fp8_delayed (amax history in the modules' extra state) and nvfp4
(stochastic rounding of gradients draws from torch's global generator), tiny preset,
6 steps, a checkpoint every 2 steps.
"""

from __future__ import annotations

import csv
import os
import re
import shutil

import pytest
import torch

from lowprec.compare import cli, report, resume
from lowprec.compare.data import Batches
from lowprec.compare.progress import Progress
from lowprec.modules.extra_state import decode

RECIPES = ["bf16", "fp8_current", "fp8_delayed", "nvfp4"]
ARGS = ["--model", "tiny", "--steps", "6", "--device", "cpu", "--seed", "0", "--save-every", "2",
        "--recipes", ",".join(RECIPES), "--no-noise-floor"]


def run_cli(args, capsys):
    """Run ``lowprec compare``; return exit code, stdout, stderr, the results handed to
    write_csv (their exact values) and the names of the recipes train_one trained."""
    captured, trained = {}, []
    with pytest.MonkeyPatch.context() as mp:
        write_csv, train_one = report.write_csv, cli.train_one

        def capture_csv(path, results):
            captured["results"] = list(results)
            write_csv(path, results)

        def count_train(spec, *a, **kw):
            trained.append(spec.name)
            return train_one(spec, *a, **kw)

        mp.setattr(report, "write_csv", capture_csv)
        mp.setattr(cli, "train_one", count_train)
        code = cli.main(["compare", *args])
    out = capsys.readouterr()
    return code, out.out, out.err, captured.get("results"), trained


def losses(path):
    """recipe -> [(step, loss text)] from results.csv (the loss as written: repr of the float)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    out = {}
    for r in rows:
        out.setdefault(r[0], []).append((int(r[1]), r[2]))
    return out


def numbers(result):
    """What must be bit-identical between a resumed and an uninterrupted run."""
    return (result.name, result.status, [(s.step, s.loss) for s in result.steps],
            result.val_losses, result.val_loss, result.saved_bytes,
            [(r.layer, r.role, r.rowwise_db, r.columnwise_db, r.rowwise_format,
              r.columnwise_format, r.shape) for r in result.sqnr])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    capsys = _NullCapsys()
    code, _, err, results, trained = run_cli([*ARGS, "--out", str(out)], capsys)
    assert code == 0, err[-2000:]
    assert trained == RECIPES
    return {"out": out, "results": results}


class _NullCapsys:
    """capsys is function-scoped; the module fixture's output is simply not read."""

    def readouterr(self):
        class _Out:
            out = err = ""
        return _Out()


def test_interrupted_then_resumed_is_bit_identical(reference, tmp_path, capsys):
    out = tmp_path / "out"
    args = [*ARGS, "--out", str(out)]

    # 1. Ctrl-C in fp8_delayed right after its step 4 (before that step's checkpoint is
    # written): its last checkpoint is step 2.
    update = Progress.update

    def interrupt_at_4(self, step, loss, ms, note=""):
        update(self, step, loss, ms, note)
        if self.label == "fp8_delayed" and step == 4:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Progress, "update", interrupt_at_4)
        code, _, err, results, trained = run_cli(args, capsys)
    assert code == 130
    assert trained == ["bf16", "fp8_current", "fp8_delayed"]
    assert [r.name for r in results] == ["bf16", "fp8_current", "fp8_delayed"]
    assert "interrupted during fp8_delayed" in err
    assert "will go on after step 2" in err
    assert "run the same command with --resume" in err
    assert re.search(r"lowprec compare .*--out \S+ --resume$", err, re.M)
    partial = losses(out / "results.csv")
    assert [s for s, _ in partial["fp8_delayed"]] == [1, 2, 3, 4]  # what there was is written
    assert "--resume" in (out / "report.md").read_text()  # the status says how to go on

    # 2. --resume; this time Ctrl-C arrives inside nvfp4's step 5 (its 5th batch draw), after
    # the step-4 checkpoint: mid-step, so step 4 is where it goes on. nvfp4's stochastic
    # rounding draws from torch's global generator: the checkpoint must restore it.
    draws = {"n": 0}
    train_batch = Batches.train_batch
    train_one = cli.train_one

    def count_recipe(spec, *a, **kw):
        draws["n"], draws["recipe"] = 0, spec.name
        return train_one(spec, *a, **kw)

    def interrupt_in_5(self):
        draws["n"] += 1
        if draws.get("recipe") == "nvfp4" and draws["n"] == 5:
            raise KeyboardInterrupt
        return train_batch(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "train_one", count_recipe)
        mp.setattr(Batches, "train_batch", interrupt_in_5)
        code, _, err, results, trained = run_cli([*args, "--resume"], capsys)
    assert code == 130
    # bf16 and fp8_current finished: not trained again
    assert trained == ["fp8_delayed", "nvfp4"]
    assert ("bf16: finished; fp8_current: finished; fp8_delayed: from step 3/6;"
            " nvfp4: from the start") in err
    assert re.search(r"bf16\s+finished in an earlier run", err)
    assert re.search(r"fp8_current\s+finished in an earlier run", err)
    assert "resumed after step 2" in err
    assert "will go on after step 4" in err
    # The command shown to continue has --resume once.
    command = err.rstrip().splitlines()[-1].strip()
    assert command.startswith("lowprec compare ") and command.count("--resume") == 1

    # 3. --resume again, uninterrupted: the whole comparison equals the reference.
    code, _, err, results, trained = run_cli([*args, "--resume"], capsys)
    assert code == 0, err[-2000:]
    assert trained == ["nvfp4"]
    assert "resumed after step 4" in err
    assert losses(out / "results.csv") == losses(reference["out"] / "results.csv")
    assert [numbers(r) for r in results] == [numbers(r) for r in reference["results"]]
    assert all(r.status == "ok" for r in results)
    # 4. and once everything is finished, --resume trains nothing and reports the same.
    code, _, err, results, trained = run_cli([*args, "--resume"], capsys)
    assert code == 0 and trained == []
    assert [numbers(r) for r in results] == [numbers(r) for r in reference["results"]]


def test_checkpoint_contents(reference):
    """A finished recipe's file holds its result and the settings; a progress checkpoint
    the full training state (here: written by a 3-step run that saves at step 2)."""
    path = reference["out"] / resume.CHECKPOINT_DIR / "fp8_delayed.pt"
    data = torch.load(path, weights_only=True)
    assert data["kind"] == "finished" and data["step"] == 6 and "train" not in data
    assert data["settings"]["steps"] == 6 and data["settings"]["recipe"] == "fp8_delayed"
    assert data["settings"]["warmup"] == 3 and data["settings"]["grad_accum"] == 1
    assert resume.result_from_dict(data["result"]).val_loss == reference["results"][2].val_loss


def test_progress_checkpoint_holds_the_training_state(tmp_path, capsys):
    out = tmp_path / "out"
    update = Progress.update

    def interrupt_at_3(self, step, loss, ms, note=""):
        update(self, step, loss, ms, note)
        if step == 3:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Progress, "update", interrupt_at_3)
        code, _, err, _, _ = run_cli(["--model", "tiny", "--steps", "4", "--save-every", "2",
                                      "--recipes", "fp8_delayed", "--out", str(out)], capsys)
    assert code == 130, err
    data = torch.load(out / resume.CHECKPOINT_DIR / "fp8_delayed.pt", weights_only=True)
    assert data["kind"] == "progress" and data["step"] == 2
    train = data["train"]
    model = train["model"]
    assert all(v.dtype == torch.bfloat16 for k, v in model.items() if k.endswith("weight"))
    # delayed scaling's amax history is in the modules' extra state, already moved by 2 steps
    extra = [decode(v) for k, v in model.items() if k.endswith("_extra_state") and len(v)]
    assert extra and all(torch.count_nonzero(v["forward"]["amax_history"]) > 0 for v in extra)
    assert all(m.dtype == torch.float32 for m in train["master"])
    assert len(train["optimizer"]["state"]) == len(train["master"])
    assert train["batch_rng"].dtype == torch.uint8 and train["torch_rng"].dtype == torch.uint8
    assert [s["step"] for s in data["result"]["steps"]] == [1, 2]
    # the bf16 parameters are the fp32 masters rounded, in the model's parameter order
    from lowprec.compare.model import GPT, PRESETS

    names = [n for n, _ in GPT(PRESETS["tiny"], device="meta").named_parameters()]
    assert len(names) == len(train["master"])
    for name, m in zip(names, train["master"]):
        assert torch.equal(model[name], m.bfloat16()), name


@pytest.mark.parametrize("change,label,old,new", [
    (["--steps", "8"], "--steps", "6", "8"),
    (["--seed", "1"], "--seed", "0", "1"),
    (["--lr", "0.002"], "--lr", "0.001", "0.002"),
    (["--batch-size", "4"], "--batch-size", "2", "4"),
])
def test_resume_with_other_settings_is_refused(reference, tmp_path, capsys, change, label,
                                               old, new):
    out = tmp_path / "out"
    shutil.copytree(reference["out"], out)
    before = {p: os.path.getmtime(out / p) for p in ("results.csv", "report.md")}
    args = [*ARGS, "--out", str(out), "--resume", *change]
    code, _, err, _, trained = run_cli(args, capsys)
    assert code == 2 and trained == []
    assert re.search(r"error: --resume: the checkpoint \S+bf16\.pt of recipe 'bf16' was made "
                     r"with other settings", err), err
    assert re.search(rf"{re.escape(label)}\S*( \([^)]*\))?: checkpoint {old}, this command {new}",
                     err), err
    assert "run without --resume" in err
    assert {p: os.path.getmtime(out / p) for p in before} == before  # nothing rewritten


def test_without_resume_checkpoints_are_ignored_and_overwritten(reference, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(reference["out"], out)
    code, _, err, _, trained = run_cli(["--model", "tiny", "--steps", "2", "--recipes", "bf16",
                                        "--no-noise-floor",
                                        "--out", str(out)], capsys)
    assert code == 0, err
    assert trained == ["bf16"]
    data = torch.load(out / resume.CHECKPOINT_DIR / "bf16.pt", weights_only=True)
    assert data["settings"]["steps"] == 2 and data["kind"] == "finished"


def test_help_explains_resume(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--resume" in text and "--save-every N" in text
    assert "Without --resume, checkpoints in --out are ignored and overwritten" in text


def test_bad_save_every(tmp_path, capsys):
    code, _, err, _, _ = run_cli(["--model", "tiny", "--save-every", "-1", "--out",
                                  str(tmp_path)], capsys)
    assert code == 2 and "--save-every must be >= 0" in err


def test_outputs_are_written_atomically(tmp_path, capsys, monkeypatch):
    """A failure while results.csv (or report.md) is being written leaves the previous
    file whole and no temporary file behind."""
    out = tmp_path / "out"
    args = ["--model", "tiny", "--steps", "1", "--recipes", "bf16", "--save-every", "0",
            "--out", str(out)]
    code, _, err, _, _ = run_cli(args, capsys)
    assert code == 0, err
    good_csv, good_md = (out / "results.csv").read_text(), (out / "report.md").read_text()

    def broken_csv(path, results):
        with open(path, "w") as f:
            f.write("recipe,step,lo")
        raise OSError("disk full")

    monkeypatch.setattr(report, "write_csv", broken_csv)
    with pytest.raises(OSError, match="disk full"):
        cli.main(["compare", *args])
    assert (out / "results.csv").read_text() == good_csv
    assert not [n for n in os.listdir(out) if ".tmp" in n]

    def interrupted_md(path, *a, **kw):
        with open(path, "w") as f:
            f.write("# lowprec comp")
        raise KeyboardInterrupt

    monkeypatch.undo()
    monkeypatch.setattr(report, "write_markdown", interrupted_md)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["compare", *args])
    assert (out / "report.md").read_text() == good_md
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_atomic_path_keeps_the_extension_and_cleans_up(tmp_path):
    target = tmp_path / "loss.png"
    with resume.atomic_path(str(target)) as tmp:
        assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path)
        assert not os.path.exists(tmp)
    assert not target.exists()  # nothing written (a plot skipped): nothing moved
    with resume.atomic_path(str(target)) as tmp:
        with open(tmp, "w") as f:
            f.write("new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["loss.png"]
