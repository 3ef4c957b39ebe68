"""A compiled module's backward is traced by dynamo once: no backward asks a tensor's
strides while dynamo traces it (``tools/backward_speculation.py`` says why it matters: a
second trace, and a failed compile under ``torch.autocast``). Without a
GPU the tool traces the GPU code path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the GPU code path's kernels are Triton's

TOOL = Path(__file__).resolve().parents[2] / "tools" / "backward_speculation.py"


@pytest.mark.parametrize("modules,recipes", [
    ("linear", "fp8_block,nvfp4,fp8_current"),   # block's dequantize, cuBLASLt's GEMM
    ("layernorm_mlp", "fp8_block,nvfp4"),
])
def test_backward_traced_once(modules, recipes):
    done = subprocess.run([sys.executable, str(TOOL), "--modules", modules, "--recipes",
                           recipes, "--amp", "only"], capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ": traced again" in ln]
    assert len(lines) == len(recipes.split(",")), done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, done.stdout
