"""lowprec recipes in torchtitan (0.2.x), as a model converter.

Importing this module registers the converter ``"lowprec"`` in torchtitan's
``model.converters`` registry and defines the ``[lowprec]`` job-config section. Name it
as torchtitan's custom config module, which torchtitan imports before parsing the rest of
the config, so one option does both::

    torchrun --nproc_per_node=2 -m torchtitan.train \\
        --job.config_file llama3_8b.toml \\
        --job.custom_config_module lowprec.integrations.torchtitan \\
        --model.converters lowprec --lowprec.recipe mxfp8

or in the TOML file::

    [job]
    custom_config_module = "lowprec.integrations.torchtitan"
    [model]
    converters = ["lowprec"]
    [lowprec]
    recipe = "mxfp8"

Without the section (the module imported by ``--experimental.custom_import`` instead),
the converter takes the defaults below; ``"lowprec.<recipe>"`` (e.g. ``lowprec.nvfp4``,
one name for every name of ``lowprec.Recipe.names()`` and its aliases) is also registered
and picks the recipe, over the section's.

What the converter does, on the model torchtitan builds on the meta device, before
``parallelize_fn`` (tensor parallelism, activation checkpointing, per-block compile,
FSDP2):

* ``lowprec.convert_model`` swaps each ``nn.Linear`` for a ``lowprec.Linear`` holding the
  same parameters (state-dict names and torchtitan's ``init_weights`` unchanged; no norm
  is fused), except those whose fully qualified name contains one of ``filter_fqns``
  (default ``["output"]``, the LM head, as torchtitan's MX converter) and those whose
  shape the recipe's block format cannot take (a warning lists them);
* the recipe is attached to the model (``lowprec.attach_recipe``): every forward of it
  runs under ``lowprec.autocast(recipe)``, torchtitan's training step unchanged; under
  ``DelayedScaling`` the amaxes are all-reduced over the data-parallel ranks (the
  ``batch`` mesh);
* with FSDP (``data_parallel_shard_degree`` > 1), ``quantized_all_gather`` lets FSDP2
  gather the weights in the recipe's format, and after each optimizer step
  ``precompute_gather_statistics`` computes the next gathers' amaxes in one all-reduce
  (torchtitan's ``precompute_float8_dynamic_scale_for_fsdp``).

Tensor parallelism is refused: torchtitan's plan applies torch's own
``ColwiseParallel``/``RowwiseParallel``, not lowprec's (``lowprec.distributed``).
"""

# No ``from __future__ import annotations``: torchtitan merges the dataclasses below into
# its JobConfig, and tyro resolves their annotations in its own namespace.
from dataclasses import dataclass, field

import torch.nn as nn
from torchtitan.protocols.model_converter import (
    _registry_model_converter_cls,
    register_model_converter,
)
from torchtitan.tools.logging import logger

import lowprec
from lowprec.distributed import precompute_gather_statistics, quantized_all_gather
from lowprec.distributed.gather_codec import derives_columnwise
from lowprec.linear.traced import reads_recipe_weights
from lowprec.recipe import RECIPE_ALIASES, BackwardMode
from lowprec.state import RecipeState, stateful

__all__ = ["JobConfig", "Lowprec", "LowprecConverter"]

#: the name ``model.converters`` takes; ``f"{NAME}.{recipe}"`` names a recipe too
NAME = "lowprec"


