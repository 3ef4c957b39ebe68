"""End to end: a run with a planted loss spike is flagged in the report, and its delta and
verdict say so instead of reading as a measured difference."""

from __future__ import annotations

import re
import textwrap

from lowprec.compare import cli

#: The recipe multiplies every GEMM input of one training step by 30 (from its calls: the
#: tiny preset runs 9 GEMMs a forward), so that step's loss jumps and training recovers.
SPIKE_FILE = """
import lowprec

GEMMS, STEP = 9, {step}
calls = [0]

class SpikeQuantizer(lowprec.IdentityQuantizer):
    def _quantize_2d(self, x2d):
        calls[0] += 1
        if GEMMS * (STEP - 1) < calls[0] <= GEMMS * STEP:
            x2d = x2d * 30.0
        return super()._quantize_2d(x2d)

def spike(role):
    if role is not None and role.tensor_type == "input":
        return SpikeQuantizer()
    return lowprec.IdentityQuantizer()
"""


def test_planted_spike_is_flagged(tmp_path, capsys):
    path = tmp_path / "spike.py"
    path.write_text(textwrap.dedent(SPIKE_FILE.format(step=14)))
    out = tmp_path / "out"
    code = cli.main(["compare", "--model", "tiny", "--steps", "24", "--recipes", "bf16",
                     "--recipe-file", f"{path}:spike", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    text = (out / "report.md").read_text()
    assert "spike: loss spike at step 14" in text, text
    assert "- `spike`: unstable (spike at step 14): no comparison" in text
    row = next(line for line in text.splitlines() if line.startswith("| spike |"))
    assert "| unstable | spike at 14 |" in row
    # no "number ± number" delta for the spiking run anywhere, report or terminal
    for line in text.splitlines() + stdout.splitlines():
        if re.match(r"^[|*\- `]*spike\b", line):
            assert not re.search(r"\d ± \d", line), line
    # the baseline and its reseeded twin trained stably: their deltas are numbers
    assert re.search(r"^\| bf16_reseeded \| ok \| [\d.]+ \| -?[\d.]+ ± [\d.]+ \| ok \|", text,
                     re.M), text
