"""Tensor and sequence parallelism under torch.compile on 2 ranks (CPU gloo): Linear,
LayerNormLinear and LayerNormMLP trace between torch's functional collectives, with no
opaque ``lowprec::call``, one graph, and outputs, input gradients and parameter gradients
bit-identical to eager's over two steps, for every recipe (without one, torch's linear
in the graph agrees to fp32 rounding, as without tensor parallelism). A sequence-parallel gather
moves the high-precision rows in the graph where eager sends quantized ones: the GEMMs
read the same bits either way (``test_tensor_parallel``'s quantized-gather test)."""

from __future__ import annotations

import itertools

import pytest
import spawn
import torch
import torch.distributed as dist
from helpers import GraphOps
from test_tensor_parallel import HIDDEN, TP, Block, _batch, _rows
from test_tp_styles import Net, _local, _plan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import lowprec
from lowprec.recipe import Recipe

RECIPES = ["none", "current", "delayed", "block", "mxfp8", "nvfp4", "nvfp4_plain",
           "mxfp8_fwd_nvfp4_bwd"]
#: the cases CI runs (each a compile of the block; the whole matrix is marked slow): the
#: replicated input and all-reduced output without and with a recipe, and the sequence-
#: parallel gathers of every kind eager sends (per-tensor, NVFP4 codes, a hybrid whose
#: forward gathers MXFP8 blocks) and of delayed scaling's state
QUICK = {False: ["none", "current"],
         True: ["current", "delayed", "nvfp4_plain", "mxfp8_fwd_nvfp4_bwd"]}
#: the quick cases whose block leaves out its LayerNormMLP (the NVFP4 graphs take the
#: longest to trace; their gathers are the column-parallel LayerNormLinear's, and the MLP's
#: sequence-parallel pair of collectives runs by default under the FP8 recipes)
WITHOUT_MLP = {"nvfp4_plain", "mxfp8_fwd_nvfp4_bwd"}
STEPS = 2


#: bf16 with NCCL (CUDA), where the traced forms of fp32 operands decline some GEMMs;
#: there without biases too (MXFP8's bf16 GEMM with a bias stays opaque on CUDA)
DTYPE = torch.bfloat16 if spawn.BACKEND == "nccl" else torch.float32
BIAS = spawn.BACKEND != "nccl"


class _Block(Block):
    """``Block`` without its torch GELU between the column- and the row-parallel Linear
    (inductor's decomposition of it, which the graphs run, rounds otherwise than eager)."""

    def __init__(self, group, sp: bool, mlp: bool = True):
        nn.Module.__init__(self)
        kw = dict(tp_group=group, sequence_parallel=sp, bias=BIAS)
        self.qkv = lowprec.LayerNormLinear(HIDDEN, 2 * HIDDEN, parallel_mode="column",
                                           name="qkv", **kw)
        self.proj = lowprec.Linear(2 * HIDDEN, HIDDEN, parallel_mode="row", name="proj", **kw)
        self.mlp = lowprec.LayerNormMLP(HIDDEN, 2 * HIDDEN, name="mlp", **kw) if mlp else None

    def forward(self, x):
        h = x + self.proj(self.qkv(x))
        return h if self.mlp is None else h + self.mlp(h)


def _recipe(name: str):
    if name == "none":
        return None
    if name == "delayed":
        return lowprec.DelayedScaling(amax_history_len=2)
    if name == "nvfp4_plain":
        return lowprec.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)
    return Recipe.from_name(name)


def _steps(fn, model, recipe, rank: int, sp: bool):
    """Per step: the output, the input's gradient and every parameter's gradient."""
    torch.manual_seed(11)  # NVFP4's stochastic-rounding keys: the same draws each run
    out = []
    for step in range(STEPS):
        x, t = _batch(step, spawn.device(rank))
        x = _rows(x, rank, sp).to(DTYPE).requires_grad_(True)
        t = _rows(t, rank, sp)
        for p in model.parameters():
            p.grad = None
        with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
            y = fn(x)
        ((y.float() - t) ** 2).sum().backward()
        out.append([y.detach(), x.grad] + [p.grad for p in model.parameters()])
    return out


def _worker(rank, world, sp, recipes, mlp=True):
    for rname in recipes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = _Block(dist.group.WORLD, sp, mlp).to(spawn.device(rank), DTYPE)
        torch.manual_seed(0)
        model = _Block(dist.group.WORLD, sp, mlp).to(spawn.device(rank), DTYPE)
        model.load_state_dict(eager.state_dict())
        ops = GraphOps()
        compiled = torch.compile(model, backend=ops, fullgraph=True)
        want = _steps(eager, eager, _recipe(rname), rank, sp)
        got = _steps(compiled, model, _recipe(rname), rank, sp)
        for step, (w, g) in enumerate(zip(want, got)):
            for i, (a, b) in enumerate(zip(w, g)):
                where = f"{rname} sp={sp}: step {step}, tensor {i}"
                if rname == "none":  # torch's linear in the graph: fp32 rounding apart
                    err = (a - b).norm().item()
                    assert err <= 1e-5 * a.norm().item(), f"{where}: {err:.3e} apart"
                else:
                    assert torch.equal(a, b), where
        assert not any(t.startswith("lowprec.call") for t in ops.steady()), rname
        collectives = [t for t in ops.steady() if "_c10d_functional" in t]
        assert collectives, rname


@pytest.mark.parametrize("sp, rname", [
    pytest.param(sp, rname, id=f"{'tp_sp' if sp else 'tp'}-{rname}")
    for sp, names in QUICK.items() for rname in names])
