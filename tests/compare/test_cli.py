"""``lowprec compare`` end to end (tiny preset, a few steps) and its error paths.

Expectations come from outside the code under test where it matters: the first-step loss of
a freshly initialised byte model is ln(256); a CustomRecipe over a mirror factory must give
losses bit-identical to the built-in recipe it mirrors (SPEC 4); SQNRs are recomputed here
from captured tensors and quantizers built here, with the formula written out in numpy.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import lowprec
from lowprec.compare import cli
from lowprec.compare.data import Batches, load_corpus
from lowprec.compare.probe import SQNRProbe, sqnr_db
from lowprec.compare.progress import Progress
from lowprec.compare.recipes import NAMED_RECIPES

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
TINY_TOKENS = 128  # tiny preset: seq 64 x batch 2
CSV_COLUMNS = ["recipe", "step", "loss", "tokens_per_s", "step_ms"]


def run_cli(args, capsys):
    code = cli.main(["compare", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def by_recipe(rows):
    out = {}
    for r in rows:
        out.setdefault(r[0], []).append(r)
    return out


def md_table(text, first_header):
    """Rows (as lists of cells) of the markdown table whose header starts with first_header."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


def write_file(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# ================================================================================================
# end to end
# ================================================================================================
@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    recipe_file = write_file(tmp, "mirror.py", """
        from lowprec.recipe.factories import mxfp8_factory as mirror
    """)
    out_dir = tmp / "out"
    args = ["compare", "--model", "tiny", "--steps", "3", "--device", "cpu", "--seed", "0",
            "--recipes", "bf16,fp8_current,fp8_block,mxfp8,nvfp4,mxfp8_fwd_nvfp4_bwd",
            "--recipe-file", f"{recipe_file}:mirror", "--out", str(out_dir)]
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(args)
    return {"code": code, "out": out_dir, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


RUNS = ["bf16", "bf16_reseeded", "fp8_current", "fp8_block", "mxfp8", "nvfp4",
        "mxfp8_fwd_nvfp4_bwd", "mirror"]


def test_e2e_exit_code_and_files(e2e):
    assert e2e["code"] == 0, e2e["stderr"][-2000:]
    names = sorted(os.listdir(e2e["out"]))
    expected = ["report.md", "results.csv"] + (["loss.png", "sqnr.png"] if HAVE_MPL else [])
    assert sorted(n for n in names if not n.startswith(".")) == sorted(expected)


def test_e2e_results_csv(e2e):
    header, rows = read_csv(e2e["out"] / "results.csv")
    assert header == CSV_COLUMNS
    runs = by_recipe(rows)
    assert list(runs) == RUNS
    for name, rs in runs.items():
        assert [int(r[1]) for r in rs] == [1, 2, 3], name
        for r in rs:
            loss, tok_s, ms = float(r[2]), float(r[3]), float(r[4])
            assert math.isfinite(loss) and 0 < loss < 10, (name, r)
            assert ms > 0 and tok_s > 0
            # tokens_per_s is tokens per step over that step's time (both rounded in the csv).
            assert tok_s * ms / 1e3 == pytest.approx(TINY_TOKENS, rel=1e-3)
    # Random init gives near-uniform logits: head weights N(0, 0.02) on a unit-variance
    # normalized input of width 128 give logits of std ~0.02*sqrt(128) = 0.23, which raises
    # the expected loss above ln(256) by about sigma^2/2 = 0.03; batch-to-batch spread adds a
    # few 1e-2 more (0.07 seen on Python 3.12's corpus). A wrong target shift or vocabulary
    # size moves it by 0.5 or more.
    for name, rs in runs.items():
        assert abs(float(rs[0][2]) - math.log(256)) < 0.12, name
    # The noise-floor twin starts from other weights (same batches).
    assert runs["bf16"][0][2] != runs["bf16_reseeded"][0][2]
    # SPEC 4: a CustomRecipe over the mirror factory is bit-identical to MXFP8BlockScaling.
    assert [r[2] for r in runs["mirror"]] == [r[2] for r in runs["mxfp8"]]
    # ...while different formats really give different numbers.
    assert [r[2] for r in runs["nvfp4"]] != [r[2] for r in runs["mxfp8"]]


def test_e2e_first_step_loss_matches_a_fresh_model(e2e):
    # Rebuild the bf16 run's first step by hand: same seed, same first batch.
    from lowprec.compare.model import GPT, PRESETS

    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = GPT(cfg, dtype=torch.bfloat16)
    x, y = Batches(load_corpus(), cfg.seq_len, cfg.batch_size, 0, torch.device("cpu")).train_batch()
    loss = torch.nn.functional.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1))
    _, rows = read_csv(e2e["out"] / "results.csv")
    assert float(by_recipe(rows)["bf16"][0][2]) == float(loss.detach())


