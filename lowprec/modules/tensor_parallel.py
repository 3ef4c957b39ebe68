"""Tensor and sequence parallelism of the GEMM modules (``parallel_mode``, ``tp_group``,
``sequence_parallel``), Megatron-LM's split as Transformer Engine exposes it.

* ``"column"``: the module holds ``out_features / tp`` rows of the weight (and of the
  bias) and returns its slice of the output features. Its input is replicated over the
  group, or with ``sequence_parallel`` a block of the rows (first dimension) that the
  ranks all-gather before the GEMM.
* ``"row"``: the module holds ``in_features / tp`` columns of the weight and takes the
  matching slice of the input features; the ranks' partial outputs are all-reduced, or
  reduce-scattered into row blocks with ``sequence_parallel``; the (whole) bias is added
  after the reduction.
* ``LayerNormMLP``: fc1 column-parallel, fc2 row-parallel, nothing moves between them.

Parameters every rank holds whole but uses on its own rows only (with
``sequence_parallel``: the norm's, a row-parallel bias) get their gradient summed over the
group in backward, so each rank's ``.grad`` is the whole gradient. The collectives are in
``lowprec.distributed.tp_comm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import tp_comm
from ..fused import graph_norm_of
from ..linear import eager_plan_of, quantized_linear
from ..recipe import BackwardMode, torch_autocast_dtype
from .norms import apply_norm
from .params import producer_usages, release_fprop_copy
from .params import tp_group_size as check_parallel_args  # noqa: F401 (the modules call it here)


def shard_size(n: int, tp_size: int, what: str) -> int:
    """``n / tp_size``, which must be whole."""
    if n % tp_size:
        raise ValueError(f"{what}={n} does not split evenly over a tensor-parallel group of "
                         f"{tp_size} ranks")
    return n // tp_size


class TensorParallel:
    """A module's tensor-parallel setting: its mode, its group, sequence parallelism."""

    def __init__(self, mode: str, group, sequence_parallel: bool) -> None:
        self.mode, self.sequence_parallel = mode, sequence_parallel
        self.ref = tp_comm.GroupRef(group)

    @property
    def size(self) -> int:
        return self.ref.size

    @property
    def group(self):
        return self.ref.group

    def set_group(self, group) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks != self.ref.ranks:
            raise ValueError(f"the module's tensor-parallel group has ranks "
                             f"{list(self.ref.ranks)}; got a group of ranks {list(ranks)}")
        self.ref = tp_comm.GroupRef(group, ranks)


def make_tensor_parallel(parallel_mode, tp_group, sequence_parallel, tp_size: int
                         ) -> TensorParallel | None:
    """The module's TensorParallel, or None for a single rank (nothing to split)."""
    if tp_size == 1:
        return None
    return TensorParallel(parallel_mode, tp_group, sequence_parallel)


def check_boundary_roles(tp: TensorParallel | None, *, row_output: bool,
                         column_grad_input: bool) -> None:
    """A quantized output of partial sums, or a quantized gradient of a replicated input,
    could not be reduced: those boundary roles do not combine with the split."""
    if tp is None:
        return
    if row_output:
        raise ValueError("output_quantizer_role with a row-parallel GEMM over more than one "
                         "rank: its outputs are partial sums, reduced after the GEMM; quantize "
                         "in the next module instead")
    if column_grad_input:
        raise ValueError("grad_input_quantizer_role with a column-parallel GEMM over more than "
                         "one rank: its input gradients are partial sums, reduced after the "
                         "GEMM")


def replicated_param(tp: TensorParallel | None, p: torch.Tensor | None):
    """A parameter every rank holds whole and applies to its own rows only (sequence
    parallelism): its gradient is summed over the group."""
    if p is None or tp is None or not tp.sequence_parallel:
        return p
    return tp_comm.copy_to_group(p, tp.group)


def column_input(tp: TensorParallel | None, x: torch.Tensor, quantizer, backward_mode: str,
                 usages: tuple[bool, bool]) -> torch.Tensor:
    """The input of a column-parallel GEMM: replicated (gradient all-reduced), or gathered
    over the group (quantized by ``quantizer`` with ``usages`` where it can)."""
    if tp is None:
        return x
    if not tp.sequence_parallel:
        return tp_comm.copy_to_group(x, tp.group)
    # under torch.autocast the GEMM quantizes the input cast to the autocast dtype: a
    # quantized gather of the uncast rows would give other bits
    quantized = (backward_mode in (BackwardMode.DEFAULT, BackwardMode.DEQUANTIZED)
                 and torch_autocast_dtype(x) is None)
    return tp_comm.gather_sequence(x, tp.group, quantizer if quantized else None,
                                   rowwise=usages[0], columnwise=usages[1])


