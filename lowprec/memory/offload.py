"""CPU offload of saved activations that keeps quantized tensors quantized.

``torch.autograd.graph.save_on_cpu`` copies each saved tensor into a plain CPU tensor,
which turns a quantized operand into its dequantized values (pinned) or cannot be
done at all (a columnwise-only operand). :class:`cpu_offload` moves a quantized tensor
as its own inner tensors (codes and scales) and rebuilds it on the way back, so the
backward reads the very bytes the forward saved and the gradients are bit-identical.
Weights stay on the device: parameters, and the quantized (or autocast-cast) copies of
weights the quantized linear saves, are marked as such by ``keep_on_device``.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor

#: Attribute on a saved tensor that must not be offloaded (a weight's working copy).
_KEEP_ATTR = "_lowprec_keep_on_device"


def keep_on_device(t: torch.Tensor | None) -> torch.Tensor | None:
    """Mark ``t`` (a weight's quantized or cast copy saved for backward) to stay where it
    is under :class:`cpu_offload`, as the parameter it comes from does."""
    if t is not None:
        setattr(t, _KEEP_ATTR, True)
    return t


def _stays(t: torch.Tensor) -> bool:
    # a view of a parameter too: torch's own linear saves ``weight.t()``
    base = t._base if t._base is not None else t
    return (isinstance(base, torch.nn.Parameter) or bool(getattr(base, "_is_param", False))
            or bool(getattr(t, _KEEP_ATTR, False)))


def _to_cpu(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if pin:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to("cpu", copy=True)


class cpu_offload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it wait in CPU memory.

    Quantized tensors travel as their codes and scales (not dequantized), plain tensors as
    they are; parameters and the weight copies the quantized linear saves stay on the
    device. ``pin_memory=True`` copies into pinned memory (needs CUDA), so the copies can
    overlap compute. ``offloaded_bytes`` counts the bytes moved to the CPU so far.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {pin_memory!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned host memory); pass "
                             "pin_memory=False")
        self.pin_memory = pin_memory
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        return t if _stays(t) else self._move(t)

    def _move(self, t: torch.Tensor):
        if isinstance(t, QuantizedTensor):
            # inner tensors may be quantized themselves (a hybrid's two directions)
            inner = {n: self._move(v) for n, v in t.inner_tensors().items() if v is not None}
            return ("quantized", type(t), tuple(t.shape), t.dtype, t.requires_grad, inner,
                    t.metadata())
        self.offloaded_bytes += t.numel() * t.element_size()
        return ("plain", t.device, _to_cpu(t, self.pin_memory))

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0] == "plain":
            _, device, t = packed
            return t.to(device, non_blocking=self.pin_memory)
        _, cls, shape, dtype, requires_grad, inner, meta = packed
        back = {n: self._unpack(v) for n, v in inner.items()}
        return cls(shape, dtype, requires_grad=requires_grad, **back, **meta)
