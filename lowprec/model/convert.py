"""``convert_model``: put lowprec modules into a model somebody else wrote.

Every ``torch.nn.Linear`` becomes a :class:`lowprec.Linear` holding the *same*
``nn.Parameter`` objects (so weights, devices, dtypes, ``requires_grad``, tied
weights and an optimizer built before the conversion all stay as they were), and
a norm whose output provably feeds one Linear and nothing else becomes part of a
:class:`lowprec.LayerNormLinear` (the norm itself is replaced by ``nn.Identity``).

Proof of a norm -> Linear pair, two ways:

* structure: consecutive children of an ``nn.Sequential`` (a Sequential feeds
  each child's output to the next child only);
* a traced forward (``example_inputs=``): one ``torch.no_grad()`` forward under a
  ``TorchFunctionMode`` that sees every torch call. A pair is proven when every
  output of the norm reaches exactly one Linear call as its only argument, no
  other torch operation reads it (shape/dtype queries excepted), nothing keeps it
  after the forward, and every call of that Linear got its input that way.

and the norm's arithmetic must match lowprec's LayerNorm/RMSNorm: checked on a copy
with random parameters, so an ``nn.LayerNorm``, ``nn.RMSNorm``, lowprec's own and
look-alikes (e.g. Hugging Face ``LlamaRMSNorm``) qualify, a variant that computes
something else does not.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..formats import QuantizedTensor
from ..linear import LinearQuantizers, feature_padding
from ..modules import (
    GroupedExperts,
    LayerNormLinear,
    Linear,
    LowprecModule,
    TorchtitanGroupedExperts,
    apply_norm,
)
from ..modules import LayerNorm as LPLayerNorm
from ..modules import RMSNorm as LPRMSNorm
from ..recipe import Recipe, RecipeState, gemm_roles, quantized_model_init
from .attach import attach_recipe

__all__ = ["convert_model"]

# A token count divisible by every block size (shapes along M are only known at run time).
_PROBE_TOKENS = 1 << 12


def convert_model(model: nn.Module, recipe: Recipe | None = None,
                  module_filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
                  example_inputs=None, fuse_norms: bool = True,
                  attach: bool = False) -> nn.Module:
    """Swap ``nn.Linear`` (and proven norm -> Linear pairs) for lowprec modules, in place.

    Args:
        model: any ``nn.Module``.
        recipe: when given, a Linear is converted only if every quantizer ``recipe``
            gives it can quantize its weight and its input/gradient feature
            dimensions (block formats need ``in_features``/``out_features`` divisible by
            their block: 16 for NVFP4, 32 for MXFP8, 128 for Float8BlockScaling). The
            others stay ``nn.Linear`` and a warning lists them. Quantization happens
            under ``lowprec.autocast(recipe=...)``, or on every call with ``attach``.
        module_filter_fn: ``fn(module, fqn) -> bool``, called for each candidate Linear
            with its fully qualified name; ``False`` leaves it alone (e.g.
            ``lambda m, name: name != "lm_head"``).
        example_inputs: a tensor, tuple of positional arguments or dict of keyword
            arguments for ``model(...)``; enables the traced norm -> Linear proof.
        fuse_norms: set ``False`` to convert Linears only (norm parameters then keep
            their names in ``state_dict``).
        attach: also attach ``recipe`` to the returned model
            (:func:`lowprec.attach_recipe`): every call of it then runs under the recipe
            without a ``lowprec.autocast`` block in the training loop (an explicit one
            wins). Needs ``recipe``.

    Returns:
        ``model`` (a new module when ``model`` itself is an ``nn.Linear``). Converted
        modules get ``name=<fqn>``, which is the ``name`` of their quantizer roles.
        ``model.lowprec_conversion`` (a dict) lists what was converted, fused and
        skipped, with reasons.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_model expects a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowprec recipe or None, got {type(recipe).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError("module_filter_fn must be callable as fn(module, fqn) -> bool")
    if not isinstance(attach, bool) or (attach and recipe is None):
        raise ValueError(f"attach={attach!r}: attach=True needs a recipe; attach takes a bool")
    model = _convert(model, recipe, module_filter_fn, example_inputs, fuse_norms)
    return attach_recipe(model, recipe) if attach else model


def _convert(model, recipe, module_filter_fn, example_inputs, fuse_norms) -> nn.Module:

    report = {"converted": [], "fused": [], "skipped": {}}
    if _is_candidate_linear(model, None) and not isinstance(model, LowprecModule):
        reason = _linear_rejection(model, "", recipe, module_filter_fn)
        if reason is not None:
            report["skipped"][""] = reason
            return model
        return _make_linear(model, "")

    counts = _module_counts(model)
    parents = _parents(model)
    routers = _router_linears(model)
    candidates: dict[str, nn.Linear] = {}
    for fqn, mod in model.named_modules():
        parent = parents.get(fqn, (None, None))[0]
        if not _is_candidate_linear(mod, parent):
            continue
        reason = _linear_rejection(mod, fqn, recipe, module_filter_fn)
        if reason is None and fqn in routers:
            reason = "an MoE router: it stays in high precision"
        if reason is None and counts[id(mod)] > 1:
            reason = "the module object is used at more than one place in the model"
        if reason is not None:
            report["skipped"][fqn] = reason
            continue
        candidates[fqn] = mod

    pairs: dict[str, tuple[str, tuple]] = {}  # linear fqn -> (norm fqn, norm spec)
    if fuse_norms:
        pairs = _find_pairs(model, candidates, counts, parents, example_inputs)

    for lin_fqn, (norm_fqn, spec) in pairs.items():
        new = _make_layernorm_linear(candidates[lin_fqn], lin_fqn, model.get_submodule(norm_fqn),
                                     spec)
        _replace(parents, lin_fqn, new)
        _replace(parents, norm_fqn, nn.Identity())
        report["fused"].append((norm_fqn, lin_fqn))
    for fqn, mod in candidates.items():
        if fqn in pairs:
            continue
        _replace(parents, fqn, _make_linear(mod, fqn))
        report["converted"].append(fqn)
    for fqn, mod in list(model.named_modules()):
        kind = _experts_kind(mod)
        if kind is not None and counts[id(mod)] == 1 and fqn:
            if module_filter_fn is not None and not module_filter_fn(mod, fqn):
                report["skipped"][fqn] = "module_filter_fn returned False"
                continue
            _replace(parents, fqn, kind.from_experts(mod, fqn))
            report["converted"].append(fqn)

    # the converted modules prepare their recipe state together under torch.compile
    LowprecModule.new_group(m for m in model.modules() if isinstance(m, LowprecModule))
    # chosen, not refused: no warning for these
    skipped = {k: v for k, v in report["skipped"].items()
               if not v.startswith(("module_filter_fn", "an MoE router"))}
    if skipped:
        shown = "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:5])
        more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
        warnings.warn(f"convert_model left {len(skipped)} nn.Linear module(s) unconverted: "
                      f"{shown}{more}", stacklevel=2)
    try:
        object.__setattr__(model, "lowprec_conversion", report)
    except Exception:  # noqa: BLE001 - a model that refuses attributes just lacks the report
        pass
    return model


# ---- mixture-of-experts experts ------------------------------------------------------
def _router_linears(model: nn.Module) -> set[str]:
    """The fully qualified names of MoE router Linears: in a module that holds routed
    experts, a Linear named ``gate`` or under a child named ``router`` (torchtitan's
    ``router.gate``, transformers' ``gate``), outside the experts themselves."""
    out = set()
    for fqn, mod in model.named_modules():
        experts = [n for n, c in mod.named_children() if _experts_kind(c) is not None]
        if not experts:
            continue
        for sub, lin in mod.named_modules():
            parts = sub.split(".")
            if (isinstance(lin, nn.Linear) and parts[0] not in experts
                    and (parts[-1] == "gate" or "router" in parts)):
                out.add(f"{fqn}.{sub}" if fqn else sub)
    return out


def _experts_kind(mod: nn.Module):
    """The lowprec module class for an experts module of a known layout, or None."""
    if _is_hf_experts(mod):
        return GroupedExperts
    if _is_torchtitan_experts(mod):
        return TorchtitanGroupedExperts
    return None


def _is_torchtitan_experts(mod: nn.Module) -> bool:
    """torchtitan's ``GroupedExperts``: w1 and w3 (E, F, D), w2 (E, D, F) and nothing else
    (named ``w1``/``w2``/``w3`` in 0.2.x, ``w1_EFD``/``w2_EDF``/``w3_EFD`` in 0.3),
    ``forward(x, num_tokens_per_expert)``."""
    if isinstance(mod, LowprecModule) or type(mod).__name__ != "GroupedExperts":
        return False
    params = dict(mod.named_parameters())
    names = next((n for n in TorchtitanGroupedExperts.NAMES if set(n) == set(params)), None)
    if names is None or any(p.dim() != 3 for p in params.values()):
        return False
    w1, w3, w2 = (params[n] for n in names)
    e, f, d = w1.shape
    return tuple(w3.shape) == (e, f, d) and tuple(w2.shape) == (e, d, f)


def _is_hf_experts(mod: nn.Module) -> bool:
    """A transformers ``*Experts`` module (Mixtral, Qwen3-MoE, DeepSeek-V3 and their kin)
    that ``GroupedExperts`` computes alike: 3-D ``gate_up_proj`` (E, 2I, H) and
    ``down_proj`` (E, H, I) parameters and nothing else, an ``act_fn``, and, where the
    experts interface's attributes exist, them saying concatenated gate/up, no bias, no
    post-expert norm, no expert parallelism (its ``_apply_gate``, default or the model's
    own, is kept). Without that interface only the plain-gating classes qualify."""
    if isinstance(mod, LowprecModule) or not type(mod).__name__.endswith("Experts"):
        return False
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3
            and down.dim() == 3 and callable(getattr(mod, "act_fn", None))):
        return False
    e, two_i, h = gu.shape
    # transformers' experts interface describes the layout: concatenated [gate; up] rows,
    # (out, in) weights, no biases, no norm after each expert, not expert-parallel. Releases
    # before that interface (5.17 and older) have no such attributes and only this layout
    # (the shapes above tell a transposed one apart).
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False,
              "is_concatenated": True, "has_post_expert_norm": False,
              "_is_expert_parallel": False}
    gate = getattr(mod, "_apply_gate", None)
    if gate is None and type(mod).__name__ not in _PLAIN_GATING:
        return False  # its gating may live in its own forward (a clamp, a scale)
    return (two_i % 2 == 0 and tuple(down.shape) == (e, h, two_i // 2)
            and {n for n, _ in mod.named_parameters()} == {"gate_up_proj", "down_proj"}
            and all(getattr(mod, k, v) is v for k, v in layout.items())
            and (gate is None or callable(gate)))


#: experts classes whose forward gates as ``act_fn(gate) * up``: converted in transformers
#: releases without the experts interface's ``_apply_gate``
_PLAIN_GATING = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "DeepseekV3Experts")


