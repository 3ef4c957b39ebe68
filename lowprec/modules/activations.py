"""Activation functions of LayerNormMLP and the ops API (gated ones halve the width)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _srelu(x):
    return torch.square(F.relu(x))


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _glu(act):
    def gated(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b
    return gated


#: name -> (function, gated). A gated activation takes 2n features and returns n.
ACTIVATIONS = {
    "gelu": (_gelu, False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "srelu": (_srelu, False),
    "qgelu": (_qgelu, False),
    "swiglu": (_glu(F.silu), True),
    "geglu": (_glu(_gelu), True),
}


def get_activation(name: str):
    """(function, gated) for an activation name; ValueError lists the valid names."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
