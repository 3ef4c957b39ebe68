"""Linear backward with dY quantized a slice at a time, for a lower peak memory.

A bf16 backward allocates dX and dW. A quantized one also holds dY quantized twice
(rowwise for dgrad, columnwise for wgrad). Where those two copies outweigh dX + dW (a
wide output layer: N large against K), the backward instead quantizes dY in slices, each
consumed by its GEMM and freed before the next is made:

* wgrad ``dW[a:b] = mat(dY[:, a:b], columnwise) @ mat(X, columnwise).T``, column slices;
* dgrad ``dX[a:b] = mat(dY[a:b], rowwise) @ mat(W, columnwise).T``, row slices.

Each slice is quantized exactly as the whole dY would be (``Quantizer.slice_quantizer``:
per-tensor formats compute the whole tensor's amax first), so the quantized values, and
so the gradients, are the same as unsliced; each GEMM writes its rows of dX or dW in
place. Block formats slice by default where one copy exceeds ``AUTO_MIN_COPY_BYTES`` (a
vocabulary projection): their slices need no pass for statistics. Per-tensor FP8 slices
only inside :class:`sliced` (which also lowers the floor to ``MIN_COPY_BYTES``): it then
reads dY once more (delayed scaling twice, for the amax), 4-8% of a step where it applies.
Formats without ``slice_quantizer`` (MXFP8, NVFP4 and hybrids) never slice here; inside
:class:`sliced`, MXFP8 and NVFP4 take a path of their own that also slices the forward
(``lowprec.linear.exact_split``).

The forward does the same for the weight (``lowprec.linear.function``): its columnwise copy is made
after fprop, from the same statistics (``Quantizer.quantize_usage_like``; no extra pass for
them), once the rowwise copy of the input is freed. This is on in every mode but
:class:`unsliced`.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..formats import QuantizedTensor, Quantizer
from ..gemm import accumulating, gemm
from ..memory import register_thread_setting

#: Below this size of one quantized copy of dY (bytes) the backward never slices: the
#: memory is small and every extra launch costs host time.
MIN_COPY_BYTES = 16 << 20

#: The same floor in the default ("auto") mode. Slices cost GPU time: each GEMM is smaller,
#: and dY's two directions are quantized in separate passes instead of one (block FP8 on an
#: H100, "1b" gate/up projections with 67 MB copies: 0.23 ms a layer, with the step's peak
#: unchanged, since that peak comes before the backward of any one layer). By default only
#: wide outputs (a vocabulary projection) slice; inside :class:`sliced` every layer above
#: ``MIN_COPY_BYTES`` does.
AUTO_MIN_COPY_BYTES = 256 << 20

#: Slice starts are multiples of this (the largest block edge of any format).
ALIGN = 128


def split_sizes(m: int, n: int, k: int, dx_itemsize: int, dw_itemsize: int
                ) -> tuple[int, int] | None:
    """(rows per dgrad slice, columns per wgrad slice) for dY (m, n), X (m, k), W (n, k),
    or None when slicing does not pay.

    Slices when the two one-byte copies of dY (2 m n bytes) exceed dX + dW and one copy is
    at least this thread's floor (``AUTO_MIN_COPY_BYTES`` in the default mode,
    ``MIN_COPY_BYTES`` inside :class:`sliced`). wgrad runs
    before dX exists, so a column slice may take up to dX's size; dgrad runs beside both
    gradients, so a row slice takes at most half of dX. Large slices keep the GEMMs large
    (a GEMM cut too small loses its last partial wave of tiles).
    """
    copy = m * n
    dx_bytes, dw_bytes = m * k * dx_itemsize, n * k * dw_itemsize
    floor = AUTO_MIN_COPY_BYTES if _MODE.value == "auto" else MIN_COPY_BYTES
    if copy < floor or 2 * copy <= dx_bytes + dw_bytes:
        return None
    rows = _even_slices(m, dx_bytes // 2 // n)
    cols = _even_slices(n, dx_bytes // m)
    if rows >= m and cols >= n:
        return None
    return rows, cols


def _even_slices(size: int, limit: int) -> int:
    """Slice length for ``size`` split into the fewest equal, ALIGN-multiple slices of about
    ``limit`` at most (equal slices: no small last GEMM)."""
    count = -(-size // max(limit, ALIGN))
    per = -(-size // count)
    return min(size, -(-per // ALIGN) * ALIGN)


class _Mode(threading.local):
    """The slicing mode of this thread: "auto" slices only with quantizers whose slices need
    no extra pass over the tensor for statistics (``Quantizer.slices_need_stats_pass``
    False: block formats), and only above ``AUTO_MIN_COPY_BYTES``; "always" also per-tensor
    FP8, which then reads dY once more for its amax, from ``MIN_COPY_BYTES`` up; "never": no
    slicing, and the weight's two usages made at once. Set through the context managers
    :class:`sliced` and :class:`unsliced`; a traced linear's plan reads it
    (``lowprec.linear.traced``)."""

    def __init__(self) -> None:
        # an instance attribute in each thread (torch.compile guards on it)
        self.value = "auto"


_MODE = _Mode()
register_thread_setting(lambda: _MODE.value, lambda value: setattr(_MODE, "value", value))


def mode() -> str:
    """This thread's slicing mode ("auto", "always" or "never")."""
    return _MODE.value


