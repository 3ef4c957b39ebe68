"""Module backward under every recipe (continues ``test_modules.py``'s numbering):

3. backward modes ``high_precision`` / ``dequantized`` reproduce, bit for bit, a hand-written
   fp32 backward on the original / dequantized forward operands;
4. GroupedLinear equals one Linear per group, bit for bit;
5. what the default mode saves for backward (quantized, columnwise only, small).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from modules_helpers import (
    E4M3,
    RECIPE_NAMES,
    dims_for,
    effective_class,
    expected_class,
    forward_backward,
    make_input,
    make_module,
    make_recipe,
    make_upstream,
    match_gemms,
    mlp_act,
    quantized_run,
    reference_run,
    sqnr_db,
)

import lowprec
from lowprec.formats.base import QuantizedTensor


# ================================================================================================
# 3. backward modes: high precision and dequantized backward, bit for bit
# ================================================================================================
def rowwise_forward_quantizers(rname):
    """Independently built (input, weight) quantizers of the recipe's forward, rowwise only."""
    if rname == "current":  # HYBRID: E4M3 forward
        qi, qw = (lowprec.Float8CurrentScalingQuantizer(E4M3),
                  lowprec.Float8CurrentScalingQuantizer(E4M3))
    elif rname == "mxfp8":
        qi, qw = lowprec.MXFP8Quantizer(E4M3), lowprec.MXFP8Quantizer(E4M3)
    elif rname == "nvfp4":  # inputs: RHT on the columnwise side only; weights: 16x16 blocks
        qi, qw = (lowprec.NVFP4Quantizer(with_rht=True),
                  lowprec.NVFP4Quantizer(with_2d_quantization=True))
    else:
        raise ValueError(rname)
    return [q.set_usage(rowwise=True, columnwise=False) for q in (qi, qw)]


def _act32(name, h):
    """The activations as Transformer Engine defines them (gelu: tanh approximation)."""
    if name == "gelu":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def _norm32(module, x):
    params = [module.layer_norm_weight.detach().clone().requires_grad_(True)]
    if module.normalization == "LayerNorm":
        params.append(module.layer_norm_bias.detach().clone().requires_grad_(True))
        out = F.layer_norm(x, (x.shape[-1],), params[0], params[1], module.eps)
    else:
        out = F.rms_norm(x, (x.shape[-1],), params[0], module.eps)
    return out, params


def manual_backward(kind, module, run, g, dims, operand):
    """fp32 gradients of the module written out by hand, with each GEMM's backward operands
    ``operand(t, 'input'|'weight')`` of the forward tensor t (original or dequantized).

    dgrad = dY @ W, wgrad = dY^T @ X, bias grad = column sum: the products the spec defines
    for high-precision backward GEMMs. Returns (grads, {gemm name: (gemm input, weight)}).
    """
    dy, x = run.dy, run.x
    lin = lambda dy2, X2, W: (dy2 @ W, dy2.t() @ X2, dy2.sum(0))  # noqa: E731
    if kind == "linear":
        dx, dw, db = lin(dy.reshape(-1, dims.out), operand(x, "input").reshape(-1, dims.hidden),
                         operand(module.weight, "weight"))
        return {"x": dx.reshape(x.shape), "weight": dw, "bias": db}, {"main": (x, module.weight)}
    if kind == "grouped":
        grads, fwd_in, dxs = {}, {}, []
        for i, (xi, dyi) in enumerate(zip(torch.split(x, list(dims.m_splits)),
                                          torch.split(dy, list(dims.m_splits)))):
            w = getattr(module, f"weight{i}")
            dxi, grads[f"weight{i}"], grads[f"bias{i}"] = lin(dyi, operand(xi, "input"),
                                                              operand(w, "weight"))
            dxs.append(dxi)
            fwd_in[f"g{i}"] = (xi, w)
        grads["x"] = torch.cat(dxs)
        return grads, fwd_in

    xl = x.clone().requires_grad_(True)
    ln, norm_params = _norm32(module, xl)
    norm_names = ["layer_norm_weight", "layer_norm_bias"][:len(norm_params)]
    if kind == "ln_linear":
        dln, dw, db = lin(dy.reshape(-1, dims.out),
                          operand(ln.detach(), "input").reshape(-1, dims.hidden),
                          operand(module.weight, "weight"))
        grads = {"weight": dw, "bias": db}
        fwd_in = {"main": (ln.detach(), module.weight)}
    else:  # LayerNormMLP; fc1's output is taken from the run (quantized forward)
        f1 = module.fc1_weight.shape[0]
        h1 = g["fc1", "fprop"].out.reshape(*x.shape[:-1], f1).requires_grad_(True)
        a = _act32(mlp_act(kind), h1)
        da, dw2, db2 = lin(dy.reshape(-1, dims.hidden),
                           operand(a.detach(), "input").reshape(-1, dims.ffn),
                           operand(module.fc2_weight, "weight"))
        (dh1,) = torch.autograd.grad(a, h1, da.reshape(a.shape))
        dln, dw1, db1 = lin(dh1.reshape(-1, f1),
                            operand(ln.detach(), "input").reshape(-1, dims.hidden),
                            operand(module.fc1_weight, "weight"))
        grads = {"fc1_weight": dw1, "fc1_bias": db1, "fc2_weight": dw2, "fc2_bias": db2}
        fwd_in = {"fc1": (ln.detach(), module.fc1_weight), "fc2": (a.detach(), module.fc2_weight)}
    dnorm = torch.autograd.grad(ln, [xl, *norm_params], dln.reshape(ln.shape))
    grads.update(zip(["x", *norm_names], dnorm))
    return grads, fwd_in