def test_e2e_report_table(e2e):
    text = (e2e["out"] / "report.md").read_text()
    header, rows = md_table(text, "recipe")
    assert header[:4] == ["recipe", "status", "held-out loss", "delta vs bf16"]
    for col in ("tokens/s", "speedup vs bf16", "peak mem"):
        assert col in header
    table = {r[0]: dict(zip(header, r)) for r in rows}
    assert list(table) == RUNS
    assert table["bf16"]["speedup vs bf16"] == "1.00x"
    for name, row in table.items():
        assert row["status"] == "ok"
        assert 0 < float(row["held-out loss"]) < 10
        assert float(row["tokens/s"].replace(",", "")) > 0
        assert row["peak mem"] == "n/a"  # CPU run
        if name != "bf16":
            # delta = held-out loss - bf16's, as printed (4 decimals each)
            delta = float(row["delta vs bf16"].split()[0])
            assert delta == pytest.approx(float(row["held-out loss"]) -
                                          float(table["bf16"]["held-out loss"]), abs=2e-4)
    assert "![loss curves](loss.png)" in text if HAVE_MPL else "loss.png skipped" in text
    # The same table on the terminal.
    assert re.search(r"recipe\s+status\s+held-out loss\s+delta vs bf16", e2e["stdout"])
    for name in RUNS:
        assert re.search(rf"^{re.escape(name)}\s+ok\s", e2e["stdout"], re.M), name


def _sqnr_cells(text):
    header, rows = md_table(text, "layer")
    out = {}
    for row in rows:
        for col, cell in zip(header[2:], row[2:]):
            recipe = col.split(" ")[0]
            rw, cw = (c.strip() for c in cell.split("/"))
            out[(recipe, row[0], row[1])] = (float(rw) if rw not in "-" else None,
                                             float(cw) if cw not in "-" else None)
    return out


def test_e2e_sqnr_table(e2e):
    cells = _sqnr_cells((e2e["out"] / "report.md").read_text())
    layers = {k[1] for k in cells}
    # tiny: 2 blocks x (qkv, proj, mlp.fc1, mlp.fc2) + lm_head = 9 GEMMs, 3 roles each.
    assert len(layers) == 9 and "lm_head" in layers and "blocks.1.mlp.fc2" in layers
    quantized = {k[0] for k in cells}
    assert quantized == set(RUNS) - {"bf16", "bf16_reseeded"}
    for (recipe, layer, role), (rw, cw) in cells.items():
        assert rw is not None and cw is not None, (recipe, layer, role)  # default mode: both
    mean = lambda recipe, role, i: np.mean([v[i] for k, v in cells.items()
                                            if k[0] == recipe and k[2] == role])
    # Per-format expectations for trained-network tensors (SQNR of a format is set by its
    # mantissa bits, ~6 dB each, plus scaling): E4M3 (3 bits) ~25-35 dB; E5M2 gradients (2
    # bits) about 6 dB lower; NVFP4's E2M1 (1 bit) 15-24 dB; MXFP8 close to per-tensor E4M3.
    for role in ("input", "weight"):
        for recipe in ("fp8_current", "fp8_block", "mxfp8"):
            for direction in (0, 1):
                assert 25 < mean(recipe, role, direction) < 36, (recipe, role, direction)
        assert 15 < mean("nvfp4", role, 0) < 24
    assert 25 < mean("fp8_block", "grad_output", 0) < 36  # E4M3 gradients in 1x128 blocks
    assert 3 < mean("fp8_current", "input", 0) - mean("fp8_current", "grad_output", 0) < 9
    assert 15 < mean("nvfp4", "grad_output", 0) < 24
    # The hybrid: MXFP8 rowwise (fprop) and NVFP4 columnwise, so the two directions differ by
    # the 3-bit vs 1-bit mantissa gap.
    assert mean("mxfp8_fwd_nvfp4_bwd", "weight", 0) - mean("mxfp8_fwd_nvfp4_bwd", "weight", 1) > 8
    # Mirror factory == built-in recipe: identical tensors, identical SQNRs.
    for (recipe, layer, role), v in cells.items():
        if recipe == "mirror":
            assert v == cells[("mxfp8", layer, role)]
    # Measured, not constant: the values vary across layers.
    assert len({v[0] for k, v in cells.items() if k[0] == "nvfp4"}) > 5


