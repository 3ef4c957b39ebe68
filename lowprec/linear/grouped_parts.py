"""Pieces every grouped-linear path shares: each row's group, the weight gradients as the
autograd Function hands them back, and inductor-fused torch ops for the layout passes."""

from __future__ import annotations

import torch

from ..gemm import grouped_mm
from ..kernels import use_kernels

_FUSED: dict = {}


def fused(fn, t: torch.Tensor):
    """``fn`` as inductor's fused kernels where ``t`` is on a GPU with Triton (the same
    torch ops, so the same bits, in a pass or two instead of one per op), else ``fn``."""
    if not use_kernels(t) or torch.compiler.is_compiling():
        return fn
    compiled = _FUSED.get(fn)
    if compiled is None:
        compiled = _FUSED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return compiled


def hooked(quantizer) -> bool:
    """Whether ``lowprec.debug``'s hooks (or compare's SQNR probe) are on ``quantizer``: they
    shadow its ``quantize`` with an instance attribute. A grouped path then quantizes each
    group through its own quantizer, so the hooks see every expert's tensors."""
    return "quantize" in quantizer.__dict__


def group_ids(sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group (int64, on ``sizes``' device) for ``rows`` rows in all."""
    groups = torch.arange(sizes.shape[0], device=sizes.device)
    return torch.repeat_interleave(groups, sizes, output_size=rows)


def padded_input(x2d: torch.Tensor, sizes: torch.Tensor, aligned: bool, align: int):
    """(x_pad, src, valid, end offsets, dest): the rows with each group starting at a
    multiple of ``align``, zero rows between (:func:`grouped_mm.padded_layout`), where to
    find them again (``dest``), and what :func:`padded_like` needs; the rows as they are
    (None for the three) when the caller laid them out so (``aligned``)."""
    if aligned:
        return x2d, None, None, grouped_mm.end_offsets(sizes), None
    rows = x2d.shape[0]
    src, valid, offs, _, dest = grouped_mm.padded_layout(sizes, group_ids(sizes, rows), rows,
                                                         align)
    return fused(grouped_mm.padded_rows, x2d)(x2d, src, valid), src, valid, offs, dest


def padded_like(t: torch.Tensor, src, valid) -> torch.Tensor:
    """``t`` (dY) in the layout :func:`padded_input` made of the input."""
    return t if src is None else fused(grouped_mm.padded_rows, t)(t, src, valid)


def host_sizes(group_sizes) -> list[int]:
    """The group sizes as Python ints (a device tensor is read on the host: a sync)."""
    if isinstance(group_sizes, torch.Tensor):
        return [int(m) for m in group_sizes.tolist()]
    return [int(m) for m in group_sizes]


def stacked(weights) -> torch.Tensor:
    """The experts' weights as one (G, N, K) tensor: the one 3-D weight given, or the G
    (N, K) weights stacked."""
    return weights[0] if weights[0].dim() == 3 else torch.stack(weights)


def weight_grads(dw, weights) -> tuple:
    """dW (G, N, K) as a grouped Function's weight inputs take it: whole where they were
    one (G, N, K) weight, else one (N, K) gradient per expert (a single expert included).
    ``weights``: (how many weight inputs, whether the first is 3-D), see :func:`layout`."""
    n_weights, whole = weights
    if dw is None:
        return (None,) * n_weights
    return (dw,) if whole else tuple(dw.unbind(0))


def layout(weights) -> tuple[int, bool]:
    """What :func:`weight_grads` needs to know of a Function's weight inputs."""
    return len(weights), weights[0].dim() == 3
