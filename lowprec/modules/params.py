"""The parameters and construction arguments of GEMM modules: ``nn.Linear``'s
initialization, the tensor-parallel arguments' checks, and the usages a producer (a fused
norm or activation) quantizes a GEMM's input with."""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
from torch import nn

from ..formats import QuantizedTensor, check_bool_option
from ..recipe import BackwardMode, operand_usages

PARALLEL_MODES = (None, "column", "row")


def tp_group_size(parallel_mode, tp_group, sequence_parallel, *, modes=("column", "row"),
                  module: str = "this module") -> int:
    """Validate tensor-parallel arguments; returns the group's size (1 without a group)."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode={parallel_mode!r}; use one of {PARALLEL_MODES}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if tp_group is None:
        return 1
    if not dist.is_initialized():
        raise RuntimeError(f"tp_group={tp_group!r} given but torch.distributed is not "
                           f"initialized")
    size = dist.get_world_size(tp_group)
    if size > 1 and parallel_mode not in modes:
        raise ValueError(f"{module} over a tp_group of {size} ranks takes parallel_mode in "
                         f"{modes}, got {parallel_mode!r}")
    return size


def check_parallel_args(parallel_mode, tp_group, sequence_parallel) -> None:
    """Validate tensor-parallel arguments of a module that runs on a single rank only."""
    if tp_group_size(parallel_mode, tp_group, sequence_parallel) > 1:
        raise NotImplementedError("tensor parallelism over more than one rank is implemented "
                                  "for Linear, LayerNormLinear and LayerNormMLP; pass "
                                  "tp_group=None or a single-rank group")


def producer_usages(weight: torch.Tensor, backward_mode: str) -> tuple[bool, bool]:
    """(rowwise, columnwise) usages a producer quantizes a GEMM's input with: what
    ``quantized_linear`` would make itself (columnwise only for wgrad in default mode)."""
    return operand_usages(backward_mode, needs_dgrad=False,
                          needs_wgrad=weight.requires_grad and torch.is_grad_enabled()).input


def release_fprop_copy(x: torch.Tensor, backward_mode: str) -> None:
    """After fprop, drop the rowwise data of an input a producer quantized for this GEMM
    alone: in default mode backward saved only the columnwise data."""
    if (backward_mode == BackwardMode.DEFAULT and isinstance(x, QuantizedTensor)
            and x.has_usage("rowwise") and x.has_usage("columnwise")):
        x.update_usage(rowwise_usage=False)


def init_linear_params(weight: torch.Tensor, bias: torch.Tensor | None,
                       fan_in: int | None = None) -> None:
    """torch.nn.Linear's initialization (Kaiming-uniform weight, uniform bias).
    ``fan_in``: the whole layer's, for a row-parallel shard (its columns are a slice of it):
    the bounds are those of the unsplit layer."""
    if fan_in is None or fan_in == weight.shape[1]:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        fan_in = weight.shape[1]
    else:  # kaiming_uniform_ with a=sqrt(5) draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def is_count(n, least: int = 0) -> bool:
    """Whether ``n`` is an int (numpy's too, not a bool) of at least ``least``: a size."""
    return not isinstance(n, bool) and isinstance(n, numbers.Integral) and n >= least


def add_linear_params(module: nn.Module, weight_name: str, bias_name: str | None,
                      out_features: int, in_features: int, *, bias: bool, dtype, device,
                      bias_features: int | None = None, fan_in: int | None = None) -> None:
    """Register an ``nn.Linear``-initialized weight (and bias) on ``module``.

    With ``bias=False`` the bias name (if given) is registered as ``None``.
    ``bias_features``/``fan_in``: a row-parallel shard's whole bias and whole fan-in.
    """
    owner = type(module).__name__
    for what, n in (("out_features", out_features), ("in_features", in_features)):
        if not is_count(n):
            raise ValueError(f"{owner}: {what} must be an int >= 0, got {n!r}")
    bias = check_bool_option(owner, "bias", bias)
    w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
    b = (nn.Parameter(torch.empty(bias_features or out_features, dtype=dtype, device=device))
         if bias else None)
    init_linear_params(w, b, fan_in)
    if fan_in is not None:
        module.__dict__.setdefault("_fan_in", {})[weight_name] = fan_in
    module.register_parameter(weight_name, w)
    if bias_name is not None:
        module.register_parameter(bias_name, b)