def weight_in_two_steps() -> bool:
    """Whether a linear forward may quantize the weight's two usages one after the other
    (all modes but ``unsliced()``; see ``lowprec.linear.function``)."""
    return _MODE.value != "never"


def exact_slicing() -> bool:
    """Whether linear layers with formats emulated on bf16 GEMMs run sliced
    (``lowprec.linear.exact_split``): only inside :class:`sliced`."""
    return _MODE.value == "always"


def slicing_allowed(slices_need_stats_pass: bool) -> bool:
    """Whether the backward slices dY for a quantizer that can slice, given whether its
    slices need one more pass for the whole tensor's statistics (see ``_Mode``)."""
    return _MODE.value == "always" or (_MODE.value == "auto" and not slices_need_stats_pass)


def slicing_enabled(quantizer) -> bool:
    """Whether a linear layer may slice what ``quantizer`` quantizes (see ``_Mode``)."""
    if quantizer is None or not quantizer.can_slice():
        return False
    return slicing_allowed(quantizer.slices_need_stats_pass)


class _SetMode:
    _value = "auto"

    def __enter__(self):
        self._saved, _MODE.value = _MODE.value, self._value
        return self

    def __exit__(self, *exc):
        _MODE.value = self._saved
        return False


class unsliced(_SetMode):
    """Context manager: linear layers run inside it quantize dY (backward) and the weight's
    two directions (forward) each in one piece; for comparisons, or where speed matters
    more than the peak memory."""

    _value = "never"


class sliced(_SetMode):
    """Context manager: linear layers run inside it slice wherever the memory rule says so,
    per-tensor FP8 included (peak memory at or below bf16's on the benchmark shapes, for
    one more read of dY: 4-8% of a step on 16384x4096x14336, H200), and formats emulated
    on bf16 GEMMs (MXFP8, NVFP4) take the sliced path of :mod:`lowprec.linear.exact_split` (x and dY
    read twice, a launch per slice)."""

    _value = "always"


class in_mode(_SetMode):
    """Context manager: this thread's slicing mode is ``value`` inside it (a decision made
    for a call of that mode, ``lowprec.linear.decided``)."""

    def __init__(self, value: str) -> None:
        self._value = value


def sliced_backward(quantizer: Quantizer, dy: torch.Tensor, x_op: QuantizedTensor,
                    w_op: QuantizedTensor, rows: int, cols: int, dx_dtype: torch.dtype,
                    dw_dtype: torch.dtype, after_wgrad: Callable[[], None],
                    fast: tuple[bool, bool] = (False, False)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX as (M, K), dW as (N, K)) with dY quantized in slices; ``after_wgrad`` runs
    between the two GEMM loops (the caller frees the saved input there); ``fast``: (dgrad,
    wgrad) fast accumulation (``LinearQuantizers.fast_accum``)."""
    n = dy.shape[-1]
    dy2d = dy.detach().reshape(-1, n)
    m, k = dy2d.shape[0], w_op.shape[-1]
    slice_quantize = quantizer.slice_quantizer(dy2d)
    if slice_quantize is None:
        raise RuntimeError(f"{quantizer!r}.slice_quantizer returned None where the linear's "
                           f"plan chose to slice")
    dw = torch.empty((n, k), dtype=dw_dtype, device=dy.device)
    for a in range(0, n, cols):
        part = slice_quantize(dy2d[:, a:a + cols], "columnwise")
        with accumulating(fast[1]):
            gemm(part, "columnwise", x_op, "columnwise", out_dtype=dw_dtype, out=dw[a:a + cols])
        del part  # free this slice before the next is made
    after_wgrad()
    dx = torch.empty((m, k), dtype=dx_dtype, device=dy.device)
    for a in range(0, m, rows):
        part = slice_quantize(dy2d[a:a + rows], "rowwise")
        with accumulating(fast[0]):
            gemm(part, "rowwise", w_op, "columnwise", out_dtype=dx_dtype, out=dx[a:a + rows])
        del part
    return dx, dw