@dataclass
class Lowprec:
    """The ``[lowprec]`` section (``--lowprec.<field>`` on the command line)."""

    recipe: str = "fp8_current"
    """A lowprec recipe name (``lowprec.Recipe.names()``: fp8_delayed, fp8_current,
    fp8_block, mxfp8, nvfp4, mxfp8_fwd_nvfp4_bwd, fp8_row_mxfp8_col, nvfp4_fp8_head; bf16
    converts nothing)."""

    backward_mode: str | None = None
    """The recipe's ``backward_mode`` (default: the recipe's default)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linears whose fully qualified name contains one of these stay high precision."""

    quantized_all_gather: bool = True
    """With FSDP, all-gather the weights quantized (``lowprec.distributed``)."""

    precompute_gather_statistics: bool = True
    """With quantized gathers, all-reduce the next gathers' amaxes in one collective after
    each optimizer step."""

    amax_reduction: bool = True
    """Under delayed scaling with data parallelism, all-reduce the amaxes over the
    data-parallel ranks, so that every rank keeps the same scaling state."""


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``--job.custom_config_module``."""

    lowprec: Lowprec = field(default_factory=Lowprec)


class LowprecConverter:
    """torchtitan ``ModelConverter``: converts, attaches the recipe, and with FSDP sets up
    quantized all-gathers (see the module doc)."""

    #: set by the ``lowprec.<recipe>`` registrations: the recipe name, over the section's
    recipe_name: str | None = None

    def __init__(self, job_config, parallel_dims):
        self.config = getattr(job_config, "lowprec", None) or Lowprec()
        name = self.recipe_name or self.config.recipe
        kwargs = {}
        if self.config.backward_mode:
            kwargs["backward_mode"] = self.config.backward_mode
        self.recipe = lowprec.Recipe.from_name(name, **kwargs)
        self.enabled = self.recipe is not None
        others = [c for c in job_config.model.converters if c.startswith("quantize.linear.")]
        if self.enabled and others:
            raise ValueError(f"model.converters: the lowprec converter and {others} would "
                             f"both convert the Linears; name one of them")
        if self.enabled and parallel_dims.tp_enabled:
            raise ValueError("the lowprec converter does not support torchtitan's tensor "
                             "parallelism (its plan uses torch's ColwiseParallel/"
                             "RowwiseParallel, not lowprec.distributed's)")
        self.filter_fqns = list(self.config.filter_fqns)
        self.quantized_gathers = (self.enabled and parallel_dims.dp_shard_enabled
                                  and self.config.quantized_all_gather)
        compiled = job_config.compile.enable and "model" in job_config.compile.components
        if self.quantized_gathers and compiled and not reads_recipe_weights(self.recipe):
            # a quantized gather makes the unsharded weight a quantized tensor, which the
            # compiled Linear reads only in some formats (lowprec.linear.traced)
            logger.warning(f"lowprec: quantized FSDP all-gathers are off under "
                           f"--compile.enable for {type(self.recipe).__name__} (compiled "
                           f"Linears read gathered weights of Float8CurrentScaling and of "
                           f"128x128-block Float8BlockScaling only); FSDP gathers the "
                           f"weights in high precision")
            self.quantized_gathers = False
        self.precompute = self.quantized_gathers and self.config.precompute_gather_statistics
        # Activation checkpointing recomputes a block's forward in backward, where FSDP
        # (resharding after forward) gathers only what backward's GEMMs read: formats whose
        # columnwise side does not derive from the rowwise one then lack the rowwise side
        # the recompute reads (docs/distributed.md, "Limits"). Those weights gather in high
        # precision.
        ac = job_config.activation_checkpoint.mode != "none"
        policy = job_config.parallelism.fsdp_reshard_after_forward
        reshard = policy == "always" or (policy == "default" and not parallel_dims.pp_enabled)
        self.recomputed = ac and reshard
        self.high_precision_gathers: list[str] = []  # Linears gathered in high precision
        self.parallel_dims = parallel_dims
        self.recipe_label = name

    def _keep(self, module: nn.Module, fqn: str) -> bool:
        return not any(f in fqn for f in self.filter_fqns)

    def convert(self, model: nn.Module) -> None:
        if not self.enabled:
            logger.info(f"lowprec: recipe {self.recipe_label!r} converts nothing")
            return
        lowprec.convert_model(model, self.recipe, self._keep, fuse_norms=False)
        group = None
        if (stateful(self.recipe) and self.config.amax_reduction
                and self.parallel_dims.dp_enabled):
            group = self.parallel_dims.get_mesh("batch").get_group()
        lowprec.attach_recipe(model, self.recipe, amax_reduction_group=group)
        high = []
        if self.quantized_gathers:
            for fqn, module in model.named_modules():
                if not isinstance(module, lowprec.Linear):
                    continue
                if self.recomputed and not self._serves_recompute(module):
                    high.append(fqn)
                else:
                    quantized_all_gather(module, self.recipe)
            self.quantized_gathers = len(high) < sum(
                isinstance(m, lowprec.Linear) for m in model.modules())
            self.precompute = self.precompute and self.quantized_gathers
        report = getattr(model, "lowprec_conversion", {})
        logger.info(f"lowprec: {len(report.get('converted', []))} Linears converted to "
                    f"{self.recipe_label} ({self.recipe!r}); quantized FSDP all-gathers "
                    f"{'on' if self.quantized_gathers else 'off'}")
        if high:
            logger.warning(f"lowprec: {len(high)} weights gathered in high precision: "
                           f"activation checkpointing recomputes their forward in backward, "
                           f"where FSDP gathers only their columnwise side (their "
                           f"format in {self.recipe_label} does not derive one side from "
                           f"the other); "
                           f"--parallelism.fsdp_reshard_after_forward never gathers them "
                           f"quantized")
        self.high_precision_gathers = high

    def _serves_recompute(self, module: nn.Module) -> bool:
        """Whether ``module``'s quantized gather in backward also serves a recomputed
        forward: both phases gather the rowwise side, because the format derives the
        columnwise side from it (per-tensor FP8, 2-D blocks) or the backward_mode is not
        the default."""
        if self.recipe.backward_mode != BackwardMode.DEFAULT:
            return True
        roles = module.get_quantizer_roles(fwd=True)
        q = RecipeState.create(self.recipe, "forward", roles).quantizers[1].copy()
        q.set_usage(rowwise=True, columnwise=True)
        if not q.can_quantize_part():
            return True  # gathered in high precision anyway
        rows = q.row_multiple(rowwise=True, columnwise=True)
        return derives_columnwise(q, rows, module.in_features)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        if not self.precompute:
            return
        for m in [model] if isinstance(model, nn.Module) else model:
            precompute_gather_statistics(m)


def _register() -> None:
    names = {NAME: LowprecConverter}
    for recipe in (*lowprec.Recipe.names(), *RECIPE_ALIASES):
        names[f"{NAME}.{recipe}"] = type(f"LowprecConverter_{recipe}", (LowprecConverter,),
                                         {"recipe_name": recipe, "__module__": __name__})
    for name, cls in names.items():
        if name not in _registry_model_converter_cls:  # imported again (reload, spawn)
            register_model_converter(cls, name)


_register()