def test_e2e_progress_on_stderr(e2e):
    for name in RUNS:
        assert re.search(rf"{re.escape(name)}\s+\[#+-*\]\s+\d+/3", e2e["stderr"]), name
        assert re.search(rf"{re.escape(name)}\s+done in", e2e["stderr"]), name


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed (pip install lowprec[compare])")
def test_e2e_loss_png(e2e):
    data = (e2e["out"] / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ================================================================================================
# SQNR probe against an independent computation
# ================================================================================================
def _np_sqnr(x, d):
    x, d = np.asarray(x, dtype=np.float64), np.asarray(d, dtype=np.float64)
    return 10.0 * np.log10(np.sum(x * x) / np.sum((x - d) ** 2))


@pytest.mark.parametrize("recipe,make_q", [
    (lowprec.MXFP8BlockScaling(), lambda role: lowprec.MXFP8Quantizer()),
    (lowprec.Float8CurrentScaling(), lambda role: lowprec.Float8CurrentScalingQuantizer(
        torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn)),
    (lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True),
     lambda role: lowprec.NVFP4Quantizer(with_2d_quantization=role == "weight",
                                         with_rht=role != "weight")),
])
def test_probe_sqnr_equals_recomputation(recipe, make_q):
    torch.manual_seed(0)
    layer = lowprec.Linear(128, 256, name="fc", params_dtype=torch.bfloat16)
    x = (torch.randn(128, 128) * torch.linspace(0.1, 4, 128)).bfloat16().requires_grad_(True)
    grad = torch.randn(128, 256).bfloat16()
    probe = SQNRProbe(layer)
    probe.arm(recipe, x.device)
    with lowprec.autocast(recipe=recipe):
        y = layer(x)
    y.backward(grad)
    probe.disarm()
    recs = {r.role: r for r in probe.results()}
    assert set(recs) == {"input", "weight", "grad_output"}
    for role, t in (("input", x), ("weight", layer.weight), ("grad_output", grad)):
        q = make_q(role)
        qt = q.quantize(t.detach())
        for usage, got in (("rowwise", recs[role].rowwise_db),
                           ("columnwise", recs[role].columnwise_db)):
            d = qt.dequantize(dtype=torch.float32, usage=usage)
            want = _np_sqnr(t.detach().float().numpy(), d.numpy())
            assert got == pytest.approx(want, abs=1e-9), (role, usage)  # same tensors, float64
    # The probe leaves the quantizers as they were: they pickle again.
    import pickle
    pickle.dumps(layer._recipe_states["forward"].quantizers)


def test_sqnr_db_formula():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, torch.tensor([3.0, 3.0])) == pytest.approx(10 * math.log10(25 / 1))
    assert sqnr_db(x, x) == math.inf


# ================================================================================================
# errors
# ================================================================================================
def _no_training(err, out_dir):
    assert "[#" not in err and "done in" not in err
    assert not os.path.exists(os.path.join(out_dir, "results.csv"))


