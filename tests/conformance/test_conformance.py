"""The generated conformance suite: every quantizer kind in every role and direction,
every backward mode and module, eager against compiled against the oracle.

The cases are :func:`space.all_pairs` (seed 0): every pair of values of every two factors
occurs in some case. On a CUDA machine the same cases also run on the GPU under inductor
(``LOWPREC_CONFORMANCE_DEVICES=cpu`` keeps only the CPU ones there);
``tests/conformance/run_matrix.py`` runs more seeds and writes the results as CSV.
"""

from __future__ import annotations

import os

import pytest
import torch

from .harness import check
from .space import all_pairs, plain_recipes

DEVICES = os.environ.get("LOWPREC_CONFORMANCE_DEVICES",
                         "cpu,cuda" if torch.cuda.is_available() else "cpu").split(",")
CASES = plain_recipes() + all_pairs(seed=0)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _assert_conforms(got):
    """No failure: eager runs, the compiled step has no graph break and no opaque call,
    its bits are eager's, and eager meets the oracle."""
    assert not got.failures, "\n".join(got.failures)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_conforms(case, device):
    _assert_conforms(check(case, device))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_conforms_on_cuda_routes(case):
    """The same case on the CPU with every GEMM taking CUDA's route
    (``lowprec.gemm.cuda_routes``): CUDA's route decisions, eager and traced, agree."""
    _assert_conforms(check(case, "cpu", cuda_routes=True))
