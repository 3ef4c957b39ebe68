"""The space the conformance suite covers, and the all-pairs draw over it.

A *case* is one module under one ``CustomRecipe``: for each GEMM role a module takes
(input, weight, grad_output) a quantizer kind for each direction (the same kind both ways
is that kind's plain quantizer, two kinds a ``HybridQuantizer``), a backward mode, a module
and where ``lowprec.autocast`` sits relative to the compiled function. The factors and
their values are generated from :data:`KINDS`, :data:`MODULES` and ``BackwardMode``;
:func:`all_pairs` draws a small set of cases in which every pair of values of every two
factors occurs at least once (a seeded greedy covering array).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

import lowprec
from lowprec.recipe import BackwardMode

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _delayed(device):
    # a user-held delayed-scaling pair: scale 16 (not 1, so a wrong scale shows), amax
    # recorded into a fresh zero
    return lowprec.Float8Quantizer(torch.full((1,), 16.0, device=device),
                                   torch.zeros(1, device=device), E4M3)


#: Every quantizer kind lowprec has, by name: a function of the device that makes one.
KINDS = {
    "e4m3": lambda d: lowprec.Float8CurrentScalingQuantizer(E4M3),
    "e5m2": lambda d: lowprec.Float8CurrentScalingQuantizer(E5M2),
    "delayed": _delayed,
    "block1d": lambda d: lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    "block2d": lambda d: lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=2),
    "mxfp8": lambda d: lowprec.MXFP8Quantizer(E4M3),
    "nvfp4": lambda d: lowprec.NVFP4Quantizer(),
    "nvfp4_rht": lambda d: lowprec.NVFP4Quantizer(with_rht=True),
    "nvfp4_2d": lambda d: lowprec.NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_sr": lambda d: lowprec.NVFP4Quantizer(stochastic_rounding=True),
    "identity": lambda d: lowprec.IdentityQuantizer(),
}

#: The modules, by name (built by ``run.build_module``).
MODULES = ("linear", "layernorm_linear", "layernorm_mlp", "grouped_linear", "ops_linear")

#: The roles a GEMM takes, each with a rowwise and a columnwise kind.
ROLES = ("input", "weight", "grad_output")

BACKWARD_MODES = tuple(m.value for m in BackwardMode)

#: Where ``lowprec.autocast`` sits: inside the compiled function or around its call.
AUTOCAST = ("inside", "outside")


def factors() -> dict[str, tuple]:
    """Factor name -> its values, in a fixed order."""
    out = {"module": MODULES, "backward_mode": BACKWARD_MODES, "autocast": AUTOCAST}
    for role in ROLES:
        out[f"{role}_row"] = tuple(KINDS)
        out[f"{role}_col"] = tuple(KINDS)
    return out


@dataclass(frozen=True)
class Case:
    """One generated combination (see the module docstring)."""

    module: str
    backward_mode: str
    autocast: str
    kinds: tuple  # ((row, col) for each of ROLES)

    @property
    def id(self) -> str:
        roles = "-".join(r if r == c else f"{r}+{c}" for r, c in self.kinds)
        return f"{self.module}-{self.backward_mode}-{self.autocast}-{roles}"

    def quantizer(self, role_type: str, device):
        """The quantizer this case gives the role ``role_type`` (a ``HybridQuantizer`` where
        its two directions' kinds differ)."""
        row, col = self.kinds[ROLES.index(role_type)]
        if row == col:
            return KINDS[row](device)
        return lowprec.HybridQuantizer(rowwise_quantizer=KINDS[row](device),
                                       columnwise_quantizer=KINDS[col](device))

    def kinds_used(self) -> set[str]:
        """The kinds whose values reach a GEMM under this case's backward mode."""
        used = {self.kinds[0][0], self.kinds[1][0]}
        if self.backward_mode == BackwardMode.DEFAULT:
            used |= {self.kinds[0][1], self.kinds[1][1], *self.kinds[2]}
        return used


def _case(row: dict) -> Case:
    return Case(row["module"], row["backward_mode"], row["autocast"],
                tuple((row[f"{r}_row"], row[f"{r}_col"]) for r in ROLES))


def all_pairs(seed: int = 0, candidates: int = 8) -> list[Case]:
    """Cases covering every pair of values of every two :func:`factors` (AETG's greedy:
    each new case starts from an uncovered pair and fixes the other factors one at a time,
    in a random order, to the value that covers the most uncovered pairs with the factors
    already fixed; the best of ``candidates`` such cases is kept)."""
    rng = random.Random(seed)
    values = factors()
    names = list(values)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in values[a] for vb in values[b]}

    def covers(row: dict) -> set:
        fixed = [n for n in names if n in row]
        return {(x, row[x], y, row[y]) for x, y in itertools.combinations(fixed, 2)} & uncovered

    rows = []
    while uncovered:
        a, va, b, vb = min(uncovered)  # deterministic order; the draws below vary
        best, gain = None, -1
        for _ in range(candidates):
            row = {a: va, b: vb}
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for n in rest:
                options = list(values[n])
                rng.shuffle(options)
                row[n] = max(options, key=lambda v: len(covers({**row, n: v})))
            got = len(covers(row))
            if got > gain:
                best, gain = {n: row[n] for n in names}, got
        rows.append(best)
        uncovered -= covers(best)
    return [_case(r) for r in rows]


def _values(case: Case) -> set:
    """The (factor, value) pairs of ``case`` that matter to it: a kind only in a role and
    direction whose values reach a GEMM under the case's backward mode (``kinds_used``)."""
    out = {("module", case.module), ("backward_mode", case.backward_mode),
           ("autocast", case.autocast)}
    default = case.backward_mode == BackwardMode.DEFAULT
    for role, (row, col) in zip(ROLES, case.kinds):
        if default or role != "grad_output":
            out.add((f"{role}_row", row))
        if default:
            out.add((f"{role}_col", col))
    return out


def every_value(cases: list[Case]) -> list[Case]:
    """A few of ``cases`` in which every value of every factor still occurs: greedily, the
    first case adding the most values not yet seen, until none is missing. (The quick
    run's subset of the all-pairs draw: each kind in each role and direction, each module,
    backward mode and autocast placement, without every pair of them.)"""
    missing = set().union(*(_values(c) for c in cases))
    chosen = []
    while missing:
        best = max(cases, key=lambda c: len(_values(c) & missing))
        chosen.append(best)
        missing -= _values(best)
    return [c for c in cases if c in chosen]


def plain_recipes() -> list[Case]:
    """Each kind alone in every role (both directions), on a Linear, default backward: the
    single-format recipes the all-pairs draw mixes."""
    return [Case("linear", BackwardMode.DEFAULT.value, "inside", ((k, k),) * 3) for k in KINDS]
