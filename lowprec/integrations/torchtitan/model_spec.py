"""What lowprec adds to a torchtitan 0.3 ``ModelSpec``: the converted model config, a
``parallelize_fn`` that attaches the recipe and sets up quantized FSDP all-gathers
before torchtitan's own, and a ``post_optimizer_build_fn`` that computes the next
gathers' statistics after each optimizer step."""

from __future__ import annotations

import copy
import dataclasses

from torch import nn
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger

import lowprec
from lowprec.distributed import (
    derives_columnwise,
    precompute_gather_statistics,
    quantized_all_gather,
)
from lowprec.linear import reads_recipe_weights
from lowprec.recipe import BackwardMode, RecipeState, stateful

from .converter import LowprecConverter
from .modules import LowprecGroupedExperts

__all__ = ["LowprecSetup", "apply_lowprec"]


def apply_lowprec(spec: ModelSpec, config: LowprecConverter.Config) -> ModelSpec:
    """A copy of ``spec`` that trains in ``config``'s recipe: its model config converted
    (:class:`LowprecConverter`), its ``parallelize_fn`` a :class:`LowprecSetup` wrapping
    the model's own, its ``post_optimizer_build_fn`` that setup's
    ``post_optimizer_build``. ``spec`` is left as it was."""
    if isinstance(spec.parallelize_fn, LowprecSetup):
        raise ValueError(f"the model spec {spec.name} {spec.flavor} already trains under "
                         f"lowprec ({spec.parallelize_fn.converter.config.recipe})")
    converter = LowprecConverter(config)
    model = converter.convert(copy.deepcopy(spec.model))
    setup = LowprecSetup(converter, spec.parallelize_fn, spec.post_optimizer_build_fn)
    return dataclasses.replace(spec, model=model, parallelize_fn=setup,
                               post_optimizer_build_fn=setup.post_optimizer_build)


