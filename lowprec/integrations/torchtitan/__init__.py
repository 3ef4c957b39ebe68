"""lowprec recipes in torchtitan 0.3.

Name this package as torchtitan's config module and any torchtitan config function as
the config; the recipe is named on the command line::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module lowprec.integrations.torchtitan --config llama3_8b \\
        --lowprec.recipe mxfp8

* :mod:`.config_registry`: every torchtitan config function (``llama3_8b``,
  ``qwen3_moe_debug``, ``deepseek_v3_16b``, ...) as a :class:`LowprecTrainer` config.
* :class:`LowprecTrainer`: torchtitan's ``Trainer`` whose ``Config`` has a ``lowprec``
  section; it trains the model spec's lowprec form (:func:`apply_lowprec`).
* :class:`LowprecConverter`: the ``ModelConfigConverter`` that swaps ``Linear.Config``
  and routed experts' ``GroupedExperts.Config`` for lowprec's (:mod:`.modules`).
* :class:`LowprecSetup`: the ``parallelize_fn`` and ``post_optimizer_build_fn`` around
  the model's own: recipe attached, quantized FSDP all-gathers, their statistics after
  each optimizer step.

docs/integrations.md describes what each step does and the limits.
"""

from .converter import LowprecConverter, recipe_of
from .model_spec import LowprecSetup, apply_lowprec
from .modules import LowprecGroupedExperts, LowprecLinear
from .trainer import LowprecTrainer, with_lowprec

__all__ = ["LowprecConverter", "LowprecGroupedExperts", "LowprecLinear", "LowprecSetup",
           "LowprecTrainer", "apply_lowprec", "recipe_of", "with_lowprec"]
