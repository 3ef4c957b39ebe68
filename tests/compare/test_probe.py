"""SQNRProbe records every quantization a step makes, whichever quantizer entry point ran it."""

import pytest
import torch

import lowprec
from lowprec.compare.probe import SQNRProbe
from lowprec.formats.base import Quantizer


def _step_records(recipe):
    torch.manual_seed(0)
    layer = lowprec.Linear(64, 32, params_dtype=torch.bfloat16, name="fc")
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    probe = SQNRProbe(layer)
    probe.arm(recipe, x.device)
    try:
        with lowprec.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
    finally:
        probe.disarm()
    return {r.role: r for r in probe.results()}


def test_records_input_weight_and_grad_output():
    records = _step_records(lowprec.MXFP8BlockScaling())
    assert set(records) == {"input", "weight", "grad_output"}
    for r in records.values():
        assert r.rowwise_db is not None and r.columnwise_db is not None
        assert 25.0 < r.rowwise_db < 40.0 and 25.0 < r.columnwise_db < 40.0


def test_records_operands_quantized_without_codes(monkeypatch):
    """Where the format's kernels run, an operand only a GEMM reads (dY) is quantized by
    ``_quantize_exact`` and never reaches ``quantize``: the probe sees it there too."""
    def exact_only(self, x):  # the class's own quantize, not the probe's wrapper
        return type(self).quantize(self, x)

    monkeypatch.setattr(Quantizer, "keeps_exact_bf16", True, raising=False)
    monkeypatch.setattr(Quantizer, "_quantize_exact", exact_only)
    records = _step_records(lowprec.MXFP8BlockScaling())
    assert records["grad_output"].rowwise_db is not None
    assert 25.0 < records["grad_output"].rowwise_db < 40.0


def test_disarm_restores_the_quantizers():
    recipe = lowprec.MXFP8BlockScaling()
    layer = lowprec.Linear(64, 32, params_dtype=torch.bfloat16, name="fc")
    probe = SQNRProbe(layer)
    probe.arm(recipe, torch.device("cpu"))
    wrapped = list(probe._wrapped)
    assert wrapped and all("_quantize_exact" in q.__dict__ for q in wrapped)
    probe.disarm()
    assert all("quantize" not in q.__dict__ and "_quantize_exact" not in q.__dict__
               for q in wrapped)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
