"""The generated conformance suite: every quantizer kind in every role and direction,
every backward mode and module, eager against compiled against the oracle.

The cases are :func:`space.all_pairs` (seed 0): every pair of values of every two factors
occurs in some case. On the CPU the named recipes (each kind alone) and
:func:`space.every_value`'s few cases (every kind in every role and direction it reaches
a GEMM from, every module, backward mode and autocast placement) run under CUDA's route
decisions (``lowprec.gemm.cuda_routes``), and the named recipes on the CPU's own routes;
every case runs both ways with ``--slow``. On a CUDA machine every case also runs on the
GPU under inductor (``LOWPREC_CONFORMANCE_DEVICES=cpu`` turns that off).
``tests/conformance/run_matrix.py`` runs more seeds and writes the results as CSV.
"""

from __future__ import annotations

import os

import pytest
import torch

from .harness import check
from .space import all_pairs, every_value, plain_recipes

_DRAW = all_pairs(seed=0)
CASES = plain_recipes() + _DRAW
#: The CPU's own routes: every case under ``--slow`` (CI runs the named recipes there)
CPU_CASES = plain_recipes() + [pytest.param(c, marks=pytest.mark.slow) for c in _DRAW]
#: CUDA's route decisions on the CPU: the named recipes (the routes of one format's
#: operand pairs) and a case for every factor value in the quick run (each case is a
#: compile: the 160 of the draw take minutes on 2 cores), the whole draw under ``--slow``
_QUICK = set(every_value(_DRAW))
CUDA_ROUTE_CASES = plain_recipes() + [
    pytest.param(c, marks=() if c in _QUICK else pytest.mark.slow) for c in _DRAW]
ON_CUDA = torch.cuda.is_available() and os.environ.get("LOWPREC_CONFORMANCE_DEVICES") != "cpu"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _assert_conforms(got):
    """No failure: eager runs, the compiled step has no graph break and no opaque call,
    its bits are eager's, and eager meets the oracle."""
    assert not got.failures, "\n".join(got.failures)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_case_conforms_on_cpu_routes(case):
    _assert_conforms(check(case, "cpu"))


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_conforms_on_cuda(case):
    """The case on the GPU under inductor."""
    _assert_conforms(check(case, "cuda"))


@pytest.mark.parametrize("case", CUDA_ROUTE_CASES, ids=lambda c: c.id)
def test_case_conforms_on_cuda_routes(case):
    """The same case on the CPU with every GEMM taking CUDA's route
    (``lowprec.gemm.cuda_routes``): CUDA's route decisions, eager and traced, agree."""
    _assert_conforms(check(case, "cpu", cuda_routes=True))
