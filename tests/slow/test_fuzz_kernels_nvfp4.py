"""Slow GPU check of the NVFP4 Triton kernels against the reference, bit for bit (CUDA +
Triton; minutes; not collected unless asked for):

    python -m pytest -m slow tests/slow/test_fuzz_kernels_nvfp4.py   # or: pytest --slow ...

The cases (``fuzz_nvfp4.build_cases``: dtypes, 1x16 and 16x16 blocks, RHT, stochastic
rounding, one usage alone, odd M or K, 3-D and non-contiguous inputs, special values, every
tile config) run in groups that share kernel variants; each case compares every inner
tensor byte for byte and checks the bf16 dequantization. Then ``torch.compile`` through the
custom op and ``torch.library.opcheck``. ``tests/formats/test_kernels_nvfp4.py`` is the
quick subset that runs with the GPU suite.
"""

import copy

import fuzz_nvfp4
import pytest
from helpers import GPU_ONLY

pytestmark = [
    pytest.mark.slow,
    *GPU_ONLY,
]


def _groups():
    groups = {}
    for case in fuzz_nvfp4.build_cases(quick=False):
        groups.setdefault(fuzz_nvfp4.variant_key(case), []).append(case)
    return groups


GROUPS = _groups()


def _group_id(key):
    dtype, row, col, rht, two_d, sr, config, layout = key
    usage = "both" if row and col else ("row" if row else "col")
    flags = [f for f, on in (("rht", rht), ("2d", two_d), ("sr", sr)) if on]
    extra = []
    if config:
        kind, value = config
        extra = [kind + ("x".join(map(str, value)) if isinstance(value, tuple) else str(value))]
    return "-".join([dtype, usage, *flags, *extra, *([layout] if layout else [])])


@pytest.fixture
def nvfp4_config():
    """Restores the NVFP4 tile configs (``tuning.nvfp4_config``) after the test (cases may
    change them, in place)."""
    from lowprec.kernels import tuning
    with tuning.override(nvfp4_config=copy.deepcopy(tuning.tuning.nvfp4_config)):
        yield


@pytest.mark.parametrize("key", list(GROUPS), ids=[_group_id(k) for k in GROUPS])
def test_kernels_match_reference(key, nvfp4_config):
    results = fuzz_nvfp4.run_group(GROUPS[key])
    bad = [r for r in results if not (r["exact"] and r["dequant_ok"])]
    assert not bad, "\n".join(
        f"{r['shape']} {r['dist']} config={r.get('config')}: {r['detail'][:600]}" for r in bad)


def test_compile_and_opcheck():
    out = {}
    msgs = fuzz_nvfp4.compile_checks(out)
    assert out["compile_ok"] and out["opcheck_ok"], msgs
