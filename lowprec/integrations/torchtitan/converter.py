"""``LowprecConverter``: a torchtitan 0.3 ``ModelConfigConverter`` that puts lowprec's
modules into a model config, before torchtitan builds the model.

Its ``Config`` is also the ``lowprec`` section of :class:`~.trainer.LowprecTrainer`'s
config (``--lowprec.<field>`` on the command line).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import has_quantization
from torchtitan.config.override import derive
from torchtitan.models.common.linear import Linear as TitanLinear
from torchtitan.models.common.moe import GroupedExperts as TitanGroupedExperts
from torchtitan.tools.logging import logger

import lowprec
from lowprec.model import recipe_rejection

from .modules import LowprecGroupedExperts, LowprecLinear

__all__ = ["LowprecConverter", "recipe_of"]


def recipe_of(config: "LowprecConverter.Config") -> lowprec.Recipe | None:
    """The recipe ``config`` names (None for ``bf16``: nothing is converted). An unknown
    name raises ``ValueError`` naming it and the accepted names."""
    kwargs = {"backward_mode": config.backward_mode} if config.backward_mode else {}
    try:
        return lowprec.Recipe.from_name(config.recipe, **kwargs)
    except ValueError as err:  # the message names the accepted recipe names
        raise ValueError(f"--lowprec.recipe {config.recipe!r}: {err}") from err


class LowprecConverter(QuantizationConverter):
    """Replaces the model config's ``Linear.Config`` nodes by :class:`LowprecLinear`'s and
    its routed experts' ``GroupedExperts.Config`` by :class:`LowprecGroupedExperts`'s,
    except those ``filter_fqns`` names, MoE routers, and Linears whose shape the recipe's
    block format cannot take (a warning lists these). Subclasses of ``Linear.Config``
    (modules with their own forward) are left alone; a model config that torchtitan's
    own float8/MX/NVFP4 converters already converted is refused."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "fp8_current"
        """A lowprec recipe name (``lowprec.Recipe.names()``: fp8_delayed, fp8_current,
        fp8_block, mxfp8, nvfp4, mxfp8_fwd_nvfp4_bwd, fp8_row_mxfp8_col, nvfp4_fp8_head, or
        an alias); bf16 converts nothing."""

        backward_mode: str | None = None
        """The recipe's ``backward_mode`` (default: the recipe's default)."""

        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
        """Linears (and experts) whose fully qualified name contains one of these stay in
        high precision (default: the LM head)."""

        experts: bool = True
        """Convert MoE routed experts (torchtitan's ``GroupedExperts``) too."""

        quantized_all_gather: bool = True
        """With FSDP, all-gather the weights quantized (``lowprec.distributed``)."""

        precompute_gather_statistics: bool = True
        """With quantized gathers, all-reduce the next gathers' amaxes in one collective
        after each optimizer step."""

        amax_reduction: bool = True
        """Under delayed scaling with data parallelism, all-reduce the amaxes over the
        data-parallel ranks, so that every rank keeps the same scaling state."""

    def __init__(self, config: Config):
        self.config = config
        self.recipe = recipe_of(config)
        #: fully qualified name -> why it was left in high precision (last ``convert``)
        self.skipped: dict[str, str] = {}
        #: fully qualified names converted (last ``convert``)
        self.converted: list[str] = []

    def convert(self, model_config):
        self.skipped, self.converted = {}, []
        if self.recipe is None:
            logger.info(f"lowprec: recipe {self.config.recipe!r} converts nothing")
            return model_config
        if has_quantization(model_config):
            raise ValueError("lowprec: the model config already holds torchtitan's float8/"
                             "MXFP8/NVFP4 modules; use either torchtitan's quantization "
                             "converters or lowprec's, not both")
        kinds = [(TitanLinear.Config, LowprecLinear.Config, True)]
        if self.config.experts:
            kinds.append((TitanGroupedExperts.Config, LowprecGroupedExperts.Config, False))
        for titan, ours, linear in kinds:
            for fqn, cfg, parent, attr in list(model_config.traverse(titan)):
                if type(cfg) is not titan:
                    continue
                reason = self._rejection(fqn)
                if reason is None and linear:
                    reason = recipe_rejection(self.recipe, fqn, cfg.out_features,
                                              cfg.in_features)
                if reason is not None:
                    self.skipped[fqn] = reason
                    continue
                model_config = _replace(model_config, parent, attr,
                                        derive(cfg, ours, name=fqn))
                self.converted.append(fqn)
        refused = {k: v for k, v in self.skipped.items() if not v.startswith("chosen")}
        if refused:
            shown = "; ".join(f"{k}: {v}" for k, v in list(refused.items())[:5])
            warnings.warn(f"lowprec: {len(refused)} module(s) stay in high precision: "
                          f"{shown}", stacklevel=2)
        logger.info(f"lowprec: {len(self.converted)} modules converted to "
                    f"{self.config.recipe} ({self.recipe!r})")
        return model_config

    def _rejection(self, fqn: str) -> str | None:
        if any(f and f in fqn for f in self.config.filter_fqns):
            return f"chosen: matches filter_fqns {self.config.filter_fqns}"
        if "router" in fqn.split("."):
            return "chosen: an MoE router stays in high precision"
        return None


def _replace(root, parent, attr, new):
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root
