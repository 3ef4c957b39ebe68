"""A module's extra state as one uint8 tensor (its ``_extra_state``): the delayed-scaling
state, and the exact bytes of its quantized weights. ``ExtraStateMixin`` is
``LowprecModule``'s side of it: ``get_extra_state``/``set_extra_state``, and
``scaling_state()``, the delayed-scaling state read as a ``ScalingStateDict``.

``state_dict()`` must hold only tensors: safetensors, ``save_pretrained`` and
huggingface_hub's shard splitting read every value as a tensor. The state
``{mode: {name: fp32 tensor}}`` is therefore packed into bytes: an int64 header
(magic, version, entry count, then per entry its mode, name, rank and two
dimensions) followed by each entry's fp32 values in order. The layout depends
only on the shapes, so two modules with the same recipe and roles always have
extra states of the same size (what ``torch.distributed.checkpoint`` needs to
load one into the other in place). A module without delayed-scaling state and
without quantized weights has an empty tensor.

A module with quantized weights (``quantized_model_init``) writes version 2: the
same header and state, then one more header word, the length of a UTF-8 JSON
description of each quantized weight (its format class, metadata, shape and every
inner tensor's dtype and shape, in the format's ``_inner`` order), then that JSON,
then the raw bytes of every inner tensor in that order. Its state dict holds the
weight itself as plain high-precision values (see ``LowprecModule``); the bytes here
let a load restore the quantized weight exactly where re-quantizing those values
would not give the same bytes (``weight_from_bytes``). Version 1 (delayed-scaling
state only) is still written when a module has no quantized weight.
"""

from __future__ import annotations

import json

import torch

from ..formats import QuantizedTensor

_MAGIC = 0x6C6F7770  # "lowp"
_VERSION = 1
_VERSION_WEIGHTS = 2
_MODES = ("forward", "backward")
_NAMES = ("scale", "amax_history", "amax_current")
_ENTRY = 5  # mode, name, ndim, dim0, dim1


# ---- quantized weights: description and bytes -----------------------------------------------
def _meta_value(v):
    return v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)


def describe(qt: QuantizedTensor) -> dict:
    """A JSON-able description of ``qt``'s layout: format class, metadata, nominal shape and
    each inner tensor's dtype and shape (a nested quantized tensor described in turn), in
    ``_inner`` order. Two tensors whose descriptions are equal hold the same fields; the
    nominal dtype is left out (it changes no byte)."""
    inner = []
    for name, t in qt.inner_tensors().items():
        if t is None:
            spec = None
        elif isinstance(t, QuantizedTensor):
            spec = {"quantized": describe(t)}
        else:
            spec = {"dtype": str(t.dtype), "shape": list(t.shape)}
        inner.append([name, spec])
    return {"class": type(qt).__name__,
            "meta": {k: _meta_value(v) for k, v in qt.metadata().items()},
            "shape": list(qt.shape), "inner": inner}


def _pieces(qt: QuantizedTensor) -> list[torch.Tensor]:
    """Every plain inner tensor of ``qt`` (nested ones included), in ``describe`` order."""
    out = []
    for t in qt.inner_tensors().values():
        if isinstance(t, QuantizedTensor):
            out += _pieces(t)
        elif t is not None:
            out.append(t)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a flat CPU uint8 tensor (zeros of its size on the meta device)."""
    if t.is_meta:
        return torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _nbytes(spec: dict) -> int:
    dtype = _DTYPES.get(spec["dtype"])
    if dtype is None:
        raise ValueError(f"this _extra_state holds a quantized weight's tensor of dtype "
                         f"{spec['dtype']}, which this torch does not have")
    n = 1
    for s in spec["shape"]:
        n *= s
    return n * dtype.itemsize


def _specs(desc: dict) -> list[dict]:
    """The plain inner tensors' specs of a description, in payload order."""
    out = []
    for _, spec in desc["inner"]:
        if spec is None:
            continue
        out += _specs(spec["quantized"]) if "quantized" in spec else [spec]
    return out