# ---- Linear candidates ---------------------------------------------------------------
def _is_candidate_linear(mod: nn.Module, parent: nn.Module | None) -> bool:
    if not isinstance(mod, nn.Linear) or type(mod).forward is not nn.Linear.forward:
        return False
    # MultiheadAttention reads out_proj.weight directly and never calls it.
    return not isinstance(parent, nn.MultiheadAttention)


def _linear_rejection(mod: nn.Linear, fqn: str, recipe, module_filter_fn) -> str | None:
    if module_filter_fn is not None and not module_filter_fn(mod, fqn):
        return "module_filter_fn returned False"
    if torch.nn.utils.parametrize.is_parametrized(mod):
        return "its weight is parametrized"
    if "forward" in mod.__dict__:
        return "its forward was replaced on the instance (e.g. by a hook library)"
    w = mod.weight
    if (not isinstance(w, nn.Parameter) or not w.is_floating_point()
            or isinstance(w, QuantizedTensor)):
        return f"its weight is not a floating-point parameter ({type(w).__name__}, {w.dtype})"
    if mod.bias is not None and mod.bias.dtype != w.dtype:
        return f"bias dtype {mod.bias.dtype} differs from the weight's {w.dtype}"
    if recipe is not None:
        return recipe_rejection(recipe, fqn, mod.out_features, mod.in_features)
    return None


