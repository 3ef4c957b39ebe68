"""Quantizer: the base class of every format's quantizer (configuration that turns a
high-precision tensor into a QuantizedTensor).

The rest of lowprec imports it from ``lowprec.formats.base``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, ClassVar

import torch

from .checks import HIGH_PRECISION_DTYPES, USAGES, check_bool_option, check_usage, flatten_2d
from .quantized_tensor import QUANTIZER_ATTR, QuantizedTensor


class Quantizer:
    """Configuration that turns a high-precision tensor into a QuantizedTensor.

    A quantizer is a small picklable value: it holds its usages and format
    parameters and no process group, module or tensor it does not need.
    """

    #: Name of the format, for messages and reports.
    format_name: ClassVar[str] = "quantizer"
    #: Whether ``quantize`` is a function of its input and the settings ``_repr_params``
    #: lists alone (no state read or written, no random draws), so GEMMs that read one
    #: input may share one quantize of it (:meth:`share_key`).
    stateless: ClassVar[bool] = False

    def __init__(self) -> None:
        self.rowwise_usage = True
        self.columnwise_usage = True

    def set_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> "Quantizer":
        """Turn the rowwise/columnwise outputs on or off (``None`` keeps the current value)."""
        if rowwise is not None:
            self.rowwise_usage = check_bool_option(type(self).__name__, "rowwise", rowwise)
        if columnwise is not None:
            self.columnwise_usage = check_bool_option(type(self).__name__, "columnwise",
                                                      columnwise)
        return self

    @contextlib.contextmanager
    def usages(self, rowwise: bool, columnwise: bool):
        """Context manager: these usages inside, the previous ones restored after."""
        saved = (self.rowwise_usage, self.columnwise_usage)
        self.set_usage(rowwise=rowwise, columnwise=columnwise)
        try:
            yield self
        finally:
            self.set_usage(*saved)

    def copy(self) -> "Quantizer":
        """An independent quantizer with the same settings (shared recipe-owned state stays
        shared)."""
        return copy.copy(self)

    def share_key(self):
        """A hashable key, equal for quantizers that quantize any input to the same tensor
        (a stateless format and its settings, usages aside), or None where a quantize
        cannot be shared (scaling state, random draws)."""
        if not self.stateless:
            return None
        return (type(self), tuple(self._repr_params().items()))

    # ---- exact bf16 GEMM operands -----------------------------------------------------------
    #: Whether this format's kernels can also write a direction's exact bf16 values (the
    #: operand of the bf16 GEMM emulation, kept as a ``_derived`` record ``_exact_<usage>``
    #: of the tensor): MXFP8 and NVFP4.
    keeps_exact_bf16: ClassVar[bool] = False
    #: The tensor type ``quantize_for_gemm(codes=False)`` returns (formats with
    #: ``keeps_exact_bf16``: ``lowprec.formats.exact.ExactTensor``).
    exact_tensor_type: ClassVar[type | None] = None
    #: The directions asked for by :meth:`quantize_for_gemm`, during that call only.
    _exact: tuple[str, ...] = ()

    def quantize_for_gemm(self, x: torch.Tensor, exact: tuple[str, ...] = (), *,
                          codes: bool = True) -> QuantizedTensor:
        """``quantize(x)``; where the format keeps exact bf16 operands, its kernel also writes
        those of the directions in ``exact`` (ones a GEMM consumes right away), so the GEMM
        emulation reads them instead of dequantizing in a pass of its own. The quantized
        tensor is the same either way.

        ``codes=False``, for an operand nothing reads but those GEMMs (every direction in
        use listed in ``exact``): where the format's kernels run, the result is an
        :class:`~lowprec.formats.exact.ExactTensor` holding only the exact values (no codes,
        no scales: less memory written and held); elsewhere the usual quantized tensor."""
        if not (exact and self.keeps_exact_bf16):
            return self.quantize(x)
        if not codes:
            wanted = {u for u in USAGES if getattr(self, f"{u}_usage")}
            if not wanted <= set(exact):
                raise ValueError(f"quantize_for_gemm(codes=False) needs the exact values of "
                                 f"every direction in use ({sorted(wanted)}), got {exact}")
            exact_only = self._quantize_exact(x)
            if exact_only is not None:
                return exact_only
        self._exact = tuple(exact)
        try:
            return self.quantize(x)
        finally:
            self._exact = ()

    def _quantize_exact(self, x: torch.Tensor) -> QuantizedTensor | None:
        """An ExactTensor of ``x`` through the format's kernels, or None where they do not
        run (CPU, no Triton, an empty tensor)."""
        from ..kernels import use_kernels
        self._check_input(x)
        m, k = flatten_2d(x.shape)
        self._check_shape(x.shape, m, k)
        if m == 0 or k == 0 or not use_kernels(x):
            return None
        return self.exact_tensor_type(x.shape, x.dtype,
                                      **self._quantize_exact_2d(_row_major_2d(x, m, k)))

    def _quantize_exact_2d(self, x2d: torch.Tensor) -> dict[str, Any]:
        """ExactTensor fields of ``x2d`` (formats with ``keeps_exact_bf16``)."""
        raise NotImplementedError

    def exact_usages(self) -> tuple[str, ...]:
        """The directions whose exact bf16 records the running quantize should write: none
        where records could not be kept (tracing, inference mode; see ``derived_record``)."""
        if not self._exact or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return ()
        return self._exact

    # ---- prepared quantizes ----------------------------------------------------------------
    def prepare(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, *,
                rowwise: bool, columnwise: bool, exact: tuple[str, ...] = (),
                codes: bool = True) -> Callable[[torch.Tensor], QuantizedTensor]:
        """A function quantizing tensors of one kind (``shape``, ``dtype``, ``device``) as
        ``quantize_for_gemm(t, exact, codes=codes)`` with these usages does, for a caller
        that makes the same call again and again (a linear plan): formats whose launches
        can be decided once (``_prepared``) skip the per-call decisions, and any call the
        prepared path does not take (another kind of tensor, tracing) gets the usual
        quantize. The result does not depend on the quantizer's usage settings at the
        call."""
        def usual(t: torch.Tensor) -> QuantizedTensor:
            self.set_usage(rowwise=rowwise, columnwise=columnwise)
            return self.quantize_for_gemm(t, exact, codes=codes)

        fast = (self._prepared(shape, dtype, device, rowwise, columnwise)
                if (rowwise or columnwise) and _kernels_for(shape, dtype, device) else None)
        return self._prepared_or_usual(fast, usual)

    def prepare_usage_like(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                           usage: str) -> Callable[[torch.Tensor, QuantizedTensor],
                                                   QuantizedTensor]:
        """``f(x2d, like)``: :meth:`quantize_usage_like` ``(x2d, like, usage)`` for 2-D tensors
        of one kind, prepared as :meth:`prepare` prepares a quantize."""
        check_usage(usage)

        def usual(x2d: torch.Tensor, like: QuantizedTensor) -> QuantizedTensor:
            return self.quantize_usage_like(x2d, like, usage)

        rowwise = usage == "rowwise"
        fast = (self._prepared_usage_like(shape, dtype, device, rowwise, not rowwise)
                if self.can_quantize_usage_like() and _kernels_for(shape, dtype, device)
                else None)
        return self._prepared_or_usual(fast, usual)

    def prepare_part(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, *,
                     rowwise: bool, columnwise: bool
                     ) -> Callable[[torch.Tensor, torch.Tensor | None], QuantizedTensor]:
        """``f(part, statistic)``: :meth:`quantize_part` with these usages for parts of one
        kind (``shape``, ``dtype``, ``device``), prepared as :meth:`prepare` prepares a
        quantize: for a caller that quantizes the same shard every step (an FSDP gather)."""
        def usual(part: torch.Tensor, statistic: torch.Tensor | None) -> QuantizedTensor:
            with self.usages(rowwise=rowwise, columnwise=columnwise):
                return self.quantize_part(part, statistic)

        fast = (self._prepared_part(shape, dtype, device, rowwise, columnwise)
                if (rowwise or columnwise) and len(shape) == 2 and self.can_quantize_part()
                and _kernels_for(shape, dtype, device) else None)
        return self._prepared_or_usual(fast, usual)

    def _prepared_part(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                       rowwise: bool, columnwise: bool):
        """As :meth:`_prepared`, for :meth:`prepare_part` (called ``(part, statistic)``)."""
        return None

    def _prepared_or_usual(self, fast, usual):
        """``usual`` where there is no prepared path, else a function that builds the tensor
        from ``fast``'s fields and turns to ``usual`` for a call ``fast`` does not take."""
        if fast is None:
            return usual
        tensor_class = self._tensor_class()

        def prepared(x: torch.Tensor, *rest) -> QuantizedTensor:
            if "quantize" in self.__dict__:
                # the instance's own quantize records every quantize (``lowprec.debug``
                # hooks), which the prepared launches would go around
                return usual(x, *rest)
            fields = fast(x, *rest)
            if fields is None:
                return usual(x, *rest)
            return tensor_class(x.shape, x.dtype, **fields)
        return prepared

    def _prepared_usage_like(self, shape, dtype, device, rowwise: bool, columnwise: bool):
        """As :meth:`_prepared`, for :meth:`prepare_usage_like` (called ``(x2d, like)``)."""
        return None

    def _prepared(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                  rowwise: bool, columnwise: bool):
        """A callable returning the tensor fields of a quantize of its argument, or None
        where it does not apply to that call (see :meth:`prepare`); None: the format has
        no prepared path."""
        return None

    # ---- quantize -------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize ``x`` into the directions whose usage is on.

        Differentiable, as Transformer Engine's quantize is: where autograd records (grad
        mode on and ``x`` requires grad) the result has a ``grad_fn`` whose gradient reaches
        ``x`` unchanged (straight through). Elsewhere (``no_grad``, the linear modules'
        own autograd Functions) no graph is built."""
        if not isinstance(x, torch.Tensor):
            self._check_input(x)  # raises, naming what it got
        if x.requires_grad and torch.is_grad_enabled():
            return _QuantizeFunction.apply(x, self)
        return self._quantize_impl(x)

    def _quantize_impl(self, x: torch.Tensor) -> QuantizedTensor:
        """:meth:`quantize` outside autograd."""
        self._check_input(x)
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        m, k = flatten_2d(x.shape)
        if m == 0 or k == 0:
            # Nothing to scale (e.g. an empty GroupedLinear split): empty buffers, unit scales.
            return self.make_empty(x.shape, dtype=x.dtype, device=x.device)
        whole_m, whole_k = self._whole_blocks(x.shape, m, k)
        x2d = _row_major_2d(x, m, k)
        padded = (whole_m, whole_k) != (m, k)
        if padded:
            # Partial blocks: zeros change no block's amax (nor a global one), so the whole
            # blocks of the zero-padded matrix carry each partial block's own scale.
            x2d = torch.nn.functional.pad(x2d, (0, whole_k - k, 0, whole_m - m))
        return self._tensor_of(self._quantize_2d(x2d), x.shape, x.dtype, padded=padded)

    def _whole_blocks(self, shape, m: int, k: int) -> tuple[int, int]:
        """(M, K) rounded up to whole blocks of this quantizer's usages (see
        :meth:`row_multiple`, :meth:`col_multiple`), after checking what the format cannot
        take even then (:meth:`_check_partial`)."""
        rows = self.row_multiple(rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        cols = self.col_multiple(rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        whole = -(-m // rows) * rows, -(-k // cols) * cols
        if whole != (m, k):
            self._check_partial(shape, m, k)
        self._check_shape(shape, *whole)
        return whole

    def _tensor_of(self, fields: dict, shape, dtype: torch.dtype, *,
                   padded: bool) -> QuantizedTensor:
        """The tensor of nominal ``shape``, holding this quantizer, from the fields of a
        quantize (or an empty one) of its matrix zero-padded to whole blocks. Where it was
        ``padded``, each direction's data is cut to its stored size ((M, K) rowwise, (K, M)
        columnwise; ``QuantizedTensor._stored_values`` reads it) and its scales to one a
        block, partial blocks included (a direction's blocks may run whole along a
        dimension another direction needed padded); derived records are dropped (they
        hold the padded layout)."""
        qt = self._tensor_class()(shape, dtype, **fields)
        for usage in USAGES if padded else ():
            data = getattr(qt, f"{usage}_data")
            if data is None:
                continue
            rows, cols = qt._stored_dims(usage)
            br, bc = qt._stored_block(usage)
            scale = getattr(qt, f"{usage}_scale")
            setattr(qt, f"{usage}_data", data[:rows, :-(-cols // qt._packing)].contiguous())
            setattr(qt, f"{usage}_scale", scale[:-(-rows // br), :-(-cols // bc)].contiguous())
            for name in qt._derived:
                setattr(qt, name, None)
        return self._holding_self(qt)

    def _holding_self(self, qt: QuantizedTensor) -> QuantizedTensor:
        """``qt`` with this quantizer attached (``QUANTIZER_ATTR``): an in-place op outside
        its table, or a ``copy_`` of high-precision values, re-quantizes it with it."""
        setattr(qt, QUANTIZER_ATTR, self)
        return qt

    def __call__(self, x: torch.Tensor) -> QuantizedTensor:
        """``quantize(x)`` (a subclass's own quantize included)."""
        return self.quantize(x)

    def part_statistic(self, part: torch.Tensor) -> torch.Tensor | None:
        """The per-tensor statistic of ``part`` (rows of a larger 2-D tensor) that
        :meth:`quantize_part` needs the whole tensor's value of, as an int32 tensor whose
        elementwise maximum over the parts is the whole tensor's (an all-reduce MAX
        combines them); None for formats whose blocks need nothing beyond themselves."""
        return None

    def quantize_part(self, part: torch.Tensor,
                      statistic: torch.Tensor | None = None) -> QuantizedTensor:
        """``part``, whole rows of a 2-D tensor whose other rows other processes hold (a
        weight shard under FSDP), quantized with this quantizer's usages exactly as
        :meth:`quantize` of the whole tensor quantizes those rows, where
        :meth:`can_quantize_part` says the format can (its values depend on nothing but the
        part and a maximum over the parts).

        ``statistic``: the elementwise maximum of :meth:`part_statistic` over every part
        (required where that is not None). Blocks that run along the rows need the part to
        start and end on a block boundary (:meth:`row_multiple`)."""
        self._check_input(part)
        if part.dim() != 2:
            raise ValueError(f"{type(self).__name__}.quantize_part needs a 2-D part, got shape "
                             f"{tuple(part.shape)}")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        if not self.can_quantize_part():
            raise NotImplementedError(
                f"{self!r} cannot quantize a part of a tensor as the whole tensor's quantize "
                f"would (see can_quantize_part)")
        m, k = part.shape
        self._check_shape(part.shape, m, k)
        if m == 0 or k == 0:
            return self.make_empty(part.shape, dtype=part.dtype, device=part.device)
        return self._tensor_class()(part.shape, part.dtype,
                                    **self._part_fields(part.contiguous(), statistic))

    #: Whether a quantize's values depend on nothing beyond each block's own elements, so a
    #: part of a tensor quantizes alone (``quantize_part``).
    blocks_are_independent: ClassVar[bool] = False

    def can_quantize_part(self) -> bool:
        """Whether :meth:`quantize_part` works with this quantizer and its usages."""
        return self.blocks_are_independent

    def _part_fields(self, part: torch.Tensor, statistic: torch.Tensor | None) -> dict:
        """Fields of :meth:`quantize_part` for a part with elements."""
        return self._quantize_2d(part)

    def supports_fused(self, x: torch.Tensor) -> bool:
        """Whether :meth:`quantize_fused` can take ``x`` (a CUDA input with Triton kernels, a
        format whose kernels take a prologue)."""
        from ..kernels import use_kernels
        return type(self)._quantize_2d_fused is not Quantizer._quantize_2d_fused and \
            use_kernels(x)

    def quantize_fused(self, x: torch.Tensor, prologue) -> QuantizedTensor:
        """Quantize ``prologue(x)`` (a norm or an activation, see ``lowprec.fused``) without
        writing it out: bit-identical to ``quantize(apply_prologue(x, prologue))``. Where
        ``prologue(x)`` does not fill whole blocks, the prologue is written out first and
        quantized as :meth:`quantize` quantizes partial blocks (the kernels would read the
        prologue of padding, which is not zero)."""
        self._check_input(x)
        if not self.supports_fused(x):
            raise NotImplementedError(f"{type(self).__name__} has no fused quantize for "
                                      f"{x.device} input; check supports_fused() first")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        shape = (*x.shape[:-1], prologue.out_features(x.shape[-1]))
        m, k = flatten_2d(shape)
        if m == 0 or k == 0:
            self._check_shape(shape, m, k)
            return self.make_empty(shape, dtype=x.dtype, device=x.device)
        x2d = x.detach().reshape(m, -1).contiguous()
        if self._whole_blocks(shape, m, k) != (m, k):
            return self.quantize(prologue.apply(x2d).reshape(shape))
        return self._tensor_class()(shape, x.dtype, **self._quantize_2d_fused(x2d, prologue))

    #: Whether :meth:`slice_quantizer` reads the whole tensor first (per-tensor amax).
    slices_need_stats_pass: ClassVar[bool] = False

    def slice_quantizer(self, x2d: torch.Tensor
                        ) -> Callable[[torch.Tensor, str], QuantizedTensor] | None:
        """A function ``f(part, usage)`` quantizing slices of the 2-D ``x2d`` exactly as
        ``quantize(x2d)`` quantizes those elements, or None where the format cannot.

        ``part`` is a row range ``x2d[a:b]`` quantized for ``"rowwise"`` usage or a column
        range ``x2d[:, a:b]`` for ``"columnwise"``, with ``a`` a multiple of 128 (no block
        straddles a slice). Per-tensor formats compute the statistics of the whole tensor
        here, once (recording what ``quantize`` records), and every slice uses them. This
        lets a backward quantize dY a slice at a time and hand each slice to its GEMM
        (see ``lowprec.linear.grad_split``).
        """
        return None

    def gemm_slicer(self, x2d: torch.Tensor) -> Any:
        """A :class:`~lowprec.formats.gemm_slicer.GemmSlicer` of the 2-D ``x2d``: its slices
        quantized as ``quantize(x2d)`` quantizes them, in the form a GEMM consumes at once
        (for formats emulated on bf16 GEMMs whose kernels run, an
        :class:`~lowprec.formats.exact.ExactTensor` of the slice's exact values). None
        where the format has no such path (see ``lowprec.linear.exact_split``)."""
        return None

    def can_gemm_slice(self) -> bool:
        """Whether :meth:`gemm_slicer` is implemented by this format."""
        return type(self).gemm_slicer is not Quantizer.gemm_slicer

    def can_slice(self) -> bool:
        """Whether :meth:`slice_quantizer` is implemented by this format."""
        return type(self).slice_quantizer is not Quantizer.slice_quantizer

    def can_quantize_usage_like(self) -> bool:
        """Whether :meth:`quantize_usage_like` works with this quantizer."""
        return not self.slices_need_stats_pass and self.can_slice()

    def quantize_usage_like(self, x2d: torch.Tensor, like: QuantizedTensor,
                            usage: str) -> QuantizedTensor:
        """The 2-D ``x2d`` quantized for ``usage`` alone, bit for bit the ``usage`` half of one
        ``quantize(x2d)`` with both usages, given ``like``: ``x2d`` already quantized by this
        quantizer for the other usage, whose statistics are reused (no pass over ``x2d`` for
        them). A linear forward uses it to make the weight's columnwise copy after fprop,
        once the rowwise copies are freed. Formats whose blocks hold their own scales
        quantize ``usage`` afresh; per-tensor formats reuse ``like``'s scale.
        """
        if not self.can_quantize_usage_like():
            raise NotImplementedError(f"{type(self).__name__} cannot quantize one usage after "
                                      f"the other; quantize both usages at once")
        return self.slice_quantizer(x2d)(x2d, usage)

    def _slicer(self, fields_of: Callable[[torch.Tensor], dict], tensor_class=None
                ) -> Callable[[torch.Tensor, str], QuantizedTensor]:
        """The ``f(part, usage)`` of :meth:`slice_quantizer` for a ``fields_of(part)``."""
        return lambda part, usage: self._slice_tensor(part, usage, fields_of, tensor_class)

    def _slice_tensor(self, part: torch.Tensor, usage: str,
                      fields_of: Callable[[torch.Tensor], dict],
                      tensor_class=None) -> QuantizedTensor:
        """One slice for :meth:`slice_quantizer`: ``fields_of(part)`` with only ``usage`` on.
        Kernels read the strided slice in place; the reference gets a contiguous copy."""
        from ..kernels import use_kernels
        check_usage(usage)
        self._check_input(part)
        m, k = part.shape
        with self.usages(rowwise=usage == "rowwise", columnwise=usage == "columnwise"):
            self._check_shape(part.shape, m, k)
            fields = fields_of(part if use_kernels(part) else part.contiguous())
        return (tensor_class or self._tensor_class())(part.shape, part.dtype, **fields)

    def update_quantized(self, x: torch.Tensor, qt: QuantizedTensor) -> QuantizedTensor:
        """Quantize ``x`` into the existing buffers of ``qt`` (its held usages), in place."""
        if not isinstance(qt, self._tensor_class()):
            raise TypeError(f"{type(self).__name__}.update_quantized needs a "
                            f"{self._tensor_class().__name__}, got {type(qt).__name__}")
        if tuple(x.shape) != tuple(qt.shape):
            raise ValueError(f"update_quantized: shape {tuple(x.shape)} does not match the "
                             f"quantized tensor's {tuple(qt.shape)}")
        with self.usages(rowwise=qt.has_usage("rowwise"), columnwise=qt.has_usage("columnwise")):
            fresh = self.quantize(x)
        if fresh.metadata() != qt.metadata():
            raise ValueError(f"update_quantized: {qt!r} was made with other settings than {self!r}")
        for name, dst in qt.inner_tensors().items():
            src = getattr(fresh, name)
            if dst is not None:
                dst.copy_(src)
        return qt

    def make_empty(self, shape, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> QuantizedTensor:
        """An uninitialized quantized tensor with this quantizer's usages, for update_quantized."""
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"make_empty: dtype must be one of {HIGH_PRECISION_DTYPES}, "
                            f"got {dtype}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        whole = self._whole_blocks(shape, m, k)
        return self._tensor_of(self._empty_fields(*whole, device), shape, dtype,
                               padded=whole != (m, k))

    # ---- for subclasses -------------------------------------------------------------------
    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.quantize expects a torch.Tensor, "
                            f"got {type(x).__name__}")
        if isinstance(x, QuantizedTensor):
            raise TypeError(f"{type(self).__name__}.quantize got an already quantized "
                            f"{type(x).__name__}; dequantize it first")
        if x.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{type(self).__name__}.quantize expects fp32, bf16 or fp16 input, "
                            f"got {x.dtype}")

    def _check_shape(self, shape, m: int, k: int) -> None:
        """Raise ValueError when the shape does not fit the format's blocks (the paths that
        need whole blocks: parts, slices, fused quantizes; :meth:`quantize` pads)."""

    def _check_partial(self, shape, m: int, k: int) -> None:
        """Raise ValueError where a partial block cannot be quantized as one (a transform
        that mixes the padding into the values)."""

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        """The multiple of M (the product of the leading dimensions) that fills whole blocks
        with these usages: the block length of blocks that run along M (columnwise 1-D
        blocks, 2-D blocks), 1 where M is free. :meth:`quantize` takes any M (a partial
        last block); a GEMM module pads M up to it, since its GEMM kernels take whole
        blocks (``lowprec.linear.plan.row_padding``)."""
        return 1

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        """The multiple of K (the last dimension) that fills whole blocks with these usages:
        the block length of blocks that run along K (rowwise 1-D blocks, 2-D blocks), 1
        where K is free. :meth:`quantize` takes any K; a linear pads its feature dimensions
        up to it with zeros for its GEMM kernels
        (``lowprec.linear.padding.feature_padding``)."""
        return 1

    def _tensor_class(self) -> type[QuantizedTensor]:
        raise NotImplementedError

    def tensor_form(self) -> str:
        """The form of the quantized tensors this quantizer makes, by name (a hybrid's names
        each direction's)."""
        return self._tensor_class().__name__

    def makes_form_of(self, t: QuantizedTensor) -> bool:
        """Whether ``t`` is of the form this quantizer makes: its tensor class (for a hybrid,
        each direction's that ``t`` holds). A weight quantized in another form would have
        its GEMMs read a format the recipe never asked for."""
        return type(t) is self._tensor_class()

    def _quantize_2d(self, x2d: torch.Tensor) -> dict[str, torch.Tensor | Any]:
        """Return the tensor fields for an (M, K) input, for the usages that are on."""
        raise NotImplementedError

    def _quantize_2d_fused(self, x2d: torch.Tensor, prologue) -> dict[str, torch.Tensor | Any]:
        """``_quantize_2d`` of ``prologue(x2d)`` in one kernel (formats that have one)."""
        raise NotImplementedError

    def _empty_fields(self, m: int, k: int, device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._repr_params().items())
        return (f"{type(self).__name__}({params}{', ' if params else ''}"
                f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})")

    def graph_operand(self, t: torch.Tensor, *, grad: bool = False):
        """This quantizer's traced form for a compiled linear (``formats.graph``) over
        tensors like ``t``, or a string saying why it has none (the call then stays one
        opaque op). ``grad``: the operand is the output gradient (its quantize happens in
        the backward). A format gives its form in its own ``graph.py``."""
        return f"{type(self).__name__} has no traced form"

    def _quantizes_as(self, cls) -> bool:
        """Whether this quantizer quantizes as ``cls`` does (a subclass that quantizes
        otherwise has no traced form of ``cls``'s)."""
        return type(self)._quantize_2d is cls._quantize_2d

    def _repr_params(self) -> dict[str, Any]:
        return {}



def _kernels_for(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tensors of this kind (with elements) are quantized by the kernels."""
    from ..kernels import use_kernels
    return bool(shape.numel()) and use_kernels(torch.empty(0, dtype=dtype, device=device))


def _row_major_2d(x: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """``x`` detached as a contiguous (m, k) matrix (stored data is always row-major)."""
    return x.detach() if x.dim() == 2 and x.is_contiguous() else \
        x.detach().reshape(m, k).contiguous()


class _QuantizeFunction(torch.autograd.Function):
    """``quantizer.quantize(x)`` with a straight-through gradient: the gradient of the
    quantized tensor (of its nominal dtype and shape, ``x``'s) goes to ``x`` as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantizer: Quantizer) -> QuantizedTensor:
        return quantizer._quantize_impl(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
