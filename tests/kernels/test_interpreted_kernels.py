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


@pytest.mark.parametrize("check", ["grouped_gemm_tiles", "moe_route",
                                   "group_amax_and_expert_cast", "nvfp4_expert_codes"])
def test_kernel_logic_in_the_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    code = f"import interpreted_checks as c; c.CHECKS[{check!r}]()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