def recipe_rejection(recipe: Recipe, fqn: str, out_f: int, in_f: int) -> str | None:
    """Why ``recipe``'s quantizers cannot handle a (out_f x in_f) Linear, or None. Feature
    dimensions that are not whole blocks are padded by the linear (``feature_padding``)."""
    states = {}
    for mode in ("forward", "backward"):
        roles = gemm_roles("linear", fqn, fwd=mode == "forward")
        try:
            states[mode] = (RecipeState.create(recipe, mode, roles), roles)
        except (TypeError, ValueError) as err:
            return f"the recipe gives no quantizer for it: {err}"
    fq, bq = states["forward"][0].quantizers, states["backward"][0].quantizers
    pad_k, pad_n = feature_padding(
        LinearQuantizers(input=fq[0], weight=fq[1], grad_output=bq[0]),
        torch.empty(0, in_f, device="meta"), torch.empty(out_f, in_f, device="meta"))
    in_f, out_f = in_f + pad_k, out_f + pad_n
    shapes = {"input": (_PROBE_TOKENS, in_f), "weight": (out_f, in_f),
              "grad_output": (_PROBE_TOKENS, out_f)}
    for state, roles in states.values():
        for q, role in zip(state.quantizers, roles):
            if role is None or role.tensor_type not in shapes:
                continue
            shape = shapes[role.tensor_type]
            try:
                q.copy().set_usage(rowwise=True, columnwise=True)._check_shape(shape, *shape)
            except ValueError as err:
                block = re.search(r"block (\d+x\d+)", str(err))
                return (f"its {role.tensor_type} {shape[0]}x{shape[1]} does not divide into "
                        f"{type(q).__name__} {block.group(1) + ' ' if block else ''}blocks")
    return None


