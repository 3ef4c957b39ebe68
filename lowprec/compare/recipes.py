"""Named recipes for ``lowprec compare`` and loading a user's own factory from a file.

Every name is one of :meth:`lowprec.recipe.Recipe.names` and maps to the recipe object
:meth:`~lowprec.recipe.Recipe.from_name` builds (``None`` for ``bf16``: no lowprec
autocast, the bf16 model as it is).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import Quantizer
from ..recipe import BACKWARD_MODES, CustomRecipe, Recipe, RecipeState, normalize_backward_mode

BASELINE = "bf16"


@dataclass(frozen=True)
class _Named:
    build: Callable[..., Recipe | None]
    help: str


def _from_table(name: str) -> _Named:
    return _Named(lambda **kw: Recipe.from_name(name, **kw), Recipe.describe(name))


# the names and descriptions are lowprec.recipe's one table (Recipe.names())
NAMED_RECIPES: dict[str, _Named] = {name: _from_table(name) for name in Recipe.names()}

DEFAULT_RECIPES = ("bf16", "fp8_current", "mxfp8", "nvfp4")
NOISE_FLOOR = "bf16_reseeded"


def noise_floor_spec() -> RecipeSpec:
    """bf16 again on the same batches, from other initial weights: how far seed-to-seed
    variation alone moves the loss."""
    return RecipeSpec(NOISE_FLOOR, None, "bf16 again on the same batches, initial weights from "
                      "seed + 1: seed-to-seed noise", init_seed_offset=1)


class RecipeError(ValueError):
    """A recipe name, recipe file or factory that cannot be used; the message says why."""


@dataclass
class RecipeSpec:
    """One run of the comparison: a display name and the recipe (None: the bf16 baseline)."""

    name: str
    recipe: Recipe | None
    description: str
    init_seed_offset: int = 0  # initial weights from seed + offset (the noise-floor run)
    #: the optimizer's state: a key of OPTIM_STATES
    optim_states: str = "fp32"


#: ``--optim-states`` variants: name -> (lowprec.optim.AdamW settings, description); "fp32"
#: is every run's default (torch's AdamW over fp32 master copies)
OPTIM_STATES: dict[str, tuple[dict, str]] = {
    "fp32": ({}, "fp32 moments and fp32 master weights"),
    "bf16": (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                  master_weights="fp32"),
             "bf16 moments (stochastic rounding), fp32 master weights: 10 bytes a parameter"),
    "bf16-sr": (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                     master_weights="stochastic"),
                "bf16 moments and bf16 weights updated with stochastic rounding, no master "
                "copy: 6 bytes a parameter"),
    "fp8-sr": (dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn,
                    master_weights="stochastic"),
               "FP8 moments in 128-element blocks and bf16 weights, stochastic rounding, no "
               "master copy: about 4.1 bytes a parameter"),
}


def parse_optim_states(text: str) -> list[str]:
    """The ``--optim-states`` names, in order, each once; every name must be known."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in OPTIM_STATES]
    if not names or unknown:
        raise RecipeError(f"--optim-states {text!r}: use names from "
                          f"{', '.join(OPTIM_STATES)}")
    return names


def with_optim_states(specs: list, names: list[str]) -> list:
    """``specs`` (their optimizer state fp32), then each of them again under every other
    state in ``names`` (the noise-floor run excepted), named ``<run>+<state>``."""
    out = list(specs)
    for state in names:
        if state == "fp32":
            continue
        for spec in specs:
            if spec.name == NOISE_FLOOR:
                continue
            out.append(RecipeSpec(f"{spec.name}+{state}", spec.recipe,
                                  f"{spec.description}; optimizer: "
                                  f"{OPTIM_STATES[state][1]}", spec.init_seed_offset, state))
    return out


