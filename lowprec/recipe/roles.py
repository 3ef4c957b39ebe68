"""Quantizer roles: what a tensor slot *is*, so recipes decide by meaning, not position."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD_TENSOR_TYPES = ("input", "weight", "output")
BACKWARD_TENSOR_TYPES = ("grad_output", "grad_input")
#: The tensor types the built-in recipes' rules know.
KNOWN_TENSOR_TYPES = FORWARD_TENSOR_TYPES + BACKWARD_TENSOR_TYPES


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


def slot_tensor_type(role: "QuantizerRole | None", mode: str, index: int) -> str:
    """The tensor type a built-in recipe gives slot ``index`` of a ``mode`` (``"forward"`` or
    ``"backward"``) recipe state: the role's own where it is one of
    :data:`KNOWN_TENSOR_TYPES`; for a ``None`` role (an unset boundary slot) or one of
    another tensor type (``""``, ``"qkv"``), the slot's place in the usual layout, forward
    ``[input, weight, output, ...]``, backward ``[grad_output, grad_input, ...]``, as
    Transformer Engine's recipe states fall back. Every built-in rule reads this."""
    if role is not None and role.tensor_type in KNOWN_TENSOR_TYPES:
        return role.tensor_type
    if mode == "forward":
        return FORWARD_TENSOR_TYPES[index % len(FORWARD_TENSOR_TYPES)]
    if mode == "backward":
        return BACKWARD_TENSOR_TYPES[index % len(BACKWARD_TENSOR_TYPES)]
    raise ValueError(f"mode={mode!r}; use 'forward' or 'backward'")