class LowprecSetup:
    """The ``parallelize_fn`` of a lowprec model spec (it wraps the model's own).

    On the model built on the meta device, before torchtitan's parallelization
    (activation checkpointing, per-block compile, FSDP2):

    * the recipe is attached (``lowprec.attach_recipe``): every forward of the model runs
      under ``lowprec.autocast(recipe)``; under delayed scaling with data parallelism the
      amaxes are all-reduced over the ``batch`` mesh;
    * with FSDP (``data_parallel_shard_degree`` > 1), ``quantized_all_gather`` lets FSDP2
      gather the converted weights in the recipe's format, except where that cannot serve
      the step (see ``high_precision_gathers``); routed experts gather in high precision.

    Tensor parallelism and expert parallelism are refused."""

    def __init__(self, converter: LowprecConverter, parallelize_fn, post_optimizer_build_fn):
        self.converter = converter
        self.recipe = converter.recipe
        self.config = converter.config
        self.parallelize_fn = parallelize_fn
        self.post_optimizer_build_fn = post_optimizer_build_fn
        #: whether some weights gather quantized (set by the last call)
        self.quantized_gathers = False
        #: whether the optimizer step computes the next gathers' statistics
        self.precompute = False
        #: Linears that FSDP gathers in high precision although quantized gathers are on
        self.high_precision_gathers: list[str] = []

    def __call__(self, model: nn.Module, *, parallel_dims, training, parallelism,
                 compile_config, ac_config, dump_folder, **kwargs):
        if self.recipe is not None:
            self._check(model, parallel_dims)
            group = None
            if stateful(self.recipe) and self.config.amax_reduction and parallel_dims.dp_enabled:
                group = parallel_dims.get_mesh("batch").get_group()
            lowprec.attach_recipe(model, self.recipe, amax_reduction_group=group)
            self._setup_gathers(model, parallel_dims, parallelism, compile_config, ac_config)
        return self.parallelize_fn(model, parallel_dims=parallel_dims, training=training,
                                   parallelism=parallelism, compile_config=compile_config,
                                   ac_config=ac_config, dump_folder=dump_folder, **kwargs)

    def post_optimizer_build(self, optimizers, model_parts, parallel_dims) -> None:
        """The model's own ``post_optimizer_build_fn``, then (with quantized gathers) an
        optimizer step post-hook that runs ``precompute_gather_statistics``."""
        if self.post_optimizer_build_fn is not None:
            self.post_optimizer_build_fn(optimizers, model_parts, parallel_dims)
        if not self.precompute:
            return
        parts = list(model_parts)

        def precompute(*args, **kwargs) -> None:
            for part in parts:
                precompute_gather_statistics(part)
        optimizers.register_step_post_hook(precompute)

    # ---- helpers --------------------------------------------------------------------
    def _check(self, model: nn.Module, parallel_dims) -> None:
        if parallel_dims.tp_enabled:
            raise ValueError(
                f"lowprec does not support torchtitan's tensor parallelism "
                f"(--parallelism.tensor_parallel_degree {parallel_dims.tp}; accepted: 1): "
                f"torchtitan shards the Linears by its own sharding configs, not "
                f"lowprec.distributed's")
        if parallel_dims.ep_enabled and any(isinstance(m, LowprecGroupedExperts)
                                            for m in model.modules()):
            raise ValueError(
                f"lowprec's experts do not support expert parallelism "
                f"(--parallelism.expert_parallel_degree {parallel_dims.ep}; accepted: 1); "
                f"--lowprec.no-experts keeps torchtitan's experts")

    def _setup_gathers(self, model, parallel_dims, parallelism, compile_config,
                       ac_config) -> None:
        self.high_precision_gathers = []
        on = parallel_dims.dp_shard_enabled and self.config.quantized_all_gather
        compiled = compile_config.enable and "model" in compile_config.components
        if on and compiled and not reads_recipe_weights(self.recipe):
            # a quantized gather makes the unsharded weight a quantized tensor, which the
            # compiled Linear reads only in some formats (lowprec.linear.traced)
            logger.warning(f"lowprec: quantized FSDP all-gathers are off under "
                           f"--compile.enable for {self.recipe!r} (its compiled Linear "
                           f"does not read a gathered weight as it is: delayed scaling, "
                           f"per-direction hybrids and non-default backward modes); FSDP "
                           f"gathers the weights in high precision")
            on = False
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, lowprec.Linear)]
        if on:
            # Activation checkpointing recomputes a block's forward in backward, where FSDP
            # (resharding after forward) gathers only what backward's GEMMs read: formats
            # whose columnwise side does not derive from the rowwise one then lack the
            # rowwise side the recompute reads (docs/distributed.md, "Limits"). Those
            # weights gather in high precision.
            policy = parallelism.fsdp_reshard_after_forward
            reshard = policy == "always" or (policy == "default"
                                             and not parallel_dims.pp_enabled)
            recomputed = ac_config is not None and reshard
            for fqn, module in linears:
                if recomputed and not self._serves_recompute(module):
                    self.high_precision_gathers.append(fqn)
                else:
                    quantized_all_gather(module, self.recipe)
            on = len(self.high_precision_gathers) < len(linears)
        self.quantized_gathers = on
        self.precompute = on and self.config.precompute_gather_statistics
        logger.info(f"lowprec: recipe {self.config.recipe} attached; quantized FSDP "
                    f"all-gathers {'on' if on else 'off'}")
        if self.high_precision_gathers:
            logger.warning(f"lowprec: {len(self.high_precision_gathers)} weights gathered in "
                           f"high precision: activation checkpointing recomputes their "
                           f"forward in backward, where FSDP gathers only their columnwise "
                           f"side (their format in {self.config.recipe} does not derive "
                           f"one side from the other); "
                           f"--parallelism.fsdp_reshard_after_forward never gathers them "
                           f"quantized")

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