def parse_recipe_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise RecipeError(f"--recipes is empty; valid names: {', '.join(NAMED_RECIPES)}")
    unknown = [n for n in names if n not in NAMED_RECIPES]
    if unknown:
        raise RecipeError(f"unknown recipe name{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(repr(u) for u in unknown)}; valid names: "
                          f"{', '.join(NAMED_RECIPES)} (or --recipe-file path.py:factory)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RecipeError(f"--recipes names {', '.join(dupes)} more than once")
    return names


def build_named(name: str, backward_mode: str | None) -> RecipeSpec:
    entry = NAMED_RECIPES[name]
    kw = {} if backward_mode is None else {"backward_mode": backward_mode}
    try:
        recipe = entry.build(**kw)
    except ValueError as err:
        raise RecipeError(f"recipe {name!r}: {err}") from None
    return RecipeSpec(name, recipe, entry.help)


def check_backward_mode(mode: str | None) -> str | None:
    if mode is None:
        return None
    try:
        return normalize_backward_mode(mode, source="--backward-mode")
    except (TypeError, ValueError) as err:
        raise RecipeError(str(err)) from None


def load_recipe_file(spec: str, backward_mode: str | None) -> RecipeSpec:
    """``path.py:name`` where ``name`` is a ``qfactory(role) -> Quantizer`` (or a Recipe object).

    Raises :class:`RecipeError` saying what failed: the path, the import, the name.
    """
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr:
        raise RecipeError(f"--recipe-file {spec!r}: expected PATH.py:FACTORY, e.g. "
                          f"my_recipes.py:my_factory")
    if not os.path.isfile(path):
        raise RecipeError(f"--recipe-file {spec!r}: no such file {path!r}")
    mod_name = "_lowprec_recipe_file_" + os.path.splitext(os.path.basename(path))[0]
    try:
        ispec = importlib.util.spec_from_file_location(mod_name, path)
        if ispec is None or ispec.loader is None:
            raise ImportError(f"cannot import {path!r} as a Python module")
        module = importlib.util.module_from_spec(ispec)
        sys.modules[mod_name] = module  # so functions defined there pickle by reference
        ispec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any error in the user's file is reported as such
        sys.modules.pop(mod_name, None)
        raise RecipeError(f"--recipe-file {spec!r}: loading {path!r} failed: "
                          f"{type(err).__name__}: {err}") from None
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_")
                       and callable(getattr(module, n)))
        raise RecipeError(f"--recipe-file {spec!r}: {path!r} defines no {attr!r} "
                          f"(callables there: {', '.join(names) or 'none'})")
    obj = getattr(module, attr)
    kw = {} if backward_mode is None else {"backward_mode": backward_mode}
    if isinstance(obj, Recipe):
        recipe = obj if backward_mode is None else _with_backward_mode(obj, backward_mode, spec)
        return RecipeSpec(attr, recipe, f"{type(obj).__name__} from {path}")
    if isinstance(obj, Quantizer) or not callable(obj):
        raise RecipeError(f"--recipe-file {spec!r}: {attr!r} is a {type(obj).__name__}; it must be "
                          f"a factory function role -> Quantizer (or a lowprec recipe object)")
    try:
        recipe = CustomRecipe(qfactory=obj, **kw)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"--recipe-file {spec!r}: {err}") from None
    return RecipeSpec(attr, recipe, f"CustomRecipe({attr}) from {path}")


def _with_backward_mode(recipe: Recipe, mode: str, spec: str) -> Recipe:
    import dataclasses

    try:
        return dataclasses.replace(recipe, backward_mode=mode)
    except ValueError as err:
        raise RecipeError(f"--recipe-file {spec!r}: {err}") from None


def validate_recipe(spec: RecipeSpec, model: torch.nn.Module, tokens: int) -> None:
    """Build every quantizer the model's modules will ask for, and check each fits its tensor.

    Runs before training so a factory that raises, returns a non-quantizer or picks a
    block size the model's shapes do not divide fails at once, naming the role.
    """
    if spec.recipe is None:
        return
    from ..modules import LowprecModule

    for module in model.modules():
        if not isinstance(module, LowprecModule):
            continue
        for mode in ("forward", "backward"):
            roles = module.get_quantizer_roles(fwd=mode == "forward")
            for role in roles:
                q = _quantizer_for(spec, mode, role)
                if role is None:
                    continue  # boundary slot this model never uses
                for shape in _role_shapes(module, role, tokens):
                    try:
                        q.copy().set_usage(rowwise=True, columnwise=True)._check_shape(
                            shape, *shape)
                    except ValueError as err:
                        raise RecipeError(f"recipe {spec.name!r}: role {role!r} cannot quantize "
                                          f"its {shape[0]}x{shape[1]} tensor: {err}") from None


def _quantizer_for(spec: RecipeSpec, mode: str, role) -> Quantizer:
    try:
        return RecipeState.create(spec.recipe, mode, [role]).quantizers[0]
    except Exception as err:  # noqa: BLE001 - a user's factory or recipe: say which role broke
        raise RecipeError(f"recipe {spec.name!r}: building the quantizer raised "
                          f"{type(err).__name__} for role {role!r}: {err}") from None


def _role_shapes(module, role, tokens: int) -> list[tuple[int, int]]:
    """(M, K) of the tensor a role's quantizer sees in this model."""
    gemms = module._gemm_names()
    i = gemms.index(role.name) if role.name in gemms else 0
    weights = module._weight_names()
    w = getattr(module, weights[i]) if i < len(weights) else None
    if w is None or w.dim() != 2:
        return []
    out_f, in_f = w.shape
    return {"input": [(tokens, in_f)], "weight": [(out_f, in_f)], "output": [(tokens, out_f)],
            "grad_output": [(tokens, out_f)], "grad_input": [(tokens, in_f)]}.get(
                role.tensor_type, [])


__all__ = ["NAMED_RECIPES", "DEFAULT_RECIPES", "BASELINE", "NOISE_FLOOR", "noise_floor_spec",
           "BACKWARD_MODES", "RecipeError",
           "RecipeSpec", "parse_recipe_names", "build_named", "check_backward_mode",
           "load_recipe_file", "validate_recipe"]
