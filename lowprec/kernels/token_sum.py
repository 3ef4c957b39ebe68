"""The routed rows of a mixture-of-experts layer summed into their tokens: ``out[t]`` adds
``rows[idx[t, 0]]``, ``rows[idx[t, 1]]``, ... one at a time from zero, rounding after each
add as torch's adds do, optionally each row times its gate first; one pass on a GPU with
Triton (kernels: :mod:`.token_sum_kernel`), where torch makes a product pass and a gather
and an add per slot. Elsewhere the same torch ops."""

from __future__ import annotations

import torch

from . import kernel_op, use_kernels

_BT, _BH = 16, 256
_BR, _BH_GRAD = 16, 256
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _runs(rows: torch.Tensor, idx: torch.Tensor) -> bool:
    return (use_kernels(rows) and rows.dim() == 2 and rows.stride(1) == 1
            and idx.is_contiguous() and rows.dtype in _FLOATS and idx.numel() > 0
            and rows.shape[1] > 0)


def gated_runs(rows: torch.Tensor, gates: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether :func:`token_sum` with ``gates`` and :func:`gated_rows_grad` run the kernels."""
    return _runs(rows, idx) and gates.dim() == 1 and gates.is_contiguous() and (
        gates.dtype in _FLOATS)


@kernel_op("lowprec::token_sum", mutates_args=())
def _token_sum(rows: torch.Tensor, gates: torch.Tensor | None,
               idx: torch.Tensor) -> torch.Tensor:
    from .launch import launch
    from .token_sum_kernel import token_sum_kernel
    t, k = idx.shape
    h = rows.shape[1]
    out = torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    with torch.cuda.device(rows.device):
        launch(token_sum_kernel, (-(-t // _BT), -(-h // _BH)), rows,
               gates if gates is not None else rows, idx, out, t, h, rows.stride(0),
               out.stride(0), K=k, HAS_GATE=gates is not None, BT=_BT, BH=_BH, num_warps=4,
               enable_fp_fusion=False)  # the gate's product rounded before its add
    return out


@_token_sum.register_fake
def _(rows, gates, idx):
    return rows.new_empty((idx.shape[0], rows.shape[1]))


def token_sum(rows: torch.Tensor, idx: torch.Tensor,
              gates: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H): each token's rows of ``rows`` (R, H) at ``idx`` (T, k) int64 summed in that
    order, from zero, in ``rows``' dtype; with ``gates`` (R,), each row is
    ``(row * gate).to(rows.dtype)`` first."""
    if _runs(rows, idx) and (gates is None or gated_runs(rows, gates, idx)):
        return _token_sum(rows, gates, idx)
    if torch.compiler.is_compiling():
        # one op of eager's torch ops: a fusing compiler would sum in fp32 and round
        # once, where eager rounds after each add
        return _token_sum_ops(rows, gates, idx)
    return token_sum_torch(rows, idx, gates)


@torch.library.custom_op("lowprec::token_sum_ops", mutates_args=())
def _token_sum_ops(rows: torch.Tensor, gates: torch.Tensor | None,
                   idx: torch.Tensor) -> torch.Tensor:
    return token_sum_torch(rows, idx, gates)


@_token_sum_ops.register_fake
def _(rows, gates, idx):
    return rows.new_empty((idx.shape[0], rows.shape[1]))


def token_sum_torch(rows: torch.Tensor, idx: torch.Tensor,
                    gates: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`token_sum` in torch ops: a product pass, then a gather and an add per slot."""
    if gates is not None:
        rows = (rows * gates[:, None]).to(rows.dtype)
    acc = rows.new_zeros((idx.shape[0], rows.shape[1]))
    for slot in idx.unbind(1):
        acc = acc + rows[slot]
    return acc


@kernel_op("lowprec::gated_rows_grad", mutates_args=())
def gated_rows_grad(grad: torch.Tensor, rows: torch.Tensor, gates: torch.Tensor,
                    token_of: torch.Tensor) -> list[torch.Tensor]:
    """The backward of :func:`token_sum` with gates, for ``grad`` (T, H): [(R, H) rows'
    gradients, (R,) gates'], row r's token ``token_of[r]`` (T or more: a padding row, whose
    gradients are zero, or NaN for its gate where its row holds NaN). One pass where the
    kernels run (:func:`gated_runs`); the gate's sum over the features runs in another order
    than torch's ``sum`` (the same products)."""
    from .launch import launch
    from .token_sum_kernel import gated_rows_grad_kernel
    r, h = rows.shape
    d_rows = torch.empty_like(rows)
    d_gates = torch.empty_like(gates)
    with torch.cuda.device(rows.device):
        launch(gated_rows_grad_kernel, (-(-r // _BR),), grad, rows, gates, token_of, d_rows,
               d_gates, r, grad.shape[0], h, grad.stride(0), rows.stride(0), d_rows.stride(0),
               ROUND_PRODUCT=gates.dtype != torch.float32, BR=_BR, BH=_BH_GRAD, num_warps=4)
    return [d_rows, d_gates]


@gated_rows_grad.register_fake
def _(grad, rows, gates, token_of):
    return [torch.empty_like(rows), torch.empty_like(gates)]
