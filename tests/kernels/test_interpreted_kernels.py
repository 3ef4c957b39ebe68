"""Triton kernels of the MoE path run by Triton's interpreter on the CPU, so their tile and
index logic is checked where no GPU is (``interpreted_checks.py``; a subprocess, since the
interpreter must be switched on before the kernels are defined). The GPU tests check the
compiled kernels' bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: every check in one interpreter process (each would start torch and lowprec again);
#: a failing check does not stop the others, and each prints its outcome
_RUN_ALL = """
import traceback
import interpreted_checks as c
failed = []
for name, check in c.CHECKS.items():
    try:
        check()
        print("ok", name)
    except BaseException:
        failed.append(name)
        print("FAILED", name)
        traceback.print_exc()
raise SystemExit(1 if failed else 0)
"""


def test_kernel_logic_in_the_interpreter():
    """Each check of ``interpreted_checks.CHECKS`` (grouped GEMM tiles, the MoE routing
    kernels, the group amax and expert cast, NVFP4 expert codes) passes in the
    interpreter; a failure names the checks that failed, with their tracebacks."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    run = subprocess.run([sys.executable, "-c", _RUN_ALL], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
