"""Quantizer roles: what a tensor slot *is*, so recipes decide by meaning, not position."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD_TENSOR_TYPES = ("input", "weight", "output")
BACKWARD_TENSOR_TYPES = ("grad_output", "grad_input")


@dataclass(frozen=True)
class QuantizerRole:
    """Names one quantizer slot.

    ``module_type`` is e.g. ``"linear"`` or ``"grouped_linear"``,
    ``tensor_type`` one of ``input``, ``weight``, ``output``,
    ``grad_output``, ``grad_input``, and ``name`` the layer's name
    (``"<name>.fc1"`` / ``"<name>.fc2"`` inside LayerNormMLP).
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    @property
    def is_forward(self) -> bool:
        return self.tensor_type in FORWARD_TENSOR_TYPES

    @property
    def is_gradient(self) -> bool:
        return self.tensor_type in BACKWARD_TENSOR_TYPES


def gemm_roles(module_type: str, name: str, *, fwd: bool, output_role=None,
               grad_input_role=None) -> list:
    """The slots of one GEMM: forward [input, weight, output], backward [grad_output, grad_input].

    Boundary slots (``output``, ``grad_input``) are ``None`` unless a role is given.
    """
    if fwd:
        return [QuantizerRole(module_type, "input", name),
                QuantizerRole(module_type, "weight", name), output_role]
    return [QuantizerRole(module_type, "grad_output", name), grad_input_role]


def check_num_quantizers(module, fwd: bool, num_quantizers: int | None, roles: list) -> list:
    """Validate a caller's expected slot count against the module's roles."""
    if num_quantizers is not None and num_quantizers != len(roles):
        raise ValueError(f"{type(module).__name__} has {len(roles)} "
                         f"{'forward' if fwd else 'backward'} "
                         f"quantizer slots, asked for {num_quantizers}")
    return roles
