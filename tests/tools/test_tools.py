"""``tools/`` holds only maintained scripts: each is listed in ``tools/README.md`` and answers
``--help`` (it imports and builds its command line on any machine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCRIPTS = sorted(p.name for p in TOOLS.glob("*.py"))


def test_readme_lists_exactly_the_scripts():
    listed = set(re.findall(r"^\| `([a-z_0-9]+\.py)` \|", (TOOLS / "README.md").read_text(),
                            re.MULTILINE))
    assert listed == set(SCRIPTS)
    assert len(SCRIPTS) <= 8


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    done = subprocess.run([sys.executable, str(TOOLS / script), "--help"], cwd=TOOLS.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