BWD_RECIPES = ["current", "mxfp8", "nvfp4"]
BWD_KINDS = ["linear", "ln_linear", "mlp_gelu", "mlp_swiglu", "grouped"]


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
@pytest.mark.parametrize("rname", BWD_RECIPES)
@pytest.mark.parametrize("kind", BWD_KINDS)
def test_backward_modes_bit_exact(kind, rname, mode):
    dims = dims_for(rname)
    module, run, calls = quantized_run(kind, rname, mode)
    g = match_gemms(calls, kind, dims)
    qi, qw = rowwise_forward_quantizers(rname)
    qdq = lambda q, t: q.quantize(t.detach()).dequantize()  # noqa: E731
    if mode == "high_precision":
        operand = lambda t, role: t.detach()  # noqa: E731
    else:
        operand = lambda t, role: qdq(qi if role == "input" else qw, t)  # noqa: E731
    expected, fwd_in = manual_backward(kind, module, run, g, dims, operand)

    for (name, p), c in g.items():
        if p == "fprop":
            # The forward is quantized in every mode: exactly the independent rowwise quantization.
            gin, w = fwd_in[name]
            assert issubclass(c.a_cls, QuantizedTensor) and issubclass(c.b_cls, QuantizedTensor)
            assert torch.equal(c.a_deq, qdq(qi, gin).reshape(c.a_deq.shape)), f"{name} fprop input"
            assert torch.equal(c.b_deq, qdq(qw, w)), f"{name} fprop weight"
        else:
            assert not issubclass(c.a_cls, QuantizedTensor), f"{name}.{p}: quantized gradient"
            assert not issubclass(c.b_cls, QuantizedTensor), f"{name}.{p}: quantized operand"
    assert set(expected) == set(run.grads)
    for name, ref in expected.items():
        assert torch.equal(run.grads[name], ref), (
            f"{mode} {name} grad differs from the manual backward")

    if mode == "high_precision" and not kind.startswith("mlp_"):
        # Without a quantized activation in between, the gradients are those of the
        # unquantized module given the same upstream gradient, bit for bit.
        ref = reference_run(kind, dims)
        assert torch.equal(ref.dy, run.dy)
        assert sqnr_db(ref.y, run.y) < 60, "the forward must still be quantized"
        for name, t in ref.grads.items():
            assert torch.equal(run.grads[name], t), (
                f"{name} grad differs from the unquantized module")


