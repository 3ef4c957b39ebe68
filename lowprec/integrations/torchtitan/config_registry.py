"""Config functions for ``--module lowprec.integrations.torchtitan``.

Each torchtitan config function is available here under its own name, returning its
config as a :class:`LowprecTrainer.Config`::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module lowprec.integrations.torchtitan --config llama3_8b --lowprec.recipe mxfp8

A name is looked up in the ``config_registry`` of torchtitan's models (llama3, qwen3,
deepseek_v3 first, then the others); ``<model>.<function>`` (``qwen3.qwen3_moe_debug``)
names the model's registry directly.
"""

from __future__ import annotations

import importlib

from torchtitan.models import _supported_models

from .trainer import LowprecTrainer, with_lowprec

#: model registries searched first, in this order
_FIRST = ("llama3", "qwen3", "deepseek_v3")


def _registry(model: str):
    return importlib.import_module(f"torchtitan.models.{model}.config_registry")


def _config_function(name: str):
    """torchtitan's config function ``name`` (``fn`` or ``model.fn``)."""
    model, _, fn = name.rpartition(".")
    if model:
        if model not in _supported_models:
            raise ValueError(f"--config {name!r}: {model!r} is not a torchtitan model "
                             f"(accepted: {', '.join(sorted(_supported_models))})")
        found = getattr(_registry(model), fn, None)
        if not callable(found):
            raise ValueError(f"--config {name!r}: torchtitan.models.{model}.config_registry "
                             f"has no config function {fn!r}")
        return found
    order = [*_FIRST, *sorted(_supported_models - set(_FIRST))]
    for model in order:
        try:
            registry = _registry(model)
        except ImportError:  # a model whose own dependencies are not installed
            continue
        found = getattr(registry, fn, None)
        if callable(found) and not isinstance(found, type):
            return found
    raise ValueError(f"--config {name!r}: no torchtitan config function of that name in the "
                     f"config registries of {', '.join(order)} (e.g. llama3_debugmodel, "
                     f"qwen3_moe_debug, deepseek_v3_debugmodel, or model.function)")


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    base = _config_function(name)

    def config() -> LowprecTrainer.Config:
        return with_lowprec(base())
    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {base.__module__}.{base.__name__}, trained under lowprec."
    return config
