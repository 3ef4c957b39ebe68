"""Ready-made ``CustomRecipe`` factories.

The first four mirror the built-in recipes (default arguments) and give
bit-identical results; the rest mix formats. All are module-level
callables, so a ``CustomRecipe`` that uses them pickles.

A factory receives a :class:`~lowprec.QuantizerRole`, or ``None`` for an
unset boundary slot (never used for compute); these return an
``IdentityQuantizer`` there.
"""

from __future__ import annotations

import torch

from ..formats import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from .roles import BACKWARD_TENSOR_TYPES, slot_tensor_type

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_GRAD_TYPES = BACKWARD_TENSOR_TYPES


def _tensor_type(role) -> str:
    """The tensor type the built-in rules read for ``role`` (``slot_tensor_type``; a factory
    sees no slot index, so an unknown type counts as its direction's first slot)."""
    return slot_tensor_type(role, "backward" if role.is_gradient else "forward", 0)


# Each mirror below gives what ``state.builtin_quantizer`` gives the default recipe
# (tests/recipe/test_role_dispatch.py checks it); the factories import no recipe class,
# since ``recipes`` imports this module.
def fp8_current_scaling_factory(role):
    """Mirror of ``Float8CurrentScaling()``: E4M3 forward, E5M2 gradients."""
    if role is None:
        return IdentityQuantizer()
    return Float8CurrentScalingQuantizer(E5M2 if _tensor_type(role) in _GRAD_TYPES else E4M3)


def fp8_block_scaling_factory(role):
    """Mirror of ``Float8BlockScaling()``: 128x128 weights, 1x128 inputs and gradients."""
    if role is None:
        return IdentityQuantizer()
    dim = 2 if _tensor_type(role) == "weight" else 1
    return Float8BlockQuantizer(E4M3, block_scaling_dim=dim, force_pow_2_scales=True)


def mxfp8_factory(role):
    """Mirror of ``MXFP8BlockScaling()``: E4M3, 1x32 blocks, every role."""
    if role is None:
        return IdentityQuantizer()
    return MXFP8Quantizer(E4M3)


def nvfp4_factory(role):
    """Mirror of ``NVFP4BlockScaling()``: 16x16 weights; RHT on the columnwise side of
    everything else; stochastic rounding for gradients (``grad_output``, ``grad_input``)."""
    if role is None:
        return IdentityQuantizer()
    ttype = _tensor_type(role)
    if ttype in _GRAD_TYPES:
        return NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    if ttype == "weight":
        return NVFP4Quantizer(with_2d_quantization=True)
    return NVFP4Quantizer(with_rht=True)


def mxfp8_fwd_nvfp4_bwd_factory(role):
    """MXFP8 for the forward GEMM, NVFP4 for both backward GEMMs.

    Inputs and weights are hybrids: MXFP8 rowwise (fprop), NVFP4 columnwise
    (dgrad's W, wgrad's X, with RHT on the input as in ``NVFP4BlockScaling``);
    gradients are NVFP4 with RHT and stochastic rounding. Every backward GEMM
    therefore pairs two NVFP4 operands.
    """
    if role is None:
        return IdentityQuantizer()
    if role.tensor_type in _GRAD_TYPES:
        return NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    if role.tensor_type == "weight":
        return HybridQuantizer(MXFP8Quantizer(E4M3), NVFP4Quantizer(with_2d_quantization=True))
    if role.tensor_type == "input":
        return HybridQuantizer(MXFP8Quantizer(E4M3), NVFP4Quantizer(with_rht=True))
    return MXFP8Quantizer(E4M3)


def fp8_row_mxfp8_col_factory(role):
    """Per-tensor FP8 (current scaling) rowwise, MXFP8 columnwise, for every forward tensor;
    MXFP8 gradients. dgrad and wgrad then run on MXFP8 operands only."""
    if role is None:
        return IdentityQuantizer()
    if role.tensor_type in _GRAD_TYPES:
        return MXFP8Quantizer(E4M3)
    return HybridQuantizer(Float8CurrentScalingQuantizer(E4M3), MXFP8Quantizer(E4M3))


def fp8_block_hybrid_factory(role):
    """Per-tensor FP8 (current scaling, E4M3) rowwise and 1x128 FP8 blocks columnwise for
    inputs and weights; E5M2 per-tensor rowwise and MXFP8 columnwise for output gradients;
    every other slot in high precision. Each backward GEMM then meets two formats."""
    if role is None or role.tensor_type not in ("input", "weight", "grad_output"):
        return IdentityQuantizer()
    if role.tensor_type == "grad_output":
        return HybridQuantizer(Float8CurrentScalingQuantizer(E5M2), MXFP8Quantizer())
    return HybridQuantizer(Float8CurrentScalingQuantizer(),
                           Float8BlockQuantizer(block_scaling_dim=1))


class NVFP4ExceptLayers:
    """NVFP4 everywhere (as :func:`nvfp4_factory`) except layers whose name is in
    ``fp8_layers`` (e.g. the output head), which get FP8 current scaling."""

    def __init__(self, fp8_layers=("lm_head",)) -> None:
        self.fp8_layers = tuple(fp8_layers)

    def __call__(self, role):
        if role is not None and role.name in self.fp8_layers:
            return fp8_current_scaling_factory(role)
        return nvfp4_factory(role)

    def __eq__(self, other) -> bool:
        # Equal factories keep a module's recipe state when an equal recipe is rebuilt.
        return isinstance(other, NVFP4ExceptLayers) and other.fp8_layers == self.fp8_layers

    def __hash__(self) -> int:
        return hash(self.fp8_layers)

    def __repr__(self) -> str:
        return f"NVFP4ExceptLayers(fp8_layers={self.fp8_layers!r})"
