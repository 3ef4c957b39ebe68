"""A Hugging Face Llama compiled decoder layer by decoder layer (the torchtitan order)
compiles the layer's code once: the layers' Linears differ in name only
(``tools/layer_recompiles.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from layer_recompiles import frames  # noqa: E402


@pytest.mark.parametrize("recipe", ["current", "nvfp4", "fp8_row_mxfp8_col"])
def test_decoder_layers_share_compiled_code(recipe):
    n, breaks, reasons = frames(recipe, layers=2)
    assert (n, breaks) == (1, 0), reasons
