"""A module's delayed-scaling state as one uint8 tensor (its ``_extra_state``).

``state_dict()`` must hold only tensors: safetensors, ``save_pretrained`` and
huggingface_hub's shard splitting read every value as a tensor. The state
``{mode: {name: fp32 tensor}}`` is therefore packed into bytes: an int64 header
(magic, version, entry count, then per entry its mode, name, rank and two
dimensions) followed by each entry's fp32 values in order. The layout depends
only on the shapes, so two modules with the same recipe and roles always have
extra states of the same size (what ``torch.distributed.checkpoint`` needs to
load one into the other in place). A module without delayed-scaling state has an
empty tensor.
"""

from __future__ import annotations

import torch

_MAGIC = 0x6C6F7770  # "lowp"
_VERSION = 1
_MODES = ("forward", "backward")
_NAMES = ("scale", "amax_history", "amax_current")
_ENTRY = 5  # mode, name, ndim, dim0, dim1


def encode(states: dict) -> torch.Tensor:
    """``{mode: {name: tensor}}`` as a CPU uint8 tensor (empty for no state)."""
    entries = [(mode, name, t) for mode, sd in states.items() for name, t in sd.items()]
    if not entries:
        return torch.empty(0, dtype=torch.uint8)
    header = [_MAGIC, _VERSION, len(entries)]
    payload = []
    for mode, name, t in entries:
        if mode not in _MODES or name not in _NAMES or t.dtype != torch.float32 or t.dim() > 2:
            raise ValueError(f"cannot serialize delayed-scaling entry {mode}/{name} "
                             f"({t.dtype}, shape {tuple(t.shape)})")
        dims = list(t.shape) + [0] * (2 - t.dim())
        header += [_MODES.index(mode), _NAMES.index(name), t.dim(), *dims]
        # a state on the meta device has no values: zeros of its size
        t = torch.zeros(t.shape) if t.is_meta else t.detach().to("cpu", copy=True)
        payload.append(t.reshape(-1))
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    body = torch.cat(payload).view(torch.uint8)
    return torch.cat([head, body])


def decode(data: torch.Tensor) -> dict:
    """The ``{mode: {name: tensor}}`` that ``encode`` packed into ``data`` (CPU tensors)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"a lowprec module's _extra_state is a 1-D uint8 tensor, got "
                        f"{type(data).__name__}"
                        + (f" {data.dtype} of shape {tuple(data.shape)}"
                           if isinstance(data, torch.Tensor) else ""))
    if data.numel() == 0:
        return {}
    raw = data.detach().cpu().contiguous()
    words = lambda start, n: raw[8 * start:8 * (start + n)].view(torch.int64).tolist()  # noqa: E731
    if raw.numel() < 24 or words(0, 2) != [_MAGIC, _VERSION]:
        raise ValueError("this _extra_state was not written by lowprec (bad header)")
    n = words(2, 1)[0]
    meta = words(3, n * _ENTRY)
    offset = 8 * (3 + n * _ENTRY)
    out: dict = {}
    for i in range(n):
        mode, name, ndim, d0, d1 = meta[_ENTRY * i:_ENTRY * (i + 1)]
        shape = [d0, d1][:ndim]
        size = 4 * (d0 if ndim == 1 else d0 * d1 if ndim == 2 else 1)
        t = raw[offset:offset + size].clone().view(torch.float32).reshape(shape)
        out.setdefault(_MODES[mode], {})[_NAMES[name]] = t
        offset += size
    if offset != raw.numel():
        raise ValueError(f"this _extra_state has {raw.numel()} bytes, its header describes "
                         f"{offset}")
    return out