def test_tensor_parallel_traces_bit_identical(sp, rname):
    """TP=2 with and without SP (``QUICK``'s recipes, a spawn each: a compile of the block
    takes seconds, and the cases spread over the test workers): compiled equals eager bit
    for bit with no opaque call."""
    spawn.run(_worker, TP, sp, [rname], not (sp and rname in WITHOUT_MLP))


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_traces_bit_identical_every_recipe(sp):
    """As above for every recipe."""
    spawn.run(_worker, TP, sp, RECIPES)


class _Net(Net):
    """``test_tp_styles``' net without its torch ReLUs (see ``_Block``)."""

    def forward(self, x):
        h = x + self.proj(self.qkv(x))
        return h + self.fc2(self.fc1(h))


def _styles_worker(rank, world, every=False):
    mesh = init_device_mesh(spawn.device(rank).type, (world,))
    # (the net has biases: MXFP8 with NCCL on CUDA would keep its opaque op)
    recipes = ("mxfp8",) if every else ("current",)
    for rname, sp in itertools.product(recipes, (False, True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = parallelize_module(_Net().to(spawn.device(rank), DTYPE), mesh, _plan(sp))
        model = parallelize_module(_Net().to(spawn.device(rank), DTYPE), mesh, _plan(sp))
        model.load_state_dict(eager.state_dict())
        ops = GraphOps()
        compiled = torch.compile(model, backend=ops, fullgraph=True)
        outs = ([], [])
        for step in range(STEPS):
            x, t = _batch(step, spawn.device(rank))
            x, t = _rows(x, rank, sp).to(DTYPE), _rows(t, rank, sp)
            for out, (fn, m) in zip(outs, ((eager, eager), (compiled, model))):
                for p in m.parameters():
                    p.grad = None
                with lowprec.autocast(recipe=_recipe(rname)):
                    y = fn(x)
                ((y.float() - t) ** 2).sum().backward()
                out += [y.detach()] + [_local(p.grad) for p in m.parameters()]
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"{rname} sp={sp}: tensor {i}"
        assert not any(t.startswith("lowprec.call") for t in ops.steady()), (rname, sp)


def test_tensor_parallel_styles_trace_bit_identical():
    """The DTensor styles (``parallelize_module``): the swapped-in local shards trace like
    the modules' own split, bit for bit against eager, TP and SP."""
    spawn.run(_styles_worker, TP)


@pytest.mark.slow
@pytest.mark.skipif(not BIAS, reason="the net's biases keep MXFP8's opaque op under NCCL")
def test_tensor_parallel_styles_trace_bit_identical_mxfp8():
    """As above, under MXFP8."""
    spawn.run(_styles_worker, TP, True)


def _module_cases(group):
    """(name, module factory, recipe, torch.autocast on) of the module-level cases."""
    h = HIDDEN
    sp = dict(tp_group=group, sequence_parallel=True)
    return [
        ("ln_linear_out", lambda: lowprec.LayerNormLinear(
            h, 2 * h, parallel_mode="column", return_layernorm_output=True, **sp),
         lowprec.Float8CurrentScaling(), False),
        ("column_amp", lambda: lowprec.Linear(h, 2 * h, parallel_mode="column", **sp),
         lowprec.Float8CurrentScaling(), True),
        ("row_amp", lambda: lowprec.Linear(2 * h, h, parallel_mode="row", **sp),
         lowprec.MXFP8BlockScaling(), True),
        ("mlp_dequantized", lambda: lowprec.LayerNormMLP(h, 2 * h, **sp),
         lowprec.Float8CurrentScaling(backward_mode="dequantized"), False),
        ("mlp_high_precision", lambda: lowprec.LayerNormMLP(h, 2 * h, **sp),
         lowprec.MXFP8BlockScaling(backward_mode="high_precision"), False),
        ("row_delayed", lambda: lowprec.Linear(2 * h, h, parallel_mode="row", tp_group=group),
         lowprec.DelayedScaling(amax_history_len=2), False),
    ]


def _modules_worker(rank, world):
    device = spawn.device(rank)
    for name, make, recipe, amp in _module_cases(dist.group.WORLD):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = make().to(device, DTYPE)
        model = make().to(device, DTYPE)
        model.load_state_dict(eager.state_dict())
        ops = GraphOps()
        compiled = torch.compile(model, backend=ops, fullgraph=True)
        k = model.weight.shape[1] if name.startswith("row") else HIDDEN
        outs = ([], [])
        for step in range(STEPS):
            g = torch.Generator().manual_seed(20 + 10 * step + rank)
            x = torch.randn(64, 2, k, generator=g).to(device, DTYPE)
            for out, (fn, m) in zip(outs, ((eager, eager), (compiled, model))):
                for p in m.parameters():
                    p.grad = None
                xx = x.clone().requires_grad_(True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp), \
                        lowprec.autocast(recipe=recipe):
                    y = fn(xx)
                ys = y if isinstance(y, tuple) else (y,)
                sum((t.float() ** 2).sum() for t in ys).backward()
                out += [t.detach() for t in ys] + [xx.grad] + [p.grad for p in m.parameters()]
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"{name}: tensor {i}"
        assert not any(t.startswith("lowprec.call") for t in ops.steady()), name


def test_tensor_parallel_module_cases_trace_bit_identical():
    """The norm's output returned, torch.autocast around the call (where eager's
    sequence-parallel gather then moves the cast rows' high-precision values), the
    dequantized and high-precision backward modes and delayed scaling on a row-parallel
    GEMM: compiled equals eager bit for bit over two steps, with no opaque call."""
    spawn.run(_modules_worker, TP)
