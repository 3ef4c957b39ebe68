"""lowprec inside torchtitan 0.2.x's own training loop, for the GPU benchmark.

The supported integration is ``lowprec.integrations.torchtitan`` (torchtitan 0.3.0). The
GPU machines this repository is measured on run torch 2.11, and torchtitan 0.3.0 needs a
newer torch (it imports ``torch.distributed.fsdp.DataParallelMeshDims``), so
``bench_torchtitan.py`` runs ``torchtitan.train`` of torchtitan 0.2.2 there, with this
file as its ``--job.custom_config_module``. Importing it:

* adds a ``[lowprec]`` job-config section (``--lowprec.recipe mxfp8``, ...);
* registers the model converter ``lowprec`` (``--model.converters lowprec``), which does
  what ``LowprecSetup`` does in 0.3: ``convert_model`` (the LM head ``output`` stays
  bf16), ``attach_recipe``, quantized FSDP2 all-gathers where the compiled Linear reads
  the gathered weight, and ``precompute_gather_statistics`` after each optimizer step;
* adds the Llama 3 flavor ``8B_wide4``: the 8B model's widths with 4 layers.

Activation checkpointing and tensor parallelism are refused (the benchmark runs neither).
"""

# No ``from __future__ import annotations``: torchtitan merges the dataclasses below into
# its JobConfig, and tyro resolves their annotations in its own namespace.
import dataclasses
from dataclasses import dataclass, field

import torch.nn as nn
from torchtitan.models.llama3 import llama3_args
from torchtitan.protocols.model_converter import (
    _registry_model_converter_cls,
    register_model_converter,
)
from torchtitan.tools.logging import logger

import lowprec
from lowprec.distributed import precompute_gather_statistics, quantized_all_gather
from lowprec.linear import reads_recipe_weights
from lowprec.recipe import stateful


@dataclass
class Lowprec:
    """The ``[lowprec]`` section (``--lowprec.<field>`` on the command line)."""

    recipe: str = "fp8_current"
    """A ``lowprec.Recipe.names()`` name or alias."""

    quantized_all_gather: bool = True
    """With FSDP, all-gather the weights in the recipe's format."""

    precompute_gather_statistics: bool = True
    """With quantized gathers, the next gathers' amaxes in one all-reduce after each
    optimizer step."""


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``--job.custom_config_module``."""

    lowprec: Lowprec = field(default_factory=Lowprec)


class LowprecConverter:
    """torchtitan 0.2.x ``ModelConverter`` (see the module doc)."""

    def __init__(self, job_config, parallel_dims):
        self.config = job_config.lowprec
        self.recipe = lowprec.Recipe.from_name(self.config.recipe)
        if self.recipe is None:
            raise ValueError(f"--lowprec.recipe {self.config.recipe!r} converts nothing; "
                             f"leave out --model.converters lowprec for bf16")
        if parallel_dims.tp_enabled or job_config.activation_checkpoint.mode != "none":
            raise ValueError("this benchmark converter takes neither tensor parallelism nor "
                             "activation checkpointing; lowprec.integrations.torchtitan "
                             "(torchtitan 0.3) handles both")
        compiled = job_config.compile.enable and "model" in job_config.compile.components
        self.gathers = (parallel_dims.dp_shard_enabled and self.config.quantized_all_gather
                        and (not compiled or reads_recipe_weights(self.recipe)))
        self.precompute = self.gathers and self.config.precompute_gather_statistics
        self.group = (parallel_dims.get_mesh("batch").get_group()
                      if stateful(self.recipe) and parallel_dims.dp_enabled else None)

    def convert(self, model: nn.Module) -> None:
        lowprec.convert_model(model, self.recipe, lambda m, fqn: "output" not in fqn,
                              fuse_norms=False)
        lowprec.attach_recipe(model, self.recipe, amax_reduction_group=self.group)
        linears = [m for m in model.modules() if isinstance(m, lowprec.Linear)]
        if self.gathers:
            for module in linears:
                quantized_all_gather(module, self.recipe)
        logger.info(f"lowprec: {len(linears)} Linears in {self.config.recipe}; quantized "
                    f"FSDP all-gathers {'on' if self.gathers else 'off'}")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        if self.precompute:
            for part in [model] if isinstance(model, nn.Module) else model:
                precompute_gather_statistics(part)


if "lowprec" not in _registry_model_converter_cls:  # imported again (spawned workers)
    register_model_converter(LowprecConverter, "lowprec")
llama3_args.setdefault("8B_wide4", dataclasses.replace(llama3_args["8B"], n_layers=4))