def _make_linear(mod: nn.Linear, fqn: str) -> Linear:
    with quantized_model_init(enabled=False):
        new = Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                     params_dtype=mod.weight.dtype, device="meta", name=fqn)
    new.weight = mod.weight
    new.bias = mod.bias
    _carry_module_state(mod, new)
    return new


def _carry_module_state(old: nn.Module, new: nn.Module) -> None:
    new.train(old.training)
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(old, attr) and getattr(old, attr):
            setattr(new, attr, getattr(old, attr))


# ---- module tree helpers -------------------------------------------------------------
def _module_counts(model: nn.Module) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for _, mod in model.named_modules(remove_duplicate=False):
        counts[id(mod)] += 1
    return counts


def _parents(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    out = {}
    for fqn, mod in model.named_modules():
        for name, child in mod.named_children():
            out[f"{fqn}.{name}" if fqn else name] = (mod, name)
    return out


def _replace(parents, fqn: str, new: nn.Module) -> None:
    parent, name = parents[fqn]
    setattr(parent, name, new)


# ---- norms ---------------------------------------------------------------------------
_NormSpec = tuple  # (normalization, eps, zero_centered_gamma)


def _norm_params(norm: nn.Module):
    """(weight, bias) of a norm-like module over one trailing dim, or None."""
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) and len(norm.normalized_shape) != 1:
        return None
    w = getattr(norm, "weight", None)
    b = getattr(norm, "bias", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or isinstance(w, QuantizedTensor):
        return None
    if b is not None and (not isinstance(b, nn.Parameter) or b.shape != w.shape):
        return None
    own = {n for n, _ in norm.named_parameters(recurse=True)}
    if own - {"weight", "bias"} or list(norm.buffers()):
        return None
    return w, b


def _looks_like_norm(norm: nn.Module) -> bool:
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm, LPLayerNorm, LPRMSNorm)):
        return True
    name = type(norm).__name__
    return name.endswith("RMSNorm") or name.endswith("LayerNorm")


def _norm_eps(norm: nn.Module):
    for attr in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(norm, attr):
            v = getattr(norm, attr)
            if v is None or isinstance(v, (int, float)):
                return True, v
    return False, None