_DTYPES = {str(d): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
                                  "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)))}


def weight_from_bytes(entry: tuple[dict, list[torch.Tensor]], template: QuantizedTensor,
                      device=None) -> QuantizedTensor | None:
    """The quantized tensor a ``decode_weights`` entry holds, built like ``template`` (a
    module's quantized weight: its class, metadata and nominal dtype) on ``device`` (default
    the CPU); None when the entry describes another layout (another format, shape or set of
    usages)."""
    desc, raw = entry
    if describe(template) != desc:
        return None
    pieces = iter(raw)

    def build(tmpl: QuantizedTensor) -> QuantizedTensor:
        inner = {}
        for name, t in tmpl.inner_tensors().items():
            if t is None:
                inner[name] = None
            elif isinstance(t, QuantizedTensor):
                inner[name] = build(t)
            else:
                inner[name] = next(pieces).view(t.dtype).reshape(t.shape).to(device)
        return type(tmpl)(tmpl.shape, tmpl.dtype, **inner, **tmpl.metadata())

    return build(template)


# ---- the tensor -------------------------------------------------------------------------------
def encode(states: dict, weights: dict | None = None) -> torch.Tensor:
    """``{mode: {name: tensor}}`` (and ``{param name: quantized weight}``) as a CPU uint8
    tensor (empty for no state and no weights)."""
    entries = [(mode, name, t) for mode, sd in states.items() for name, t in sd.items()]
    weights = dict(weights or {})
    if not entries and not weights:
        return torch.empty(0, dtype=torch.uint8)
    header = [_MAGIC, _VERSION_WEIGHTS if weights else _VERSION, len(entries)]
    payload = []
    for mode, name, t in entries:
        if mode not in _MODES or name not in _NAMES or t.dtype != torch.float32 or t.dim() > 2:
            raise ValueError(f"cannot serialize delayed-scaling entry {mode}/{name} "
                             f"({t.dtype}, shape {tuple(t.shape)})")
        dims = list(t.shape) + [0] * (2 - t.dim())
        header += [_MODES.index(mode), _NAMES.index(name), t.dim(), *dims]
        # a state on the meta device has no values: zeros of its size
        t = torch.zeros(t.shape) if t.is_meta else t.detach().to("cpu", copy=True)
        payload.append(t.reshape(-1).view(torch.uint8))
    if weights:
        desc = json.dumps([[name, describe(w)] for name, w in weights.items()],
                          separators=(",", ":")).encode()
        header.append(len(desc))
        payload.append(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
        for w in weights.values():
            payload += [_as_bytes(t) for t in _pieces(w)]
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, *payload])