def row_output(tp: TensorParallel | None, y: torch.Tensor, bias: torch.Tensor | None,
               grad_quantizer, backward_mode: str) -> torch.Tensor:
    """The output of a row-parallel GEMM from its partial sums: all-reduced, or
    reduce-scattered into row blocks (backward gathers the gradient quantized by
    ``grad_quantizer`` where it can); then the bias."""
    if tp is not None:
        if tp.sequence_parallel:
            q = grad_quantizer if backward_mode == BackwardMode.DEFAULT else None
            y = tp_comm.reduce_scatter_sequence(y, tp.group, q)
        else:
            y = tp_comm.reduce_from_group(y, tp.group)
    if bias is not None:
        y = y + replicated_param(tp, bias)
    return y


def gathered_grad_quantizer(tp: TensorParallel | None, quantizers, backward_mode: str,
                            x: torch.Tensor, weight: torch.Tensor):
    """The quantizer a sequence-parallel row-parallel GEMM's gradient is gathered with
    (:func:`row_output`), or None for a high-precision gather: where the GEMM's backward
    runs through an eager plan (``linear.eager_plan_of``), which quantizes dY from its
    values, gathered codes would be dequantized and quantized again (for NVFP4 into other
    bits than the gathered values' own quantize). Under torch.autocast, where the GEMM
    reads a cast input, also None."""
    if (quantizers is None or tp is None or not tp.sequence_parallel
            or backward_mode != BackwardMode.DEFAULT or torch_autocast_dtype(x) is not None):
        return None
    if eager_plan_of(quantizers, backward_mode, x, weight, None) is not None:
        return None
    return quantizers.grad_output


def output_rows(tp: TensorParallel | None, rows: int, mode: str) -> int:
    """Rows (first dimension) of the output of a GEMM whose input has ``rows``: gathered
    (column) or scattered (row) with sequence parallelism."""
    if tp is None or not tp.sequence_parallel:
        return rows
    return rows * tp.size if mode == "column" else rows // tp.size


def gathered(tp: TensorParallel | None) -> bool:
    """Whether the GEMM input was gathered here (and may be released after fprop)."""
    return tp is not None and tp.sequence_parallel


def column_linear(tp: TensorParallel | None, x: torch.Tensor, weight, bias, quantizers,
                  backward_mode: str, on_backward_done) -> torch.Tensor:
    """A column-parallel quantized linear: its input replicated or gathered first (an
    unsplit one with ``tp`` None)."""
    if tp is None:  # unsplit: nothing to replicate or gather
        return quantized_linear(x, weight, bias, quantizers=quantizers,
                                backward_mode=backward_mode, on_backward_done=on_backward_done)
    q = quantizers.input if quantizers is not None else None
    x = column_input(tp, x, q, backward_mode, producer_usages(weight, backward_mode))
    y = quantized_linear(x, weight, bias, quantizers=quantizers, backward_mode=backward_mode,
                         on_backward_done=on_backward_done)
    if gathered(tp):
        release_fprop_copy(x, backward_mode)  # the gathered input, made here
    return y


def norm_rows(module, tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    """The norm of a tensor-parallel module on the rows this rank holds, in high precision
    (its output is replicated or gathered next; no fused quantize)."""
    return apply_norm(x, module.normalization, replicated_param(tp, module.layer_norm_weight),
                      replicated_param(tp, module.layer_norm_bias), module.eps,
                      module.zero_centered_gamma)


# ---- in a compiled call -----------------------------------------------------------------------
# The same autograd functions and collectives, traced: the collectives are torch's functional
# ones there, and a sequence-parallel gather moves the high-precision rows, which the traced
# GEMM quantizes into the bits a quantized gather would have delivered
# (``tp_comm.quantized_gather_applies``).

def gemm_input_like(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """``x``, or for a column-parallel GEMM under sequence parallelism a stand-in of the
    gathered input it reads (a dead op in the graph), for asking its plan first."""
    if tp is None or tp.mode == "row" or not tp.sequence_parallel:
        return x
    return x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))


def traced_split(tp: TensorParallel | None, x: torch.Tensor, bias, gemm):
    """``gemm(input, bias)`` of a tensor-parallel linear in a compiled call: column-parallel,
    its input replicated or gathered first; row-parallel, its partial outputs reduced, then
    the bias (as :func:`column_linear` and :func:`row_output`)."""
    if tp is not None and tp.mode == "row":
        return row_output(tp, gemm(x, None), bias, None, BackwardMode.DEFAULT)
    return gemm(column_input(tp, x, None, BackwardMode.DEFAULT, (True, False)), bias)


def graph_norm_rows(module, tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """:func:`norm_rows` in a compiled call: the same unfused computation as a graph op
    (with ``tp`` None, the unsplit module's unfused norm)."""
    return graph_norm_of(x, module.normalization,
                         replicated_param(tp, module.layer_norm_weight),
                         replicated_param(tp, module.layer_norm_bias), module.eps,
                         module.zero_centered_gamma, kernel=False,
                         dtype=torch_autocast_dtype(x))
