"""Hooks on the quantizers of a model's lowprec modules: every quantize they make, with the
GEMM and tensor role it was made for.

Shared by :class:`lowprec.debug.Recorder` and ``lowprec compare``'s SQNR probe
(``lowprec.compare.probe``). While installed, each hooked quantizer's ``quantize``,
``_quantize_exact`` (the entry point of operands only a GEMM reads, dY on GPU) and
``quantize_fused`` (a norm or activation quantized as it is computed, GPU) call
``on_quantize(site, quantizer, x, quantized)`` after quantizing; the tensors are the
step's own, so nothing is quantized again and random streams (stochastic rounding) are
untouched. A fused quantize never writes its high-precision input: ``x`` is then that
input computed apart (``lowprec.fused.apply_prologue``, the values the fused kernel
quantizes). The hooks are instance attributes shadowing the class's methods; removing them
gives the quantizers their methods back (a quantizer pickled or deep-copied while hooked
comes back unhooked).

Two ways to find the quantizers:

* :meth:`QuantizerHooks.hook_states`: the states a known recipe gives every module, hooked
  at once (the probe, which knows its recipe before the step);
* :meth:`QuantizerHooks.follow_calls`: each call of a module's ``gemm_quantizers`` (every
  GEMM module and op asks it for its quantizers, once per forward) hooks what that call
  got, whatever recipe it runs under, and reports the call, quantized or outside
  autocast, to ``on_call(path, module, quantizers, backward_mode)``. The class's method is
  replaced while any model is followed, so the modules themselves carry nothing.

While hooks are installed, linear layers quantize dY and the weight's two directions each
in one piece (``grad_split.unsliced``, the same values): each quantize is of the whole
tensor; and eager calls run the eager Function (``linear.eager_plans_off``, the same bits),
whose quantizes go through the hooked quantizers (a plan's forms launch their kernels
without them). ``every_operand=True`` also makes consecutive Linears that read one input (q/k/v)
quantize it each (``Quantizer.share_key``; the same values), so each layer's input is seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import Quantizer
from ..fused import apply_prologue
from ..linear import eager_plans_off, grad_split
from ..modules import LowprecModule

#: The quantizer methods a hook records through.
_RECORDED = ("quantize", "_quantize_exact", "quantize_fused")
#: The quantizer methods ``every_operand`` turns off, and what they then return.
_DECLINED = {"share_key": None}


@dataclass(frozen=True)
class Site:
    """What a hooked quantizer quantizes: ``layer``, the GEMM (its roles' ``name``, or
    the module's path in the model where the role has none); ``role``, the tensor role
    (``input``, ``weight``, ``grad_output``, ``output``, ``grad_input``); ``module``, the
    module's path in the model where known."""

    layer: str
    role: str
    module: str | None = None


class _Hook:
    """The instance attribute that shadows one method of one hooked quantizer."""

    __slots__ = ("q", "name", "fn")

    def __init__(self, q: Quantizer, name: str, fn: Callable) -> None:
        self.q, self.name, self.fn = q, name, fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        # A pickle or deep copy of the quantizer gets its class's method, bound to the copy
        # (the copy is already being built when this is read back).
        return getattr, (self.q, self.name)


def _hook_of(q: Quantizer, name: str) -> _Hook | None:
    hook = q.__dict__.get(name)
    return hook if isinstance(hook, _Hook) else None


# ---- following module calls ------------------------------------------------------------
#: id(module) -> (hooks, path) of every followed module
_FOLLOWED: dict[int, tuple["QuantizerHooks", str]] = {}
#: the class's own gemm_quantizers while it is replaced
_ORIGINAL: list = []


def _followed_gemm_quantizers(self, *args, **kwargs):
    out = _ORIGINAL[0](self, *args, **kwargs)
    entry = _FOLLOWED.get(id(self))
    if entry is not None:
        entry[0]._saw_call(self, entry[1], out)
    return out


def _follow(module: LowprecModule, hooks: "QuantizerHooks", path: str) -> None:
    entry = _FOLLOWED.get(id(module))
    if entry is not None and entry[0] is not hooks:
        raise RuntimeError(f"module {path or type(module).__name__!r} is already followed by "
                           f"another lowprec.debug recorder; close that one first")
    if not _ORIGINAL:
        _ORIGINAL.append(LowprecModule.__dict__["gemm_quantizers"])
        LowprecModule.gemm_quantizers = _followed_gemm_quantizers
    _FOLLOWED[id(module)] = (hooks, path)


def _unfollow(module: LowprecModule, hooks: "QuantizerHooks") -> None:
    entry = _FOLLOWED.get(id(module))
    if entry is not None and entry[0] is hooks:
        del _FOLLOWED[id(module)]
    if not _FOLLOWED and _ORIGINAL:
        LowprecModule.gemm_quantizers = _ORIGINAL.pop()


def _gemm_slots(qs, fwd_roles: list, bwd_roles: list):
    """(quantizer, role) of every slot of ``gemm_quantizers``' per-GEMM quantizers: forward
    roles are ``[input, weight, output]`` per GEMM, backward ``[grad_output, grad_input]``."""
    for i, lq in enumerate(qs):
        yield lq.input, fwd_roles[3 * i]
        yield lq.weight, fwd_roles[3 * i + 1]
        yield lq.output, fwd_roles[3 * i + 2]
        yield lq.grad_output, bwd_roles[2 * i]
        yield lq.grad_input, bwd_roles[2 * i + 1]


class QuantizerHooks:
    """Hooks on the quantizers of ``model``'s lowprec modules (see the module docstring).

    ``on_quantize(site, quantizer, x, quantized)`` runs after each quantize of a hooked
    quantizer (``quantized`` is None where ``_quantize_exact`` declined: the quantize then
    continues through ``quantize``, hooked too). ``on_call(path, module, quantizers,
    backward_mode)``: each followed module call (``quantizers`` None outside autocast).
    """

    def __init__(self, model: torch.nn.Module, on_quantize: Callable, *,
                 on_call: Callable | None = None, every_operand: bool = False) -> None:
        self.model = model
        self.on_quantize = on_quantize
        self.on_call = on_call
        self.every_operand = every_operand
        self.wrapped: list[Quantizer] = []
        self._followed: list[LowprecModule] = []
        self._roles: dict[int, tuple[list, list]] = {}
        #: the modes entered while hooks are installed (whole quantizes, the eager Function)
        self._whole = None

    # ---- finding the quantizers ----------------------------------------------------------
    def hook_states(self, recipe, device) -> None:
        """Hook the quantizers ``recipe`` gives every lowprec module (creating the states if
        needed), named by their roles."""
        for module in self.model.modules():
            if not isinstance(module, LowprecModule):
                continue
            for mode in ("forward", "backward"):
                state = module._state(mode, recipe, device)
                for q, role in zip(state.quantizers, state.roles):
                    if role is not None:  # an unset boundary slot never quantizes
                        self.wrap(q, Site(role.name, role.tensor_type))

    def follow_calls(self) -> None:
        """Hook, at each call of a lowprec module of the model, the quantizers it runs with."""
        try:
            for path, module in self.model.named_modules():
                if isinstance(module, LowprecModule):
                    _follow(module, self, path)
                    self._followed.append(module)
        except RuntimeError:
            self.remove()
            raise

    def _saw_call(self, module: LowprecModule, path: str, out) -> None:
        qs, mode = out[0], out[1]
        if qs is not None:
            roles = self._roles.get(id(module))
            if roles is None:
                roles = self._roles[id(module)] = (module.get_quantizer_roles(fwd=True),
                                                   module.get_quantizer_roles(fwd=False))
            for q, role in _gemm_slots(qs, *roles):
                if q is not None and role is not None and _hook_of(q, "quantize") is None:
                    self.wrap(q, Site(_layer_name(role.name, path), role.tensor_type, path))
        if self.on_call is not None:
            self.on_call(path, module, qs, mode)

    # ---- hooking one quantizer ----------------------------------------------------------
    def wrap(self, q: Quantizer, site: Site) -> None:
        """Hook ``q``: its quantizations are reported as made at ``site``."""
        hook = _hook_of(q, "quantize")
        if hook is not None:
            if any(w is q for w in self.wrapped):
                return
            raise RuntimeError(f"a quantizer of {site.layer!r} ({site.role}) is already hooked "
                               f"by another recorder or probe; remove that one first")
        for name in _RECORDED:
            q.__dict__[name] = _Hook(q, name, self._recording(q, site, name))
        if self.every_operand:
            for name, value in _DECLINED.items():
                q.__dict__[name] = _Hook(q, name, _returning(value))
        self.wrapped.append(q)
        if self._whole is None:
            self._whole = (grad_split.unsliced(), eager_plans_off())
            for mode in self._whole:
                mode.__enter__()

    def _recording(self, q: Quantizer, site: Site, name: str) -> Callable:
        original = getattr(q, name)  # the class's method, bound to q

        def quantize(x, *args, **kwargs):
            qt = original(x, *args, **kwargs)
            if qt is not None:
                self.on_quantize(site, q, x, qt)
            return qt

        def quantize_fused(x, prologue):
            qt = original(x, prologue)
            with torch.no_grad():
                source = apply_prologue(x.detach().reshape(-1, x.shape[-1]).contiguous(),
                                        prologue).reshape(qt.shape)
            self.on_quantize(site, q, source, qt)
            return qt

        return quantize_fused if name == "quantize_fused" else quantize

    def remove(self) -> None:
        """Give every hooked quantizer its methods back and stop following module calls."""
        for module in self._followed:
            _unfollow(module, self)
        self._followed.clear()
        self._roles.clear()
        for q in self.wrapped:
            for name in (*_RECORDED, *_DECLINED):
                if _hook_of(q, name) is not None:
                    del q.__dict__[name]
        self.wrapped.clear()
        if self._whole is not None:
            for mode in reversed(self._whole):
                mode.__exit__(None, None, None)
            self._whole = None


def _returning(value):
    def declined(*args, **kwargs):
        return value
    return declined


def _layer_name(role_name: str, path: str) -> str:
    """The GEMM's name: the role's, or the module's path where the module has no name."""
    if not role_name:
        return path
    return path + role_name if role_name.startswith(".") else role_name