def _norm_spec(norm: nn.Module, in_features: int, lin_weight: torch.Tensor) -> _NormSpec | None:
    """What a norm computes, in LayerNormLinear's terms, verified numerically; or None."""
    if not _looks_like_norm(norm) or _has_hooks(norm):
        return None
    params = _norm_params(norm)
    if params is None:
        return None
    w, b = params
    if w.numel() != in_features or w.dtype != lin_weight.dtype or w.device != lin_weight.device:
        return None
    if w.device.type == "meta":
        return None
    found, eps = _norm_eps(norm)
    if not found:
        return None
    kinds = [("LayerNorm", False), ("LayerNorm", True)] if b is not None else \
        [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False), ("LayerNorm", True)]
    for normalization, zc in kinds:
        if _verify_norm(norm, normalization, eps, zc):
            return normalization, eps, zc
    return None


def _verify_norm(norm: nn.Module, normalization: str, eps, zero_centered: bool) -> bool:
    """Does ``norm`` compute apply_norm(...)? Checked on a copy with random parameters."""
    try:
        probe = copy.deepcopy(norm)
    except Exception:  # noqa: BLE001 - uncopyable: not provable
        return False
    w0 = norm.weight
    gen = torch.Generator(device="cpu").manual_seed(1234)
    with torch.no_grad():
        hidden = w0.numel()
        new_w = (torch.rand(hidden, generator=gen) + 0.5).to(w0.dtype).to(w0.device)
        probe.weight.copy_(new_w)
        new_b = None
        if getattr(probe, "bias", None) is not None:
            new_b = (torch.rand(hidden, generator=gen) - 0.5).to(w0.dtype).to(w0.device)
            probe.bias.copy_(new_b)
        x = (torch.randn(8, hidden, generator=gen) * 2.0 + 0.3).to(w0.dtype).to(w0.device)
        try:
            got = probe(x)
        except Exception:  # noqa: BLE001
            return False
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return False
        if normalization == "LayerNorm" and new_b is None:
            ref_b = None
        else:
            ref_b = new_b
        if normalization == "RMSNorm" and new_b is not None:
            return False
        want = apply_norm(x, normalization, new_w, ref_b, eps, zero_centered)
        # fp32: rounding-level; bf16/fp16: a few ulps (look-alikes round the normalized value
        # to the input dtype before the weight multiply; lowprec's norm rounds once).
        tol = 1e-4 if w0.dtype == torch.float32 else 3e-2
        return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


def _has_hooks(mod: nn.Module) -> bool:
    return any(getattr(mod, a, None) for a in ("_forward_pre_hooks", "_forward_hooks",
                                               "_backward_hooks", "_backward_pre_hooks"))


def _make_layernorm_linear(lin: nn.Linear, fqn: str, norm: nn.Module,
                           spec: _NormSpec) -> LayerNormLinear:
    normalization, eps, zc = spec
    with quantized_model_init(enabled=False):
        new = LayerNormLinear(lin.in_features, lin.out_features, eps=eps, bias=lin.bias is not None,
                              normalization=normalization, zero_centered_gamma=zc,
                              params_dtype=lin.weight.dtype, device="meta", name=fqn)
    new.weight = lin.weight
    new.bias = lin.bias
    new.layer_norm_weight = norm.weight
    if normalization == "LayerNorm":
        new.layer_norm_bias = getattr(norm, "bias", None)
    _carry_module_state(lin, new)
    return new


# ---- proving norm -> Linear pairs ------------------------------------------------------
def _find_pairs(model, candidates, counts, parents, example_inputs) -> dict:
    by_id = {id(m): fqn for fqn, m in candidates.items()}
    found: dict[str, str] = {}  # linear fqn -> norm fqn

    # 1. nn.Sequential: child i's output is child i+1's input and nothing else's.
    for fqn, mod in model.named_modules():
        if type(mod) is not nn.Sequential:
            continue
        children = list(mod.named_children())
        for (n_name, norm), (_, lin) in zip(children, children[1:]):
            lin_fqn = by_id.get(id(lin))
            if lin_fqn is None or not _looks_like_norm(norm):
                continue
            found[lin_fqn] = f"{fqn}.{n_name}" if fqn else n_name

    # 2. a traced forward.
    if example_inputs is not None:
        for lin_fqn, norm_fqn in _traced_pairs(model, candidates, example_inputs).items():
            found.setdefault(lin_fqn, norm_fqn)

    out = {}
    used_norms = set()
    for lin_fqn, norm_fqn in found.items():
        norm = model.get_submodule(norm_fqn)
        lin = candidates[lin_fqn]
        if counts[id(norm)] > 1 or norm_fqn in used_norms or _has_hooks(lin):
            continue
        spec = _norm_spec(norm, lin.in_features, lin.weight)
        if spec is None:
            continue
        out[lin_fqn] = (norm_fqn, spec)
        used_norms.add(norm_fqn)
    return out


