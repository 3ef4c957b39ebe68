"""The parameter wrapper of lowprec's FSDP2 all-gathers: to everything but FSDP's gather
hooks (the optimizer, the state dict, ``reset_parameters``) it is the high-precision tensor
inside, every op running on that tensor; the ops FSDP2 shards, pads, moves and copies a
parameter with keep the wrapper, and a checkpoint saves the plain tensor."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._pytree import tree_map

aten = torch.ops.aten

#: Ops FSDP2 shards, pads, moves and copies a parameter with: their results stay wrapped
#: (every other op sees the high-precision tensor and returns plain tensors).
_KEEP_WRAPPED = frozenset({
    aten.detach.default, aten.alias.default, aten.clone.default, aten.view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.new_zeros.default,
    aten.new_empty.default, aten.empty_like.default, aten._to_copy.default,
    aten._pin_memory.default,
})


class GatherWrapper(torch.Tensor):
    """A high-precision parameter (``_data``) that FSDP2 all-gathers in another form: its
    subclasses define ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``. ``spec``: what
    they need to know (the module, the recipe), kept through FSDP's copies."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, layout=data.layout,
            requires_grad=data.requires_grad)
        self._data, self._spec = data, spec
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._spec

    @classmethod
    def __tensor_unflatten__(cls, inner, spec, outer_size, outer_stride):
        return cls(inner["_data"], spec)

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, DCP, pickle) as the high-precision tensor it holds: a checkpoint
        # does not depend on how the weight was gathered (nor hold its module).
        data = self._data.detach()
        if getattr(self, "_is_param", False):
            return (nn.Parameter, (data, self.requires_grad))
        return data.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # the copy belongs to the copied module (``memo`` has it when a whole model is copied)
        out = type(self)(copy.deepcopy(self._data, memo), copy.deepcopy(self._spec, memo))
        if getattr(self, "_is_param", False):
            out = nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = None

        def unwrap(t):
            nonlocal spec
            if isinstance(t, cls):
                spec = spec or t._spec
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        name = func._schema.name.split("::")[-1]
        if name.endswith("_") and not name.startswith("_foreach") and isinstance(args[0], cls):
            return args[0]  # in place (an optimizer step, a copy_): the wrapper itself
        if func in _KEEP_WRAPPED:
            return tree_map(lambda t: cls(t, spec) if type(t) is torch.Tensor else t, out)
        return out

