"""DTensor tensor-parallel styles for lowprec modules: ``parallelize_module`` with
``lowprec.distributed.ColwiseParallel`` / ``RowwiseParallel``.

torch's styles accept ``nn.Linear`` only. These subclasses take the same arguments, hand
``nn.Linear`` (and ``nn.Embedding``) to torch's own code, and turn a ``lowprec.Linear``
(``LayerNormLinear`` column-wise) into a tensor-parallel module over the mesh's group:

* its parameters become DTensors (weight ``Shard(0)`` column-wise, ``Shard(1)`` row-wise;
  a row-wise bias and a norm's parameters ``Replicate()``), so state dicts, DCP and
  ``fully_shard`` (applied after, on the other mesh dimension) see the whole layer;
* its forward runs on the local shards with the module's own collectives
  (``lowprec.modules.tensor_parallel``): inputs and outputs are redistributed to and from
  the layouts given, as torch's styles do. A column-wise ``input_layouts=Shard(0)`` or a
  row-wise ``output_layouts=Shard(0)`` (sequence-first sequence parallelism) runs the
  module's sequence-parallel gathers, quantized where the format allows; other layouts
  move through DTensor redistributions in high precision.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import style as torch_style

from ..formats import QuantizedTensor

_COLUMN_PARAMS = {"weight": Shard(0), "bias": Shard(0)}
_ROW_PARAMS = {"weight": Shard(1), "bias": Replicate()}


def _is_lowprec(module: nn.Module) -> bool:
    from ..modules import LowprecModule
    return isinstance(module, LowprecModule)


def _shard0(layout) -> bool:
    return isinstance(layout, Shard) and layout.dim == 0


def _distribute(module: nn.Module, mesh, placements: dict, src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"{type(module).__name__}.{name} is already a DTensor; apply the "
                             f"tensor-parallel style once, before fully_shard")
        placement = placements.get(name, Replicate())
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


def _swap_to_local(module, _args) -> None:
    # The module's GEMMs and collectives work on this rank's shards. (Plain attribute
    # reads and writes: dynamo traces these hooks under torch.compile.)
    swapped = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._dtensor_params = swapped
    for name, p in swapped.items():
        module._parameters[name] = p.to_local()


def _swap_back(module, _args, _output) -> None:
    swapped = getattr(module, "_dtensor_params", None)
    if swapped:
        for name, p in swapped.items():
            module._parameters[name] = p
        module._dtensor_params = {}


def _input_hook(mesh, layout, desired, module, args):
    return (_to_local_input(mesh, layout, desired, args[0]), *args[1:])


def _output_hook(mesh, produced, layout, use_local_output, module, args, y):
    return _from_local_output(mesh, produced, layout, use_local_output, y)


def _to_local_input(mesh, layout, desired, x):
    if not isinstance(x, DTensor):
        if layout == desired:
            return x
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if x.placements != (desired,):
        x = x.redistribute(placements=(desired,))
    return x.to_local()


def _from_local_output(mesh, produced, layout, use_local_output: bool, y):
    if produced == layout and use_local_output:
        return y
    y = DTensor.from_local(y, mesh, (produced,), run_check=False)
    if y.placements != (layout,):
        y = y.redistribute(placements=(layout,))
    return y.to_local() if use_local_output else y


def _make_parallel(style, module: nn.Module, mode: str, mesh) -> nn.Module:
    """Turn lowprec ``module`` tensor-parallel over ``mesh`` as ``style`` describes."""
    from ..modules import LayerNormLinear, Linear
    from ..modules import tensor_parallel as tpar
    allowed = (Linear, LayerNormLinear) if mode == "column" else (Linear,)
    if type(module) not in allowed:
        raise NotImplementedError(
            f"lowprec's {'Colwise' if mode == 'column' else 'Rowwise'}Parallel takes "
            f"{', '.join(c.__name__ for c in allowed)} (or torch's nn.Linear); got "
            f"{type(module).__name__}: build it with tp_group= instead")
    if module._tp is not None:
        raise ValueError(f"{type(module).__name__} is already tensor-parallel")
    if isinstance(getattr(module, "weight", None), QuantizedTensor):
        raise NotImplementedError("DTensor tensor parallelism of quantized_model_init weights is "
                                  "not implemented; build the module with tp_group= instead")
    if mesh.ndim != 1:
        raise ValueError(f"a tensor-parallel style takes a 1-D mesh (the TP dimension), got "
                         f"{mesh.ndim}-D")
    layout, out_layout = style.input_layouts[0], style.output_layouts[0]
    if mode == "column":
        # sequence-first SP: the module gathers its input rows itself
        sp = _shard0(layout)
        params, desired, produced = _COLUMN_PARAMS, (layout if sp else Replicate()), Shard(-1)
    else:
        sp = _shard0(out_layout)
        params, desired, produced = _ROW_PARAMS, Shard(-1), (out_layout if sp else Replicate())
    module._tp = tpar.TensorParallel(mode, mesh.get_group(), sp)
    module.parallel_mode, module.sequence_parallel = mode, sp
    _distribute(module, mesh, params, style.src_data_rank)
    module.register_forward_pre_hook(partial(_input_hook, mesh, layout, desired))
    module.register_forward_pre_hook(_swap_to_local)
    module.register_forward_hook(_swap_back, always_call=True)
    module.register_forward_hook(partial(_output_hook, mesh, produced, out_layout,
                                         style.use_local_output))
    return module


class ColwiseParallel(torch_style.ColwiseParallel):
    """torch's ``ColwiseParallel`` that also shards ``lowprec.Linear`` and
    ``lowprec.LayerNormLinear`` (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _is_lowprec(module):
            return super()._apply(module, device_mesh)
        return _make_parallel(self, module, "column", device_mesh)


class RowwiseParallel(torch_style.RowwiseParallel):
    """torch's ``RowwiseParallel`` that also shards ``lowprec.Linear`` (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _is_lowprec(module):
            return super()._apply(module, device_mesh)
        return _make_parallel(self, module, "row", device_mesh)
