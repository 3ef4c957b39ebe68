"""The generated space itself: the all-pairs draw covers every pair of factor values, and
each case builds its quantizers."""

import itertools

import pytest

from .space import KINDS, ROLES, BackwardMode, all_pairs, every_value, factors


@pytest.mark.parametrize("seed", [0, 1])
def test_all_pairs_covers_every_pair(seed):
    cases = all_pairs(seed)
    values = factors()
    rows = [{"module": c.module, "backward_mode": c.backward_mode, "autocast": c.autocast,
             **{f"{r}_{d}": k for r, kinds in zip(ROLES, c.kinds) for d, k in
                zip(("row", "col"), kinds)}} for c in cases]
    for a, b in itertools.combinations(values, 2):
        seen = {(r[a], r[b]) for r in rows}
        assert seen == set(itertools.product(values[a], values[b])), (a, b)
    # far fewer than the full product, and not more than twice the two largest factors'
    assert len(cases) <= 2 * len(KINDS) ** 2


def test_every_value_subset_covers_every_value():
    """The quick run's subset: each module, backward mode and autocast placement, and each
    kind in each role and direction whose values reach a GEMM (its columnwise and dY
    kinds under the default backward mode)."""
    cases = all_pairs(0)
    quick = every_value(cases)
    assert set(quick) <= set(cases) and len(quick) < len(cases) // 4
    values = factors()
    for name in ("module", "backward_mode", "autocast"):
        assert {getattr(c, name) for c in quick} == set(values[name]), name
    default = [c for c in quick if c.backward_mode == BackwardMode.DEFAULT]
    for i, role in enumerate(ROLES):
        assert {c.kinds[i][1] for c in default} == set(KINDS), f"{role}_col"
        rows = default if role == "grad_output" else quick
        assert {c.kinds[i][0] for c in rows} == set(KINDS), f"{role}_row"


def test_cases_are_reproducible():
    assert all_pairs(0) == all_pairs(0)
    assert all_pairs(0) != all_pairs(1)