def _parse(data: torch.Tensor) -> tuple[dict, dict]:
    """(delayed-scaling state, ``{param name: (description, [raw uint8 pieces])}``)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"a lowprec module's _extra_state is a 1-D uint8 tensor, got "
                        f"{type(data).__name__}"
                        + (f" {data.dtype} of shape {tuple(data.shape)}"
                           if isinstance(data, torch.Tensor) else ""))
    if data.numel() == 0:
        return {}, {}
    raw = data.detach().cpu().contiguous()
    words = lambda start, n: raw[8 * start:8 * (start + n)].view(torch.int64).tolist()  # noqa: E731
    if raw.numel() < 24 or words(0, 1) != [_MAGIC]:
        raise ValueError("this _extra_state was not written by lowprec (bad header)")
    version = words(1, 1)[0]
    if version not in (_VERSION, _VERSION_WEIGHTS):
        raise ValueError(f"this _extra_state has format version {version}; this lowprec reads "
                         f"versions {_VERSION} and {_VERSION_WEIGHTS} (written by a newer "
                         f"lowprec?)")
    n = words(2, 1)[0]
    meta = words(3, n * _ENTRY)
    head = 3 + n * _ENTRY + (version == _VERSION_WEIGHTS)
    desc_len = words(3 + n * _ENTRY, 1)[0] if version == _VERSION_WEIGHTS else 0
    offset = 8 * head
    out: dict = {}
    for i in range(n):
        mode, name, ndim, d0, d1 = meta[_ENTRY * i:_ENTRY * (i + 1)]
        shape = [d0, d1][:ndim]
        size = 4 * (d0 if ndim == 1 else d0 * d1 if ndim == 2 else 1)
        t = raw[offset:offset + size].clone().view(torch.float32).reshape(shape)
        out.setdefault(_MODES[mode], {})[_NAMES[name]] = t
        offset += size
    weights: dict = {}
    if version == _VERSION_WEIGHTS:
        descs = json.loads(bytes(raw[offset:offset + desc_len].tolist()).decode())
        offset += desc_len
        for name, desc in descs:
            pieces = []
            for spec in _specs(desc):
                size = _nbytes(spec)
                pieces.append(raw[offset:offset + size].clone())
                offset += size
            weights[name] = (desc, pieces)
    if offset != raw.numel():
        raise ValueError(f"this _extra_state has {raw.numel()} bytes, its header describes "
                         f"{offset}")
    return out, weights


def decode(data: torch.Tensor) -> dict:
    """The delayed-scaling state ``{mode: {name: tensor}}`` that ``encode`` packed into
    ``data`` (CPU tensors)."""
    return _parse(data)[0]


def decode_weights(data: torch.Tensor) -> dict:
    """The quantized weights that ``encode`` packed into ``data``: ``{param name:
    (description, raw pieces)}``, for :func:`weight_from_bytes`; empty for version 1."""
    return _parse(data)[1]


# ---- the module's side ------------------------------------------------------------------------
class ScalingStateDict:
    """A module's delayed-scaling state, ``{mode: {name: tensor}}``, read like a dict
    (``LowprecModule.scaling_state()``), compared by value. State dicts hold it packed in
    a tensor (``lowprec.modules.extra_state``); ``set_extra_state`` still takes one, as
    older checkpoints stored it."""

    def __init__(self, states: dict | None = None) -> None:
        self.states = dict(states or {})

    def __getitem__(self, mode):
        return self.states[mode]

    def __contains__(self, mode) -> bool:
        return mode in self.states

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def keys(self):
        return self.states.keys()

    def items(self):
        return self.states.items()

    def values(self):
        return self.states.values()

    def __eq__(self, other) -> bool:
        other = other.states if isinstance(other, ScalingStateDict) else other
        return isinstance(other, dict) and other.keys() == self.states.keys() and all(
            other[m].keys() == sd.keys() and all(torch.equal(other[m][k], v) for k, v in sd.items())
            for m, sd in self.states.items())

    def __repr__(self) -> str:
        return f"ScalingStateDict({sorted(self.states)})"


# Pickles name the class by module path, and the ``torch.load(weights_only=True)`` allowlist
# matches that path: it stays ``lowprec.modules.base`` (which re-exports it), the path that
# checkpoints holding a ScalingStateDict name.
ScalingStateDict.__module__ = "lowprec.modules.base"
torch.serialization.add_safe_globals([ScalingStateDict])


class ExtraStateMixin:
    """The extra-state methods of ``LowprecModule``: its delayed-scaling state read as a
    ``ScalingStateDict``, and its ``_extra_state`` tensor written and loaded."""

    def scaling_state(self) -> ScalingStateDict:
        """The delayed-scaling state (scales, amax histories, amaxes recorded since the last
        update) per mode, as the module holds it; empty before its first delayed-scaling
        forward."""
        return ScalingStateDict({mode: state.delayed.state_dict()
                                 for mode, state in self._kept_delayed().items()
                                 if state is not None})

    def get_extra_state(self) -> torch.Tensor:
        # a tensor, so that tensor-only formats (safetensors, save_pretrained) take it; with
        # the exact bytes of the quantized weights (see _save_to_state_dict)
        return encode(self.scaling_state().states, self._held_quantized_weights())

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor):
            state = decode(state)
        elif isinstance(state, ScalingStateDict):
            state = state.states
        if not state:
            return
        pending = {}
        for mode, sd in state.items():
            current = self._kept_delayed().get(mode)
            # a state on the meta device cannot hold values: taken up once it has a device
            if current is not None and not current.delayed.scale.is_meta:
                current.delayed.load_state_dict(sd)
            else:
                pending[mode] = sd
        self._pending_extra_state = pending or None