# ================================================================================================
# 4. GroupedLinear == one Linear per group, bit for bit
# ================================================================================================
@pytest.mark.parametrize("rname", RECIPE_NAMES)
def test_grouped_equals_per_group_linears(rname):
    dims = dims_for(rname)
    splits = list(dims.m_splits)  # multiples of the format's block (128 for block FP8)
    grouped = make_module("grouped", dims)
    lins = []
    for i in range(3):
        lin = lowprec.Linear(dims.hidden, dims.out, name="grp")
        with torch.no_grad():
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
        lins.append(lin)
    recipe = make_recipe(rname)
    # Two steps: delayed scaling's second step uses scales updated from each group's own amaxes.
    for step in range(2):
        x = make_input("grouped", dims, seed=10 + step)
        dy = make_upstream((sum(splits), dims.out), seed=20 + step)
        run = forward_backward(grouped, "grouped", x, dims, dy, recipe=recipe, seed=30 + step)

        for lin in lins:
            lin.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_(True)
        # Same seed and the same graph shape (split -> Linears in group order -> cat), so the
        # backward runs the groups in the same order and stochastic rounding draws the same
        # numbers for the same group.
        torch.manual_seed(30 + step)
        with lowprec.autocast(recipe=recipe):
            y = torch.cat([lin(xi) for lin, xi in zip(lins, torch.split(xl, splits))])
        y.backward(dy)

        assert torch.equal(run.y, y.detach()), f"step {step}: forward"
        assert torch.equal(run.grads["x"], xl.grad), f"step {step}: input grad"
        for i, lin in enumerate(lins):
            assert torch.equal(run.grads[f"weight{i}"], lin.weight.grad), f"step {step}: weight{i}"
            assert torch.equal(run.grads[f"bias{i}"], lin.bias.grad), f"step {step}: bias{i}"


# ================================================================================================
# 5. what the default backward mode saves
# ================================================================================================
def _nbytes(t):
    """Bytes actually held: the inner tensors of a quantized tensor (recursively for hybrids)."""
    if isinstance(t, QuantizedTensor):
        return sum(_nbytes(v) for v in t.inner_tensors().values() if v is not None)
    return t.nbytes


# Saved bytes / bf16 bytes of (input + weight). FP8 data is 1 byte vs 2; the scales add at most
# 4 B per 128 elements (1x128 fp32 block scales: +1.6%) or 1 B per 32 (MXFP8 E8M0: +1.6%):
# <= 0.52. NVFP4: 0.5 B of data + 1 B E4M3 scale per 16 elements (0.5625 / 2 = 0.281): <= 0.29.
# The custom recipe saves NVFP4 columnwise data (its hybrids' backward side).
SAVED_RATIO = {"delayed": 0.52, "current": 0.52, "block": 0.52, "mxfp8": 0.52, "nvfp4": 0.29,
               "custom_mx_nv": 0.29}


@pytest.mark.parametrize("needs", ["both", "input_only", "weight_only"])
@pytest.mark.parametrize("rname", RECIPE_NAMES)
def test_default_mode_saves_only_columnwise_quantized(rname, needs):
    dims = dims_for(rname)
    lin = make_module("linear", dims, dtype=torch.bfloat16)
    x = make_input("linear", dims, dtype=torch.bfloat16)
    need_dx = needs in ("both", "input_only")
    need_dw = needs in ("both", "weight_only")
    x.requires_grad_(need_dx)
    lin.weight.requires_grad_(need_dw)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with lowprec.autocast(recipe=make_recipe(rname)):
            y = lin(x)
    # The weight parameter itself may be saved (it holds no memory of its own): backward
    # then makes its columnwise copy (``LinearPlan.w_in_backward``).
    deferred = any(t is lin.weight for t in saved)
    assert not deferred or need_dx
    saved = [t for t in saved if t is not lin.weight]
    big = {x.numel(), lin.weight.numel()}
    quantized = [t for t in saved if isinstance(t, QuantizedTensor)]
    for t in saved:
        if not isinstance(t, QuantizedTensor):
            assert not (t.is_floating_point() and t.numel() in big), (
                f"a plain {t.dtype} tensor of shape {tuple(t.shape)} was saved for backward")
    # dgrad needs the weight, wgrad the input: exactly those, as columnwise quantized tensors.
    want = sorted(([tuple(lin.weight.shape)] if need_dx and not deferred else [])
                  + ([tuple(x.shape)] if need_dw else []))
    assert sorted(tuple(t.shape) for t in quantized) == want
    for t in quantized:
        role = "weight" if tuple(t.shape) == tuple(lin.weight.shape) else "input"
        assert issubclass(effective_class(t, "columnwise"),
                          expected_class(rname, role, "columnwise"))
        assert t.has_usage("columnwise") and not t.has_usage("rowwise"), repr(t)
    hp_bytes = 2 * (x.numel() + lin.weight.numel())  # bf16 input + weight
    ratio = sum(_nbytes(t) for t in saved) / hp_bytes
    assert ratio <= SAVED_RATIO[rname], f"saved {ratio:.3f} of the bf16 input+weight bytes"
    y.float().sum().backward()  # the saved tensors are enough for the backward
    assert (x.grad is not None) == need_dx and (lin.weight.grad is not None) == need_dw


