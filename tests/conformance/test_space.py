"""The generated space itself: the all-pairs draw covers every pair of factor values, and
each case builds its quantizers."""

import itertools

import pytest

from .space import KINDS, ROLES, all_pairs, factors


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


def test_cases_are_reproducible():
    assert all_pairs(0) == all_pairs(0)
    assert all_pairs(0) != all_pairs(1)
