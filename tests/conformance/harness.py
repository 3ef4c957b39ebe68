"""Running one conformance case: eager, compiled and the oracle (see ``space``).

:func:`check` trains a case's module one step eagerly and one step under
``torch.compile(fullgraph=True)`` from the same weights, seed and inputs, and returns what
went wrong, as a list of failure strings (empty: the case conforms):

* eager or compiled raises (a ``ValueError`` at construction or first forward that names
  the role is a *refusal*, reported apart, never a failure);
* a graph break (``fullgraph=True`` raises) or an opaque ``lowprec::call`` in the graph;
* compiled output or any gradient differs from eager's in a bit;
* eager is not close to the oracle: on a Linear with deterministic quantizers, the fp64
  product of the operands each quantizer dequantizes (forward, dgrad, wgrad, as the
  backward mode reads them), within :data:`ORACLE_TOL`; on every module, the SQNR
  against the unquantized fp64 module at least :data:`MIN_SQNR_DB` of its weakest kind.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

import lowprec
from lowprec.recipe import BackwardMode

from .space import Case

#: The least SQNR (dB) of a module's output and gradients against the unquantized module,
#: by the weakest kind whose values reach a GEMM (random normal data; docs/formats.md).
MIN_SQNR_DB = {"identity": 40.0, "e4m3": 20.0, "delayed": 20.0, "block1d": 20.0,
               "block2d": 20.0, "mxfp8": 20.0, "e5m2": 14.0, "nvfp4": 8.0,
               "nvfp4_rht": 8.0, "nvfp4_2d": 8.0, "nvfp4_sr": 6.0}

#: (rtol, atol as a fraction of the oracle's largest magnitude) of a Linear's results
#: against the fp64 product of its dequantized operands, by output dtype: the product is
#: accumulated in fp32 and rounded once to the output dtype.
ORACLE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -8, 2 ** -9)}

#: Kinds whose quantize is not a function of its input alone (random draws).
RANDOM_KINDS = {"nvfp4_sr"}

K, N, M, EXPERTS = 256, 128, 192, 2


@dataclass
class Outcome:
    """What :func:`check` found: ``failures`` (empty: conforms) or the ``refusal``."""

    case: Case
    failures: list = field(default_factory=list)
    refusal: str | None = None


def build_module(case: Case, device, dtype):
    torch.manual_seed(0)
    kw = dict(params_dtype=dtype, device=device, name="m")
    if case.module == "linear":
        return lowprec.Linear(K, N, bias=True, **kw)
    if case.module == "layernorm_linear":
        return lowprec.LayerNormLinear(K, N, bias=True, **kw)
    if case.module == "layernorm_mlp":
        return lowprec.LayerNormMLP(K, N, bias=True, **kw)
    if case.module == "grouped_linear":
        return lowprec.GroupedLinear(EXPERTS, K, N, bias=True, **kw)
    if case.module == "ops_linear":
        return lowprec.ops.Linear(K, N, bias=True, **kw)
    raise ValueError(f"unknown module {case.module!r}")


def recipe_of(case: Case, device):
    def factory(role):
        if role is None or role.tensor_type not in ("input", "weight", "grad_output"):
            return lowprec.IdentityQuantizer()
        return case.quantizer(role.tensor_type, device)
    return lowprec.recipe.CustomRecipe(factory, backward_mode=case.backward_mode)


def _call(module, case, x):
    if case.module == "grouped_linear":
        return module(x, [M // 2 - 8, M - (M // 2 - 8)])
    return module(x)


def _inputs(case, device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    out = K if case.module == "layernorm_mlp" else N
    dy = torch.randn(M, out, generator=g).to(device=device, dtype=dtype)
    return x, dy


def _step(fn, module, case, recipe, x, dy, inside: bool):
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(7)  # the same stochastic-rounding draws in every run
    if inside:
        y = fn(x)
    else:
        with lowprec.autocast(recipe=recipe):
            y = fn(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


class _Recorder:
    """A torch.compile backend that records every call_function target of the graphs AOT
    autograd makes, then hands them to ``inner`` (inductor on CUDA, the eager runner on
    the CPU, whose route decisions are still CUDA's where ``cuda_routes`` is on)."""

    def __init__(self, inductor: bool):
        self.targets: list[str] = []
        self.inductor = inductor

    def __call__(self, gm, example_inputs):
        self.targets += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        if self.inductor:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        def record(g, _inputs):
            self.targets += [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
            return g
        # inductor's partitioner: what the forward keeps and what the backward recomputes
        # is decided as on CUDA
        return aot_autograd(fw_compiler=record, bw_compiler=record,
                            partition_fn=min_cut_rematerialization_partition,
                            decompositions=select_decomp_table())(gm, example_inputs)


def _sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    noise = (ref - test).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


def _reference(case, module, x, dy):
    """``module`` unquantized in fp64 (no autocast): its output and gradients."""
    m = copy.deepcopy(module).double()
    return _step(lambda t: _call(m, case, t), m, case, None, x.double(), dy.double(),
                 inside=True)


def _dequantized(q, t, usage):
    q = q.copy()
    q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    return q.quantize(t).dequantize(dtype=torch.float32, usage=usage).double()


def _linear_oracle(case, device, module, x, dy) -> dict:
    """The fp64 products of each quantizer's dequantized operands that a Linear's GEMMs
    read: y, dx and weight's gradient (wgrad), as the backward mode reads them."""
    qx, qw, qdy = (case.quantizer(r, device) for r in ("input", "weight", "grad_output"))
    w = module.weight.detach()
    xr, wr = _dequantized(qx, x, "rowwise"), _dequantized(qw, w, "rowwise")
    out = {"y": xr @ wr.t() + module.bias.detach().double()}
    mode = case.backward_mode
    if mode == BackwardMode.DEFAULT:
        out["dx"] = _dequantized(qdy, dy, "rowwise") @ _dequantized(qw, w, "columnwise")
        out["weight"] = _dequantized(qdy, dy, "columnwise").t() @ _dequantized(qx, x, "columnwise")
    elif mode == BackwardMode.DEQUANTIZED:
        out["dx"], out["weight"] = dy.double() @ wr, dy.double().t() @ xr
    else:
        out["dx"], out["weight"] = dy.double() @ w.double(), dy.double().t() @ x.double()
    return out


def _oracle_failures(case, device, module, x, dy, got) -> list[str]:
    failures = []
    used = case.kinds_used()
    if case.module == "linear" and not used & RANDOM_KINDS:
        rtol, atol = ORACLE_TOL[x.dtype]
        for name, want in _linear_oracle(case, device, module, x, dy).items():
            have = got[name].double()
            bound = rtol * want.abs() + atol * want.abs().max()
            bad = ((have - want).abs() > bound) & ~(want.isnan() & have.isnan())
            if bad.any():
                failures.append(f"oracle: {name} differs from the dequantize-then-matmul "
                                f"product in {int(bad.sum())} of {bad.numel()} elements")
    ref = _reference(case, module, x, dy)
    floor = min(MIN_SQNR_DB[k] for k in used)
    for name, want in ref.items():
        db = _sqnr_db(want, got[name])
        if not db >= floor:
            failures.append(f"sqnr: {name} {db:.1f} dB < {floor} dB")
    return failures


def _crash(stage: str, e: BaseException) -> str:
    """``stage: Type: message (innermost lowprec frame)``."""
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/lowprec/" in f.filename]
    where = ""
    if frames:
        where = f" at {frames[-1].filename.split('/lowprec/')[-1]}:{frames[-1].lineno}"
    first = (str(e).splitlines() or [""])[0][:300]
    return f"{stage}: {type(e).__name__}: {first}{where}"


def check(case: Case, device: str = "cpu", dtype=None, *, oracle: bool = True,
          cuda_routes: bool = False) -> Outcome:
    """Run ``case`` (see the module docstring) and return its :class:`Outcome`.
    ``cuda_routes``: on the CPU, every GEMM takes the route CUDA would
    (``lowprec.gemm.cuda_routes``)."""
    if cuda_routes:
        with lowprec.gemm.cuda_routes():
            return check(case, device, dtype, oracle=oracle)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    out = Outcome(case)
    recipe = recipe_of(case, device)
    inside = case.autocast == "inside"
    x, dy = _inputs(case, device, dtype)
    eager_m = build_module(case, device, dtype)
    compiled_m, initial = copy.deepcopy(eager_m), copy.deepcopy(eager_m)

    def fn_of(m):
        if not inside:
            return lambda t: _call(m, case, t)

        def fn(t):
            with lowprec.autocast(recipe=recipe):
                return _call(m, case, t)
        return fn
    try:
        want = _step(fn_of(eager_m), eager_m, case, recipe, x, dy, inside)
    except ValueError as e:
        if "input" in str(e) or "weight" in str(e) or "grad_output" in str(e):
            out.refusal = f"{type(e).__name__}: {e}"
            return out
        out.failures.append(_crash("eager", e))
        return out
    except Exception as e:  # noqa: BLE001 - every crash is a finding
        out.failures.append(_crash("eager", e))
        return out
    torch._dynamo.reset()
    from lowprec.compile import call as opaque_call
    opaque_call._FALLBACKS.clear()  # each reason is logged once a process: this case's own
    rec = _Recorder(inductor=device == "cuda")
    compiled = torch.compile(fn_of(compiled_m), backend=rec, fullgraph=True)
    try:
        got = _step(compiled, compiled_m, case, recipe, x, dy, inside)
    except Exception as e:  # noqa: BLE001
        out.failures.append(_crash("compiled", e))
        return out
    opaque = [t for t in rec.targets if "lowprec.call" in t]
    if opaque:
        out.failures.append(f"opaque: lowprec::call ({'; '.join(opaque_call.fallback_reasons())})")
    for name in want:
        if name not in got or not torch.equal(want[name], got[name]):
            if name in got and want[name].isnan().equal(got[name].isnan()) and torch.equal(
                    want[name].nan_to_num(), got[name].nan_to_num()):
                continue
            out.failures.append(f"bits: compiled {name} differs from eager")
    if oracle:
        out.failures += _oracle_failures(case, device, initial, x, dy, want)
    return out
