"""NVFP4Quantizer: 1x16 (or 16x16) E2M1 blocks, optional RHT and stochastic rounding."""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ..base import Quantizer, check_bool_option, check_divisible, columnwise_from_backward
from ..exact import ExactTensor
from ..gemm_slicer import GemmSlicer
from ..rht import rht_forward
from . import graph
from .draws import draw_key, uniforms
from .reference import BLOCK, SCALE_DTYPE, finite_amax, global_encode_scale, quantize_matrix
from .tensor import NVFP4Tensor

#: elements the reference quantize rounds at once outside a graph (row chunks of a
#: direction; see ``NVFP4Quantizer._reference_direction``)
REFERENCE_CHUNK_ELEMENTS = 1 << 22


def _draws(key, offset: int, rows: int, cols: int, like: torch.Tensor):
    """The (rows, cols) uniforms of ``key`` from row-major index ``offset`` on, on
    ``like``'s device (None without a key: nearest-even rounding)."""
    return None if key is None else uniforms(key, rows, cols, offset, like.device)


class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 values, E4M3 decode scale per 16 elements, fp32 global encode scale.

    * ``with_rht``: the columnwise (wgrad) representation is quantized after a
      16-point random Hadamard transform along M (see :mod:`..rht`); the
      rowwise one never is.
    * ``with_2d_quantization``: 16x16 blocks instead of 1x16 (both
      dimensions must then divide by 16 for either usage).
    * ``stochastic_rounding``: E2M1 codes are rounded up with probability
      ``(|v| - lo) / (hi - lo)``. Each quantized direction draws one key from
      ``generator`` (``None``: torch's default generator of the input's
      device, so ``torch.manual_seed`` makes results repeatable), the rowwise
      direction first; the per-element uniforms are a counter-based function
      of that key (:mod:`.draws`), computed in registers by the kernels.

    The three flags must be bools (``True``/``False``, numpy bools too), else
    ValueError. ``copy()`` shares the generator object (draws advance one state);
    ``copy.deepcopy`` and pickling give a new generator with an equal state.
    See :mod:`.reference` for the exact numerics.
    """

    format_name = "nvfp4"
    keeps_exact_bf16 = True
    exact_tensor_type = ExactTensor

    def __init__(self, *, with_rht: bool = False, with_2d_quantization: bool = False,
                 stochastic_rounding: bool = False,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"NVFP4Quantizer: generator must be a torch.Generator or None, got "
                            f"{type(generator).__name__}")
        owner = type(self).__name__
        self.with_rht = check_bool_option(owner, "with_rht", with_rht)
        self.with_2d_quantization = check_bool_option(owner, "with_2d_quantization",
                                                      with_2d_quantization)
        self.stochastic_rounding = check_bool_option(owner, "stochastic_rounding",
                                                     stochastic_rounding)
        self.generator = generator

    def _tensor_class(self):
        return NVFP4Tensor

    # ---- pickling: a torch.Generator does not pickle, its state does ----------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        g = state.get("generator")
        if g is not None:
            state["generator"] = (str(g.device), g.get_state())
        return state

    def __setstate__(self, state):
        state = dict(state)
        g = state.get("generator")
        if g is not None:
            device, rng_state = g
            gen = torch.Generator(device=device)
            gen.set_state(rng_state)
            state["generator"] = gen
        self.__dict__.update(state)

    def __copy__(self):
        # Shallow: the copy draws from the same generator object (as Transformer Engine).
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    # ---- shapes ---------------------------------------------------------------------------
    def _check_shape(self, shape, m, k):
        if self.with_2d_quantization:
            check_divisible(shape, m, k, row_block=BLOCK, col_block=BLOCK,
                            what="NVFP4 2D (16x16 block) quantization")
            return
        if self.rowwise_usage:
            check_divisible(shape, m, k, row_block=BLOCK, col_block=1,
                            what="NVFP4 rowwise quantization (1x16 blocks)")
        if self.columnwise_usage:
            check_divisible(shape, m, k, row_block=1, col_block=BLOCK,
                            what="NVFP4 columnwise quantization (16x1 blocks)")

    def _check_partial(self, shape, m, k):
        # the transform mixes a 16-tile's values: a zero-padded partial tile along M would
        # spread its padding into the stored codes, which then could not be cut back
        if self.with_rht and self.columnwise_usage and m % BLOCK:
            raise ValueError(
                f"NVFP4 with the RHT needs whole 16-row tiles along M for its columnwise "
                f"(wgrad) data; got shape {tuple(shape)} (M={m}). Pad M to a multiple of "
                f"{BLOCK}, or quantize without the RHT or without columnwise usage")

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return BLOCK if (self.with_2d_quantization or columnwise) else 1

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return BLOCK if (self.with_2d_quantization or rowwise) else 1

    # ---- quantize -------------------------------------------------------------------------
    def _sr_key(self, device) -> torch.Tensor | None:
        if not self.stochastic_rounding:
            return None
        return draw_key(self.generator, device)

    def _kernel_keys(self, x2d):
        # Same keys, same order as the reference path: rowwise first.
        key_row = self._sr_key(x2d.device) if self.rowwise_usage else None
        key_col = self._sr_key(x2d.device) if self.columnwise_usage else None
        return key_row, key_col

    def _quantize_exact_2d(self, x2d):
        from .launch import quantize_2d_exact
        key_row, key_col = self._kernel_keys(x2d)
        return quantize_2d_exact(x2d, rowwise=self.rowwise_usage,
                                 columnwise=self.columnwise_usage, with_rht=self.with_rht,
                                 two_d=self.with_2d_quantization, key_row=key_row,
                                 key_col=key_col)

    def gemm_slicer(self, x2d):
        # A slice takes the whole tensor's global scales and draws the whole tensor's
        # uniforms at its own indices; both are fixed here, for both directions, as a
        # quantize with both usages fixes them (the keys rowwise first).
        m, k = x2d.shape
        scales = self._global_scales(x2d)
        keys = (self._sr_key(x2d.device), self._sr_key(x2d.device))

        def fields(part, usage, start, exact):
            rowwise = usage == "rowwise"
            offset = start * (k if rowwise else m)
            i = 0 if rowwise else 1
            if exact:  # only where the kernels run (GemmSlicer)
                from ..exact import ExactTensor
                from .launch import nvfp4_exact_slice
                values = nvfp4_exact_slice(part, scales[i], keys[i], offset, rowwise,
                                           self.with_rht, self.with_2d_quantization)
                return ExactTensor.one_usage_fields(usage, values, scales[i],
                                                    source_format="nvfp4", rht=self.with_rht)
            if use_kernels(part):
                from .launch import quantize_2d
                return {"with_rht": self.with_rht,
                        "with_2d_quantization": self.with_2d_quantization,
                        **quantize_2d(part, rowwise=rowwise, columnwise=not rowwise,
                                      with_rht=self.with_rht, two_d=self.with_2d_quantization,
                                      key_row=keys[0] if rowwise else None,
                                      key_col=None if rowwise else keys[1], scales=scales,
                                      offsets=(offset, 0) if rowwise else (0, offset))}
            return self._reference_fields(part, rowwise, not rowwise, keys, scales,
                                          (offset, offset))

        return GemmSlicer(self, x2d, lambda p, u, a: fields(p, u, a, False),
                          lambda p, u, a: fields(p, u, a, True))

    def can_quantize_part(self) -> bool:
        # A transformed (RHT) or stochastically rounded direction depends on more than the
        # part and the whole tensor's amax (the draws on the part's place in the whole).
        return not (self.stochastic_rounding or (self.with_rht and self.columnwise_usage))

    def part_statistic(self, part):
        # the finite amax as int32 bits (finite non-negative floats order as their bits do)
        return finite_amax(part).view(torch.int32)

    def _part_fields(self, part, statistic):
        if statistic is None:
            raise ValueError("NVFP4Quantizer.quantize_part needs the statistic (the maximum "
                             "of part_statistic over every part)")
        s = global_encode_scale(statistic.view(torch.float32))
        scales = (s, s.clone())
        if use_kernels(part):
            from .launch import quantize_2d
            return {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization,
                    **quantize_2d(part, rowwise=self.rowwise_usage,
                                  columnwise=self.columnwise_usage, with_rht=self.with_rht,
                                  two_d=self.with_2d_quantization, scales=scales)}
        return self._reference_fields(part, self.rowwise_usage, self.columnwise_usage,
                                      (None, None), scales)

    def _global_scales(self, x2d) -> tuple[torch.Tensor, torch.Tensor]:
        """(rowwise S, columnwise S) of the whole 2-D x2d, (1,) fp32 each."""
        if use_kernels(x2d):
            from .launch import nvfp4_global_scales
            return nvfp4_global_scales(x2d, True, True, self.with_rht)
        x = x2d.to(torch.float32)
        xt = rht_forward(x.t().contiguous()) if self.with_rht else x
        return global_encode_scale(finite_amax(x)), global_encode_scale(finite_amax(xt))

    def _quantize_2d(self, x2d):
        if use_kernels(x2d):
            from .launch import quantize_2d
            key_row, key_col = self._kernel_keys(x2d)
            return {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization,
                    **quantize_2d(x2d, rowwise=self.rowwise_usage,
                                  columnwise=self.columnwise_usage, with_rht=self.with_rht,
                                  two_d=self.with_2d_quantization, key_row=key_row,
                                  key_col=key_col, exact=self.exact_usages())}
        return self._reference_fields(x2d, self.rowwise_usage, self.columnwise_usage,
                                      self._kernel_keys(x2d))

    def _reference_fields(self, x2d, rowwise, columnwise, keys, scales=(None, None),
                          offsets=(0, 0)) -> dict:
        """NVFP4Tensor fields through :mod:`.reference`: ``keys`` the (rowwise, columnwise)
        stochastic-rounding keys (None: nearest-even); ``scales`` / ``offsets`` those of a
        slice (see ``launch.nvfp4_quantize``)."""
        x = x2d.to(torch.float32)
        fields = {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization}
        if rowwise:
            data, scale, s = self._reference_direction(x, keys[0], offsets[0], scales[0])
            fields.update(rowwise_data=data, rowwise_scale=scale, rowwise_global=s)
        if columnwise:
            xt = x.t().contiguous()
            if self.with_rht:
                xt = rht_forward(xt)
            data, scale, s = self._reference_direction(xt, keys[1], offsets[1], scales[1])
            fields.update(columnwise_data=data, columnwise_scale=scale, columnwise_global=s)
        return fields

    def _reference_direction(self, x, key, offset: int, s):
        """``reference.quantize_matrix`` of the fp32 (R, C) ``x`` with the draws of ``key``
        from row-major index ``offset`` on (None: nearest-even). Outside a graph, in row
        chunks of about :data:`REFERENCE_CHUNK_ELEMENTS` (whole 16-row blocks) with the
        whole matrix's encode scale (its amax taken chunk by chunk too): the temporaries
        (the draws' int64 hash among them) then stay a few chunks in size instead of
        several times the matrix.
        Blocks never cross a chunk and each draw depends on its index alone, so the codes
        and scales are the one-shot ones."""
        rows, cols = x.shape
        two_d = self.with_2d_quantization
        step = max(BLOCK, REFERENCE_CHUNK_ELEMENTS // max(cols, 1) // BLOCK * BLOCK)
        if step >= rows or torch.compiler.is_compiling():
            return quantize_matrix(x, two_d=two_d, rand=_draws(key, offset, rows, cols, x),
                                   s=s)
        chunks = range(0, rows, step)
        if s is None:  # a max is exact in any grouping: the whole matrix's, by chunks
            s = global_encode_scale(torch.cat([finite_amax(x[a:a + step]) for a in chunks])
                                    .amax().reshape(1))
        parts = [quantize_matrix(x[a:a + step], two_d=two_d, s=s,
                                 rand=_draws(key, offset + a * cols, min(step, rows - a),
                                             cols, x))
                 for a in chunks]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), s

    def _empty_fields(self, m, k, device):
        def direction(rows, cols):
            srows = rows // BLOCK if self.with_2d_quantization else rows
            return (torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),
                    torch.empty(srows, cols // BLOCK, dtype=SCALE_DTYPE, device=device),
                    torch.ones(1, dtype=torch.float32, device=device))

        fields = {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization}
        for usage, on, dims in (("rowwise", self.rowwise_usage, (m, k)),
                                ("columnwise", self.columnwise_usage, (k, m))):
            if on:
                data, scale, s = direction(*dims)
                fields.update({f"{usage}_data": data, f"{usage}_scale": scale,
                               f"{usage}_global": s})
        return fields

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(NVFP4Quantizer):
            return super().graph_operand(t, grad=grad)
        if self.stochastic_rounding and self.generator is not None:
            # a graph op draws from the default generator (``compiled.draw_keys``)
            return ("NVFP4 stochastic rounding traces drawing from torch's default "
                    "generator only")
        kernel = use_kernels(t)
        if t.device.type == "cuda" and not kernel:
            return "NVFP4 on CUDA traces with its Triton kernels only"
        if isinstance(t, NVFP4Tensor):  # a weight that arrives quantized: read as it is
            two_d = t.with_2d_quantization
            later = not two_d and columnwise_from_backward(t)
            if (t.rowwise_data is None or t.with_rht or t.dim() != 2
                    or t.shape[0] % BLOCK or t.shape[1] % BLOCK
                    or not (two_d or later or t.columnwise_data is not None)):
                return ("an NVFP4 weight that is not whole blocks without the Hadamard "
                        "transform, with its columnwise codes where they do not derive")
            return graph.GivenFP4(kernel=kernel, two_d=two_d, columnwise_in_backward=later)
        return graph.FP4Blocks(rht=self.with_rht, two_d=self.with_2d_quantization,
                               sr=self.stochastic_rounding, kernel=kernel)

    def _repr_params(self):
        return {"with_rht": self.with_rht, "with_2d_quantization": self.with_2d_quantization,
                "stochastic_rounding": self.stochastic_rounding,
                "generator": None if self.generator is None else str(self.generator.device)}