_META_PROPS = {"shape", "dtype", "device", "ndim", "requires_grad", "layout", "is_cuda", "is_cpu",
               "is_meta", "is_sparse", "is_quantized", "is_mps", "names", "grad_fn", "is_leaf",
               "_version"}
_META_METHODS = {"size", "dim", "numel", "nelement", "is_floating_point", "is_complex",
                 "is_contiguous", "__len__", "stride", "element_size", "get_device", "dim_order",
                 "is_inference"}


def _is_metadata_call(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", None) in _META_PROPS
    return name in _META_METHODS


class _Tracer(TorchFunctionMode):
    """Follows each norm output through one forward (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[int, tuple[str, weakref.ref]] = {}
        self.refs: list[tuple[str, weakref.ref]] = []
        self.escaped: set[str] = set()
        self.feeds: dict[str, set] = defaultdict(set)
        self.sources: dict[str, set] = defaultdict(set)
        self.active: list[tuple[str, int]] = []

    def source(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        entry = self.tracked.get(id(t))
        if entry is not None and entry[1]() is t:
            return entry[0]
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        for leaf in leaves:
            norm = self.source(leaf)
            if norm is None or _is_metadata_call(func):
                continue
            if self.active and self.active[-1][1] == id(leaf):
                self.feeds[norm].add(self.active[-1][0])
            else:
                self.escaped.add(norm)
        return func(*args, **kwargs)


def _traced_pairs(model: nn.Module, candidates: dict, example_inputs) -> dict[str, str]:
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    tracer = _Tracer()
    norms = {fqn: m for fqn, m in model.named_modules() if _looks_like_norm(m)}
    handles = []

    def norm_hook(name):
        def hook(mod, inputs, output):
            if isinstance(output, torch.Tensor) and not isinstance(output, QuantizedTensor):
                ref = weakref.ref(output)
                tracer.tracked[id(output)] = (name, ref)
                tracer.refs.append((name, ref))
            else:
                tracer.escaped.add(name)
        return hook

    def lin_pre(name):
        def hook(mod, args, kwargs):
            x = args[0] if len(args) == 1 and not kwargs else None
            src = tracer.source(x)
            tracer.sources[name].add(src)
            if src is not None:
                tracer.feeds[src].add(name)
            tracer.active.append((name, id(x) if src is not None else -1))
            # Any norm output passed some other way (extra args, kwargs) is a use elsewhere.
            leaves, _ = tree_flatten((args[1:] if x is not None else args, kwargs))
            for leaf in leaves:
                s = tracer.source(leaf)
                if s is not None:
                    tracer.escaped.add(s)
        return hook

    def lin_post(name):
        def hook(mod, args, output):
            if tracer.active and tracer.active[-1][0] == name:
                tracer.active.pop()
        return hook

    try:
        for name, m in norms.items():
            handles.append(m.register_forward_hook(norm_hook(name)))
        for name, m in candidates.items():
            handles.append(m.register_forward_pre_hook(lin_pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(lin_post(name)))
        try:
            with torch.no_grad(), tracer:
                out = model(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - no proof, no fusion
            warnings.warn(f"convert_model: the traced forward with example_inputs failed "
                          f"({type(err).__name__}: {err}); no norm was fused by tracing",
                          stacklevel=3)
            return {}
        # Checked while the output is still held: a norm output that outlives the forward
        # was returned or stored somewhere, i.e. used by something other than the Linear.
        gc.collect()
        for name, ref in tracer.refs:
            if ref() is not None:
                tracer.escaped.add(name)
        del out
    finally:
        for h in handles:
            h.remove()

    pairs = {}
    called_norms = {name for name, _ in tracer.refs}
    for norm in called_norms - tracer.escaped:
        targets = tracer.feeds.get(norm, set())
        if len(targets) != 1:
            continue
        (lin,) = targets
        if tracer.sources.get(lin) == {norm}:
            pairs[lin] = norm
    return pairs
