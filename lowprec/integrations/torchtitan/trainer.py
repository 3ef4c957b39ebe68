"""``LowprecTrainer``: torchtitan 0.3's ``Trainer`` with a ``lowprec`` config section.

Its ``Config`` is ``Trainer.Config`` plus ``lowprec`` (a :class:`LowprecConverter.Config`,
``--lowprec.<field>`` on the command line). Before torchtitan's trainer builds anything,
the config's model spec is replaced by its lowprec form (:func:`apply_lowprec`), so the
recipe named on the command line is the one the model is converted to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.trainer import Trainer

from .converter import LowprecConverter
from .model_spec import apply_lowprec

__all__ = ["LowprecTrainer", "with_lowprec"]


class LowprecTrainer(Trainer):
    """torchtitan's ``Trainer`` training the model spec's lowprec form."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        lowprec: LowprecConverter.Config = field(default_factory=LowprecConverter.Config)
        """lowprec's recipe and options (``--lowprec.recipe mxfp8``, ...)."""

    def __init__(self, config: Config):
        self.prepare(config)
        super().__init__(config)

    @staticmethod
    def prepare(config: Config) -> None:
        """Replace ``config.model_spec`` by its lowprec form, as the trainer does first."""
        if config.model_spec is None:
            raise ValueError("LowprecTrainer.Config.model_spec is None: a config function "
                             "sets it (model_registry(...))")
        compiled = config.compile.enable and "model" in config.compile.components
        config.lowprec.model_compile_enabled = compiled
        config.model_spec = apply_lowprec(config.model_spec, config.lowprec)


def with_lowprec(config: Trainer.Config, **lowprec) -> LowprecTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``, as a config function returns it) as a
    :class:`LowprecTrainer.Config`, its ``lowprec`` section made of the keyword arguments
    (``with_lowprec(llama3_8b(), recipe="mxfp8")``)."""
    if type(config) is not Trainer.Config:
        raise TypeError(f"with_lowprec takes a torchtitan Trainer.Config, got "
                        f"{type(config).__qualname__} (a trainer of its own)")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return LowprecTrainer.Config(**fields, lowprec=LowprecConverter.Config(**lowprec))
