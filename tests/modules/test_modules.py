"""Linear, LayerNormLinear, LayerNormMLP and GroupedLinear under every recipe.

Expectations are computed independently of lowprec's GEMM code:

1. every GEMM the modules run is recorded (``lowprec.linear.function.gemm`` wrapped) and its
   result is compared with a float64 product of its dequantized operands; module outputs and
   every gradient are tied to those GEMM results (bias and norm gradients through float64
   re-derivations);
2. quantized vs unquantized fp32 module: SQNR above per-format thresholds;
6. errors; 7. behaviour outside autocast and with the identity recipe.

Backward modes, GroupedLinear vs per-group Linears and what backward saves (3-5) are in
``test_module_backward.py``; the helpers in ``modules_helpers.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from modules_helpers import (
    FP32_EPS,
    MODULE_NAMES,
    RECIPE_NAMES,
    SMALL_DIMS,
    act64,
    assert_bounded,
    check_gemm_fp64,
    check_sum_fp64,
    dims_for,
    expected_class,
    forward_backward,
    make_input,
    make_module,
    make_recipe,
    make_upstream,
    match_gemms,
    mlp_act,
    norm64,
    quantized_run,
    reference_run,
    sqnr_db,
)

import lowprec


# ================================================================================================
# 1. every GEMM vs float64 of its dequantized operands; outputs and all gradients tied to them
# ================================================================================================
@pytest.mark.parametrize("rname", RECIPE_NAMES)
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_gemms_and_grads_match_fp64_of_dequantized_operands(kind, rname):
    dims = dims_for(rname)
    module, run, calls = quantized_run(kind, rname)
    g = match_gemms(calls, kind, dims)
    # (role of a, role of b) per GEMM: fprop X.W, dgrad dY.W, wgrad dY.X
    roles = {"fprop": ("input", "weight"), "dgrad": ("grad", "weight"), "wgrad": ("grad", "input")}

    for (name, p), c in g.items():
        want_a = expected_class(rname, roles[p][0], c.a_usage)
        want_b = expected_class(rname, roles[p][1], c.b_usage)
        assert issubclass(c.a_cls, want_a) and issubclass(c.b_cls, want_b), (
            f"{name}.{p}: operands {c.a_cls.__name__}, {c.b_cls.__name__}; expected "
            f"{want_a.__name__}, {want_b.__name__}")
        check_gemm_fp64(c, f"{kind}/{rname} {name}.{p}")

    grads, dy = run.grads, run.dy
    if kind in ("linear", "ln_linear"):
        fprop, dgrad, wgrad = g["main", "fprop"], g["main", "dgrad"], g["main", "wgrad"]
        assert torch.equal(run.y, fprop.out.reshape(run.y.shape))
        assert torch.equal(grads["weight"], wgrad.out)
        check_sum_fp64(grads["bias"], dy, "bias grad")
        if kind == "linear":
            assert torch.equal(grads["x"], dgrad.out.reshape(run.x.shape))
            dnorm = None
        else:
            dnorm = dgrad.out
    elif kind == "grouped":
        outs = [g[f"g{i}", "fprop"].out for i in range(3)]
        assert torch.equal(run.y, torch.cat(outs))
        assert torch.equal(grads["x"], torch.cat([g[f"g{i}", "dgrad"].out for i in range(3)]))
        for i, dyi in enumerate(torch.split(dy, list(dims.m_splits))):
            assert torch.equal(grads[f"weight{i}"], g[f"g{i}", "wgrad"].out)
            check_sum_fp64(grads[f"bias{i}"], dyi, f"bias{i} grad")
        dnorm = None
    else:  # LayerNormMLP
        assert torch.equal(run.y, g["fc2", "fprop"].out.reshape(run.y.shape))
        assert torch.equal(grads["fc1_weight"], g["fc1", "wgrad"].out)
        assert torch.equal(grads["fc2_weight"], g["fc2", "wgrad"].out)
        check_sum_fp64(grads["fc2_bias"], dy, "fc2_bias grad")
        # fc1's gradient: the activation's backward in float64 from the recorded fc1 output
        # (bias included) and the recorded fc2 dgrad.
        h1 = g["fc1", "fprop"].out.double().requires_grad_(True)
        da = g["fc2", "dgrad"].out.double()
        (dh1,) = torch.autograd.grad(act64(mlp_act(kind), h1), h1, da)
        # fp32 activation backward: a few roundings per element, each of at most the size of
        # the partial derivative times |da|, <= 1.2 |da| (1 + max|h1|) for gelu (|gelu'| <= 1.13),
        # relu and swiglu (|silu'| <= 1.1, |silu(a)| <= |a|); then a recursive sum over M rows.
        da_cols = torch.cat([da, da], -1) if mlp_act(kind) == "swiglu" else da
        scale = 1.2 * (1 + float(h1.detach().abs().max())) * da_cols.abs().sum(0)
        assert_bounded(grads["fc1_bias"], dh1.sum(0), (dims.m + 8) * FP32_EPS * scale,
                       "fc1_bias grad")
        dnorm = g["fc1", "dgrad"].out

    if dnorm is not None:
        # Norm backward in float64 from the recorded dgrad of the first GEMM.
        x64 = run.x.double().requires_grad_(True)
        y64, params = norm64(module, x64)
        refs = torch.autograd.grad(y64, [x64, *params], dnorm.double().reshape(y64.shape))
        names = ["x", "layer_norm_weight", "layer_norm_bias"][:len(refs)]
        for pname, ref in zip(names, refs):
            # fp32 norm forward+backward: elementwise ops plus reductions over K (x) or M rows
            # (params) in blocked order; observed <= 4.2 u max|ref| on these shapes, 32 u max|ref|
            # keeps 8x margin and is still ~3e4x below any quantization effect (>= 2^-4).
            bound = 32 * FP32_EPS * float(ref.abs().max()) * torch.ones_like(ref)
            assert_bounded(grads[pname], ref, bound, f"{pname} grad")


# ================================================================================================
# 2. quantized vs unquantized fp32 module: SQNR per format
# ================================================================================================
# Thresholds sit ~2-3 dB under the values measured on these shapes and seeds (in brackets),
# which follow from the element formats: E4M3 keeps 3 mantissa bits (relative rounding error
# <= 2^-4, ~29 dB per quantized operand, ~28 dB for a product of two), E5M2 2 bits (~6 dB
# less), NVFP4's E2M1 1 bit with 16-element E4M3 block scales (~15-17 dB). Output SQNR depends
# on the forward format, gradient SQNR on the gradient format (and the forward noise they see).
# "mlp": the gradients cross two quantized GEMMs in each direction (~3-4 dB more noise).
# "mlp_relu": relu's step derivative turns forward noise into flipped gradient entries where a
# pre-activation changes sign: an O(1) error on a few percent of entries, hence ~10 dB lower.
FWD_FORMAT = {"delayed": "fp8", "current": "fp8", "block": "fp8", "mxfp8": "fp8",
              "nvfp4": "nvfp4", "custom_mx_nv": "fp8"}
GRAD_FORMAT = {"delayed": "e5m2", "current": "e5m2", "block": "e4m3", "mxfp8": "e4m3",
               "nvfp4": "nvfp4", "custom_mx_nv": "nvfp4"}
OUT_DB = {"fp8": {"single": 25.0,     # [28.3, 29.3]
                  "mlp": 22.0},       # [24.3, 25.9]
          "nvfp4": {"single": 14.0,   # [16.7]
                    "mlp": 10.5}}     # [12.7, 13.5]
GRAD_DB = {"e5m2": {"single": 22.0,     # [24.0, 25.5]
                    "mlp": 18.0,        # [20.1, 23.3]
                    "mlp_relu": 12.5},  # [14.9, 22.9]
           "e4m3": {"single": 25.5,     # [27.8, 29.0]
                    "mlp": 19.5,        # [21.9, 27.9]
                    "mlp_relu": 13.0},  # [15.4, 25.9]
           "nvfp4": {"single": 12.0,    # [14.3, 15.9]
                     "mlp": 6.0,        # [8.0, 15.4]
                     "mlp_relu": 4.5}}  # [6.8, 15.4]


def _group(kind):
    if kind == "mlp_relu":
        return "mlp_relu"
    return "mlp" if kind.startswith("mlp_") else "single"


@pytest.mark.parametrize("rname", RECIPE_NAMES)
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_sqnr_vs_unquantized(kind, rname):
    dims = dims_for(rname)
    _, run, _ = quantized_run(kind, rname)
    ref = reference_run(kind, dims)
    assert torch.equal(ref.x, run.x) and torch.equal(ref.dy, run.dy)
    group = _group(kind)
    out_min = OUT_DB[FWD_FORMAT[rname]]["mlp" if group != "single" else "single"]
    grad_min = GRAD_DB[GRAD_FORMAT[rname]][group]
    s = sqnr_db(ref.y, run.y)
    # The output must be quantized at all (identical to the fp32 module would be inf dB) ...
    assert s < 60, f"output SQNR {s:.1f} dB: autocast did not quantize"
    # ... and close to the fp32 module within the format's precision.
    assert s >= out_min, f"output SQNR {s:.1f} dB < {out_min}"
    assert set(ref.grads) == set(run.grads)
    for name in ref.grads:
        s = sqnr_db(ref.grads[name], run.grads[name])
        assert s >= grad_min, f"{name} grad SQNR {s:.1f} dB < {grad_min}"


# ================================================================================================
# 6. errors
# ================================================================================================
def _weight_none_factory(role):
    if role is not None and role.tensor_type == "weight":
        return None
    return lowprec.MXFP8Quantizer()


@pytest.mark.parametrize("rname,k,block", [("mxfp8", 48, 32), ("nvfp4", 24, 16),
                                           ("block", 64, 128)])
def test_unaligned_shape_is_padded_and_a_quantizer_takes_its_partial_block(rname, k, block):
    """A Linear pads a K that is not whole blocks for its GEMMs
    (tests/linear/test_feature_padding.py checks the values); the recipe's quantizer called
    directly quantizes it with a partial last block (tests/formats/test_partial_blocks.py)."""
    lin = lowprec.Linear(k, 64)
    x = torch.randn(2, 64, k)
    with lowprec.autocast(recipe=make_recipe(rname)):
        y = lin(x)
    assert y.shape == (2, 64, 64) and torch.isfinite(y).all()
    q = lin._recipe_states["forward"].quantizers[0]
    qt = q.quantize(x)
    assert qt.shape == x.shape and qt.partial("rowwise")
    assert qt.rowwise_scale.shape[-1] == -(-k // block)  # the last block along K partial


def test_per_tensor_fp8_accepts_any_shape():
    # Control for the test above: per-tensor scaling has no block, K=48 works and is accurate.
    torch.manual_seed(0)
    lin = lowprec.Linear(48, 40)
    x = torch.randn(3, 5, 48)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y = lin(x)
    assert sqnr_db(F.linear(x, lin.weight, lin.bias), y.detach()) > 25  # E4M3: ~28-29 dB


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("quantized", [False, True])
def test_input_dtype_mismatch_raises_type_error(kind, quantized):
    module = make_module(kind, SMALL_DIMS)  # fp32 weights
    x = make_input(kind, SMALL_DIMS, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        with lowprec.autocast(enabled=quantized, recipe=lowprec.MXFP8BlockScaling()):
            if kind == "grouped":
                module(x, list(SMALL_DIMS.m_splits))
            else:
                module(x)


def test_custom_factory_returning_none_names_the_role():
    lin = lowprec.Linear(64, 64, name="my_layer")
    with pytest.raises(ValueError) as exc:
        with lowprec.autocast(recipe=lowprec.CustomRecipe(qfactory=_weight_none_factory)):
            lin(torch.randn(32, 64))
    msg = str(exc.value)
    assert "weight" in msg and "my_layer" in msg, msg


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "unquant", "dequant"])
def test_delayed_scaling_rejects_non_default_backward_mode(mode, monkeypatch):
    monkeypatch.delenv("LOWPREC_BACKWARD_MODE", raising=False)
    with pytest.raises(ValueError, match="backward_mode"):
        lowprec.DelayedScaling(backward_mode=mode)
    # The same mode from the environment variable is rejected too.
    monkeypatch.setenv("LOWPREC_BACKWARD_MODE", mode)
    with pytest.raises(ValueError):
        lowprec.DelayedScaling()
    assert lowprec.Float8CurrentScaling().backward_mode in ("high_precision", "dequantized")


# ================================================================================================
# 7. outside autocast: high precision; the identity recipe is no quantization
# ================================================================================================
@contextlib.contextmanager
def _nested_disabled():
    with lowprec.autocast(recipe=lowprec.NVFP4BlockScaling()):
        with lowprec.autocast(enabled=False):
            yield


@pytest.mark.parametrize("region", ["none", "disabled", "disabled_inside_enabled"])
def test_linear_outside_autocast_is_torch_linear(region):
    dims = SMALL_DIMS
    lin = make_module("linear", dims)
    x = make_input("linear", dims).requires_grad_(True)
    ctx = {"none": contextlib.nullcontext,
           "disabled": lambda: lowprec.autocast(enabled=False, recipe=lowprec.MXFP8BlockScaling()),
           "disabled_inside_enabled": _nested_disabled}[region]
    with ctx():
        y = lin(x)
    dy = make_upstream(y.shape)
    y.backward(dy)
    xb = x.detach().clone().requires_grad_(True)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = lin.bias.detach().clone().requires_grad_(True)
    yb = F.linear(xb, w, b)
    yb.backward(dy)
    # a Linear with no recipe runs torch.nn.functional.linear itself: the same bits
    for got, want in ((y, yb), (x.grad, xb.grad), (lin.weight.grad, w.grad),
                      (lin.bias.grad, b.grad)):
        assert torch.equal(got, want)


def _identity_factory(role):
    return lowprec.IdentityQuantizer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_identity_recipe_is_bit_identical_to_no_autocast(kind, dtype):
    dims = SMALL_DIMS
    module = make_module(kind, dims, dtype=dtype)
    x = make_input(kind, dims, dtype=dtype)
    plain = forward_backward(module, kind, x, dims)
    ident = forward_backward(module, kind, x, dims, plain.dy,
                             recipe=lowprec.CustomRecipe(qfactory=_identity_factory))
    assert plain.y.dtype == dtype and ident.y.dtype == dtype
    assert torch.equal(plain.y, ident.y)
    assert set(plain.grads) == set(ident.grads)
    for name, t in plain.grads.items():
        assert torch.equal(t, ident.grads[name]), name


@pytest.mark.parametrize("recipe", [None, "current"])
@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "ops.Linear",
                                  "GroupedLinear"])
def test_wrong_input_features_name_both_sizes(kind, recipe, amp):
    """A GEMM module given an input whose last dimension is not its in_features raises a
    ValueError naming both, with or without a recipe and torch.autocast (torch's own
    matmul or layer-norm error is a RuntimeError that does not name the module)."""
    if kind == "Linear":
        m, call = lowprec.Linear(64, 32), lambda x: m(x)
    elif kind == "LayerNormLinear":
        m = lowprec.LayerNormLinear(64, 32)
        call = lambda x: m(x)  # noqa: E731
    elif kind == "LayerNormMLP":
        m = lowprec.LayerNormMLP(64, 128)
        call = lambda x: m(x)  # noqa: E731
    elif kind == "ops.Linear":
        m = lowprec.ops.Linear(64, 32)
        call = lambda x: m(x)  # noqa: E731
    else:
        m = lowprec.GroupedLinear(2, 64, 32)
        call = lambda x: m(x, [24, 24])  # noqa: E731
    x = torch.randn(48, 48)
    ctx = (lowprec.autocast(recipe=lowprec.Float8CurrentScaling()) if recipe
           else contextlib.nullcontext())
    with ctx, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        with pytest.raises(ValueError, match=r"48 features.*expects 64"):
            call(x)
