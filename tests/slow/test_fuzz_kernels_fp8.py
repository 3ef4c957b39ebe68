"""Slow GPU fuzzing of the FP8 / block-FP8 / MXFP8 quantize kernels against the reference,
bit for bit (CUDA + Triton; minutes; not collected unless asked for):

    python -m pytest -m slow tests/slow/test_fuzz_kernels_fp8.py     # or: pytest --slow ...

* every group of format settings (``fuzz_fp8.quantizer_groups``) over dtypes, odd, 3-D,
  transposed and sliced shapes, and value distributions (NaN/Inf/zero blocks, saturation,
  rounding ties, subnormals), each usage: kernel path against ``reference_only()`` (and the
  CPU reference for small cases);
* both usages as one launch and as split launches;
* ``torch.compile(fullgraph=True)`` of the launchers and of ``quantize`` against eager;
* the shared element rules on every bit pattern: the fp8 cast on all 2**32 fp32 values,
  the current-scaling scale and the MXFP8 E8M0 exponent on all 2**31 non-negative amaxes.

``tests/formats/test_kernels_fp8.py`` is the quick subset that runs with the GPU suite.
"""

import fuzz_fp8
import pytest
from exhaustive_fp8 import run_exhaustive
from helpers import GPU_ONLY

from lowprec.kernels import tuning

pytestmark = [
    pytest.mark.slow,
    *GPU_ONLY,
]


@pytest.mark.parametrize("group", sorted(fuzz_fp8.quantizer_groups()))
def test_kernels_match_reference(group):
    res = fuzz_fp8.run_group(group, quick=False)
    assert res["cases"] > 0
    assert not res["truncated_by_deadline"], "CHECK_DEADLINE cut the run short"
    assert res["failures"] == 0, "\n".join(res["first_failures"])


@pytest.fixture
def launch_flags():
    """Restores the transposed-store mode and split flags (``tuning.col_mode``,
    ``tuning.split_both``) after the test: ``run_diag`` changes them, in place."""
    with tuning.override(col_mode=tuning.tuning.col_mode,
                         split_both=dict(tuning.tuning.split_both)):
        yield


@pytest.mark.parametrize("mode", ["configured", "split"])
def test_both_usages_fused_and_split(mode, launch_flags):
    res = fuzz_fp8.run_diag(str(tuning.tuning.col_mode) if mode == "configured" else "split")
    assert res["cases"] > 0
    assert res["bad"] == 0, "\n".join(res["details"])


def test_compiled_launchers_match_eager():
    res = fuzz_fp8.run_compile()
    bad = {k: v for k, v in res.items() if v != "ok"}
    assert not bad, bad


def test_element_rules_exhaustive():
    res = run_exhaustive(quick=False)
    bad = {key: v for key, v in res.items()
           if any(n for name, n in v.items() if name != "checked")}
    assert not bad, bad