def test_unknown_recipe_lists_the_valid_ones(tmp_path, capsys):
    code, _, err = run_cli(["--model", "tiny", "--steps", "1", "--recipes", "bf16,fp9,mxfp8",
                            "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "'fp9'" in err
    for name in NAMED_RECIPES:
        assert name in err
    _no_training(err, tmp_path)


@pytest.mark.parametrize("body,attr,pattern", [
    (None, "f", r"no such file"),
    ("def f(role:\n", "f", r"loading .* failed: SyntaxError"),
    ("import lowprec\ndef g(role):\n    return lowprec.MXFP8Quantizer()\n", "f",
     r"defines no 'f' \(callables there: g\)"),
    ("import lowprec\nq = lowprec.MXFP8Quantizer()\n", "q", r"'q' is a MXFP8Quantizer; it must be"),
    ("import lowprec\n"
     "def f(role):\n"
     "    if role is not None and role.tensor_type == 'weight':\n"
     "        return 42\n"
     "    return lowprec.MXFP8Quantizer()\n", "f",
     r"returned int 42 for role QuantizerRole\(module_type='linear', tensor_type='weight', "
     r"name='blocks\.0\.qkv'\)"),
    ("import lowprec\n"
     "def f(role):\n"
     "    if role is not None and role.tensor_type == 'grad_output':\n"
     "        raise KeyError('no gradients here')\n"
     "    return lowprec.MXFP8Quantizer()\n", "f",
     r"raised KeyError for role QuantizerRole\(module_type='linear', tensor_type='grad_output'"),
    ("def f(role):\n    return None\n", "f", r"returned None for role .*IdentityQuantizer"),
    ("import lowprec\n"
     "def f(role):\n"
     "    return lowprec.Float8BlockQuantizer(block_scaling_dim=2) if role"
     " else lowprec.IdentityQuantizer()\n",
     "f", None),  # 128x128 blocks fit every tiny-preset tensor: accepted
])
def test_recipe_file_errors_name_what_failed(tmp_path, capsys, body, attr, pattern):
    path = str(tmp_path / "r.py") if body is None else write_file(tmp_path, "r.py", body)
    out_dir = tmp_path / "out"
    steps = "1"
    code, _, err = run_cli(["--model", "tiny", "--steps", steps, "--recipes", "fp8_current",
                            "--no-noise-floor", "--recipe-file", f"{path}:{attr}",
                            "--out", str(out_dir)], capsys)
    if pattern is None:
        assert code == 0, err
        return
    assert code == 2
    assert re.search(pattern, err), err
    _no_training(err, out_dir)


def test_recipe_file_rejects_a_block_that_does_not_divide(tmp_path, capsys):
    # A user quantizer with 256-wide blocks cannot quantize the 128-wide activations: the
    # check runs before training and names the role and shape.
    path = write_file(tmp_path, "r.py", """
        import lowprec
        from lowprec.formats.base import check_divisible

        class Wide(lowprec.MXFP8Quantizer):
            def _check_shape(self, shape, m, k):
                check_divisible(shape, m, k, row_block=256, col_block=1, what="Wide")

        def f(role):
            return Wide()
    """)
    code, _, err = run_cli(["--model", "tiny", "--steps", "1", "--recipes", "bf16",
                            "--recipe-file", f"{path}:f", "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert re.search(r"role QuantizerRole\(.*tensor_type='input', name='blocks\.0\.qkv'\) cannot "
                     r"quantize its 128x128 tensor", err), err


def test_unwritable_out_dir_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    code, _, err = run_cli(["--model", "tiny", "--steps", "1", "--out", str(blocker)], capsys)
    assert code == 2 and "exists and is not a directory" in err
    _no_training(err, blocker)
    code, _, err = run_cli(["--model", "tiny", "--steps", "1", "--out", str(blocker / "sub")],
                           capsys)
    assert code == 2 and "cannot write to the output directory" in err
    assert "[#" not in err


def test_bad_options(tmp_path, capsys):
    code, _, err = run_cli(["--model", "tiny", "--backward-mode", "sideways",
                            "--out", str(tmp_path)], capsys)
    assert code == 2 and "sideways" in err and "high_precision" in err
    code, _, err = run_cli(["--model", "tiny", "--backward-mode", "high_precision",
                            "--recipes", "fp8_delayed", "--out", str(tmp_path)], capsys)
    assert code == 2 and "fp8_delayed" in err and "DelayedScaling" in err
    code, _, err = run_cli(["--model", "tiny", "--steps", "0", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--steps" in err
    code, _, err = run_cli(["--model", "enormous", "--out", str(tmp_path)], capsys)
    assert code == 2 and "enormous" in err and "not a preset" in err
    code, _, err = run_cli(["--model", "tiny", "--device", "cpu", "--cuda-graphs",
                            "--out", str(tmp_path)], capsys)
    assert code == 2 and "--cuda-graphs" in err and "cpu" in err
    code, _, err = run_cli(["--model", "tiny", "--device", "cpu", "--no-compile",
                            "--cpp-wrapper", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--cpp-wrapper" in err and "compile off" in err


def test_nan_loss_stops_that_run_and_the_others_continue(tmp_path, capsys):
    path = write_file(tmp_path, "nan.py", """
        import lowprec

        class PoisonQuantizer(lowprec.IdentityQuantizer):
            # Keeps the tensor in high precision, but multiplied by NaN.
            def _quantize_2d(self, x2d):
                return super()._quantize_2d(x2d * float("nan"))

        def poison(role):
            return PoisonQuantizer()
    """)
    out_dir = tmp_path / "out"
    code, stdout, err = run_cli(["--model", "tiny", "--steps", "2", "--no-noise-floor",
                                 "--recipes", "bf16,mxfp8", "--recipe-file", f"{path}:poison",
                                 "--out", str(out_dir)], capsys)
    assert code == 0, err
    _, rows = read_csv(out_dir / "results.csv")
    runs = by_recipe(rows)
    assert [len(runs[n]) for n in ("bf16", "mxfp8", "poison")] == [2, 2, 1]
    assert math.isnan(float(runs["poison"][0][2]))
    header, table = md_table((out_dir / "report.md").read_text(), "recipe")
    status = {r[0]: r[1] for r in table}
    assert status == {"bf16": "ok", "mxfp8": "ok", "poison": "NaN (step 1)"}
    assert "poison: loss became nan at step 1; run stopped" in (out_dir / "report.md").read_text()
    assert re.search(r"^poison\s+NaN \(step 1\)", stdout, re.M)
    assert "NaN: stopped" in err


def test_backward_mode_dequantized_quantizes_no_gradient(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, _, err = run_cli(["--model", "tiny", "--steps", "2", "--recipes", "mxfp8",
                            "--backward-mode", "dequant", "--out", str(out_dir)], capsys)
    assert code == 0, err
    text = (out_dir / "report.md").read_text()
    assert "backward mode: dequantized" in text
    cells = _sqnr_cells(text)
    assert all(role != "grad_output" for (_, _, role) in cells)  # backward ran unquantized
    # dequantized mode saves only what fprop used: rowwise only.
    assert all(v[1] is None and v[0] is not None for v in cells.values())
    header, rows = md_table(text, "recipe")
    assert rows[0][header.index("delta vs bf16")] == "n/a"  # no bf16 run to compare with


# ================================================================================================
# pieces
# ================================================================================================
def test_python_dash_m_entry_point():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-m", "lowprec", "compare", "--list-recipes"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert all(name in res.stdout for name in NAMED_RECIPES)


def test_progress_bar():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = Progress("mxfp8", 4, stream=tty)
    for i in range(1, 5):
        bar.update(i, 3.0 - i * 0.1, 12.5)
    bar.close()
    assert "\r" in tty.getvalue() and "[########################]     4/4" in tty.getvalue()
    log = io.StringIO()
    bar = Progress("nvfp4", 100, stream=log)
    for i in range(1, 101):
        bar.update(i, 2.0, 1.0)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and 10 <= len(lines) <= 12  # a line per tenth


def test_corpus_is_deterministic_bytes():
    a, b = load_corpus(max_bytes=1 << 18), load_corpus(max_bytes=1 << 18)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.n_bytes == 1 << 18 and a.train.dtype == torch.uint8
    blob = bytes(a.train[:200].tolist())
    assert b"import" in bytes(a.train[:20000].tolist()) and blob.decode("utf-8", "ignore")
    g1 = Batches(a, 64, 2, 7, torch.device("cpu"))
    g2 = Batches(a, 64, 2, 7, torch.device("cpu"))
    x1, y1 = g1.train_batch()
    x2, y2 = g2.train_batch()
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])


def test_plot_is_skipped_with_a_reason_without_matplotlib(monkeypatch, tmp_path):
    from lowprec.compare import report
    from lowprec.compare.train import RunResult, StepRecord

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises
    r = RunResult("bf16", "", steps=[StepRecord(1, 5.0, 100.0, 1.0)])
    note = report.plot(str(tmp_path / "loss.png"), [r])
    assert "matplotlib is not importable" in note and "lowprec[compare]" in note
    assert not (tmp_path / "loss.png").exists()


def test_compile_gives_every_recipe_its_own_compile(tmp_path, capsys, monkeypatch):
    """Each recipe's model compiles anew. Dynamo counts every model of one process against
    one recompile limit (8 by default, 1 here): without a fresh cache per recipe, the
    recipes past it would train eagerly while the report says compiled."""
    from torch._dynamo.testing import CompileCounter
    counters = []
    real = torch.compile

    def counting(model, mode=None, **kw):  # dynamo's capture, run eagerly (no inductor)
        counters.append(CompileCounter())
        return real(model, backend=counters[-1])

    monkeypatch.setattr(torch, "compile", counting)
    with torch._dynamo.config.patch(recompile_limit=1):
        code, _, err = run_cli(["--model", "tiny", "--steps", "2", "--recipes",
                                "bf16,fp8_current", "--no-noise-floor", "--compile",
                                "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert len(counters) == 2
    assert [c.frame_count > 0 for c in counters] == [True, True]


def test_cpp_wrapper_is_inductor_config_through_forward_and_backward(tmp_path, capsys,
                                                                    monkeypatch):
    """--cpp-wrapper: inductor's ``cpp_wrapper`` is on when the forward graph compiles and
    when the backward graph compiles (lazily, at the first backward(), where a
    torch.compile option would no longer be in force), and off again after the run."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import config
    seen = []
    real = torch.compile

    def recording(which):
        def compiler(gm, example_inputs):
            seen.append((which, config.cpp_wrapper))
            return make_boxed_func(gm.forward)
        return compiler

    def compile_recording(model, mode=None, **kw):  # AOT autograd's two graphs, run eagerly
        return real(model, backend=aot_autograd(fw_compiler=recording("forward"),
                                                bw_compiler=recording("backward")))

    monkeypatch.setattr(torch, "compile", compile_recording)
    code, _, err = run_cli(["--model", "tiny", "--steps", "2", "--recipes", "fp8_current",
                            "--no-noise-floor", "--compile", "--cpp-wrapper",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert {w for w, _ in seen} == {"forward", "backward"}
    assert all(on for _, on in seen), seen
    assert not config.cpp_wrapper
    assert "C++ wrapper" in (tmp_path / "report.md").read_text()


def test_compile_runs_every_recipe_compiled_and_says_so(tmp_path, capsys):
    """--compile trains through torch.compile; the losses follow the eager run's (inductor
    may round the model's elementwise math differently, so not bit for bit). One recipe
    (inductor's C++ kernels of each model take tens of seconds to build on an empty cache;
    test_compile_gives_every_recipe_its_own_compile compiles several)."""
    try:
        torch.compile(lambda t: (t * 2).sin(), fullgraph=True)(torch.randn(4))
    except Exception as exc:  # noqa: BLE001 - no C++ toolchain for inductor here
        pytest.skip(f"inductor cannot build CPU code here: {type(exc).__name__}")
    losses = {}
    for flag in ("--compile", "--no-compile"):
        out = tmp_path / flag.strip("-")
        code, _, err = run_cli(["--model", "tiny", "--steps", "3", "--recipes",
                                "fp8_current", "--no-noise-floor", "--out", str(out),
                                flag], capsys)
        assert code == 0, err
        assert ("compiled" in err) == (flag == "--compile")
        report = (out / "report.md").read_text()
        assert ("ran under torch.compile" in report) == (flag == "--compile")
        _, rows = read_csv(out / "results.csv")
        losses[flag] = {r: [float(s[2]) for s in v] for r, v in by_recipe(rows).items()}
    for recipe, eager in losses["--no-compile"].items():
        assert losses["--compile"][recipe] == pytest.approx(eager, rel=2e-2), recipe
