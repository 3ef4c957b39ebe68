"""State dicts of modules built under ``quantized_model_init``: a quantized weight enters
``state_dict()`` as plain high-precision values (its dequantized values, in its dtype), so
safetensors and every tensor-only format take it, and its exact bytes travel in
``_extra_state``: loading the state dict restores the quantized weight bit for bit in every
format, including those where re-quantizing the dequantized values would not (MXFP8,
128x128 block FP8, delayed scaling). An edited weight, or a checkpoint of another format,
is re-quantized instead. ``torch.save``/``torch.load``, ``load_state_dict(assign=True)``,
``keep_vars=True``, older state dicts holding quantized tensors and
``torch.distributed.checkpoint`` (one process) keep working."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import assert_same_quantized
from torch import nn

import lowprec
from lowprec.formats.base import QuantizedTensor
from lowprec.modules import extra_state
from lowprec.recipe.recipes import Float8CurrentScaling, MXFP8BlockScaling, Recipe

RECIPES = {
    **{name: (lambda name=name: Recipe.from_name(name)) for name in (
        "fp8_delayed", "fp8_current", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
        "fp8_row_mxfp8_col")},
    "fp8_current_pow2": lambda: Float8CurrentScaling(use_power_2_scales=True),
    "mxfp8_2d": lambda: MXFP8BlockScaling(enable_2d_quantization=True),
}
KINDS = {
    "linear": lambda dt: lowprec.Linear(128, 256, params_dtype=dt),
    "layernorm_linear": lambda dt: lowprec.LayerNormLinear(128, 256, params_dtype=dt),
    "layernorm_mlp": lambda dt: lowprec.LayerNormMLP(128, 256, params_dtype=dt),
    "grouped_linear": lambda dt: lowprec.GroupedLinear(2, 128, 256, params_dtype=dt),
    "ops_linear": lambda dt: lowprec.ops.Linear(128, 256, params_dtype=dt),
}


def _build(rname, kind, seed, dtype=torch.float32, quantized=True):
    torch.manual_seed(seed)
    with lowprec.quantized_model_init(enabled=quantized, recipe=RECIPES[rname]()):
        return KINDS[kind](dtype)


def _trained_weights(m, seed):
    """Weights of trained-looking magnitudes (rows of different scales), copied in (each
    re-quantized by the module's weight quantizer, as an optimizer step does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in m._weight_names():
            w = getattr(m, name)
            rows = torch.exp(torch.randn(w.shape[0], 1, generator=g))
            w.copy_(torch.randn(w.shape, generator=g) * rows * 0.02)
    return m


def assert_same_module(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if isinstance(p, QuantizedTensor):
            assert isinstance(q, nn.Parameter), name
            assert_same_quantized(p, q, name)
        else:
            assert torch.equal(p, q), name
    assert a.scaling_state() == b.scaling_state()


def _safetensors_round_trip(sd, tmp_path):
    from safetensors.torch import load_file, save_file
    save_file(sd, tmp_path / "m.safetensors")
    return load_file(tmp_path / "m.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rname", list(RECIPES))
def test_safetensors_round_trip_is_bit_exact(rname, kind, dtype, tmp_path):
    """``safetensors.torch.save_file(m.state_dict())`` and a load into a module built with
    other weights: every quantized byte (codes, scales, usages), the other parameters and
    the delayed-scaling state come back as they were."""
    pytest.importorskip("safetensors")
    m = _trained_weights(_build(rname, kind, seed=0, dtype=dtype), seed=1)
    sd = m.state_dict()
    for name in m._weight_names():
        w, v = getattr(m, name), sd[name]
        assert type(v) is torch.Tensor and v.dtype == w.dtype and v.shape == w.shape, name
        assert torch.equal(v, w.dequantize()), name  # what the forward GEMM reads
    fresh = _build(rname, kind, seed=5, dtype=dtype)
    ids = [id(getattr(fresh, n)) for n in fresh._weight_names()]
    result = fresh.load_state_dict(_safetensors_round_trip(sd, tmp_path))
    assert not result.missing_keys and not result.unexpected_keys
    assert ids == [id(getattr(fresh, n)) for n in fresh._weight_names()]  # in place
    assert_same_module(m, fresh)


@pytest.mark.parametrize("rname", ["mxfp8", "fp8_block", "fp8_delayed"])
def test_the_saved_bytes_are_needed(rname):
    """Re-quantizing the dequantized values alone does not give the same bytes in these
    formats (MXFP8: a block whose largest code rounds down gets half the scale; 128x128
    blocks with power-of-two scales likewise; delayed scaling: the state's current scale is
    not the one the weight was quantized with): without its ``_extra_state`` the load
    re-quantizes and differs, which is why the bytes travel."""
    m = _build(rname, "linear", seed=0)
    w = torch.rand(m.weight.shape, generator=torch.Generator().manual_seed(1)) - 0.5
    w[:, 0] = 0.9  # each block's largest value: 0.9 * 2**8 = 230.4 rounds down to E4M3 224
    with torch.no_grad():
        m.weight.copy_(w)
    sd = {k: v for k, v in m.state_dict().items() if k != "_extra_state"}
    fresh = _build(rname, "linear", seed=5)
    fresh.load_state_dict(sd, strict=False)
    with pytest.raises(AssertionError):
        assert_same_quantized(m.weight, fresh.weight)


@pytest.mark.parametrize("rname", ["mxfp8", "fp8_current", "fp8_delayed"])
def test_an_edited_weight_is_requantized(rname):
    """A weight changed in the state dict after saving is not overridden by the saved
    bytes: it is re-quantized by the module's weight quantizer for those values, as a plain
    checkpoint (delayed scaling: the untrained module's slot seeded from them)."""
    m = _trained_weights(_build(rname, "linear", seed=0), seed=1)
    sd = m.state_dict()
    sd["weight"] = sd["weight"] * 2
    fresh, ref = _build(rname, "linear", seed=5), _build(rname, "linear", seed=5)
    fresh.load_state_dict(sd)
    q = ref.weight_quantizer(0, values=sd["weight"], copied=True)
    assert_same_quantized(fresh.weight, q.quantize(sd["weight"]))


def test_another_format_or_a_plain_module_takes_the_values():
    """The state dict of an MXFP8 model loads into a per-tensor FP8 model (re-quantized from
    the values) and into a module with plain weights (the values), strictly."""
    m = _trained_weights(_build("mxfp8", "layernorm_mlp", seed=0), seed=1)
    sd = m.state_dict()
    fp8, ref = (_build("fp8_current", "layernorm_mlp", seed=5) for _ in range(2))
    fp8.load_state_dict(sd)
    for i, name in enumerate(fp8._weight_names()):
        assert_same_quantized(getattr(fp8, name), ref.weight_quantizer(i).quantize(sd[name]))
    plain = _build("mxfp8", "layernorm_mlp", seed=5, quantized=False)
    plain.load_state_dict(sd)
    for name in plain._weight_names():
        assert torch.equal(getattr(plain, name), getattr(m, name).dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_values_cast_to_another_dtype_still_load_exactly(dtype):
    """A checkpoint whose weights were cast (``from_pretrained(torch_dtype=...)``-style)
    still carries exactly the saved weight's values in that dtype: the bytes are restored."""
    m = _trained_weights(_build("mxfp8", "linear", seed=0), seed=1)
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
          for k, v in m.state_dict().items()}
    fresh = _build("mxfp8", "linear", seed=5, dtype=dtype)
    fresh.load_state_dict(sd)
    assert_same_quantized(m.weight, fresh.weight)


@pytest.mark.parametrize("rname", ["mxfp8", "nvfp4", "fp8_delayed"])
def test_assign_torch_save_and_older_state_dicts(rname):
    """``load_state_dict(assign=True)`` assigns the exact weight; ``torch.save`` +
    ``torch.load(weights_only=True)`` of the state dict round trips; ``keep_vars=True`` keeps
    the quantized parameters; a state dict holding quantized tensors (as saved before this
    format) still loads."""
    m = _trained_weights(_build(rname, "layernorm_mlp", seed=0), seed=1)
    fresh = _build(rname, "layernorm_mlp", seed=5)
    fresh.load_state_dict(m.state_dict(), assign=True)
    for name in fresh._weight_names():
        assert isinstance(getattr(fresh, name), nn.Parameter)
    assert_same_module(m, fresh)
    with torch.no_grad():  # the assigned weights are linked to their module
        fresh.fc1_weight.copy_(torch.zeros(fresh.fc1_weight.shape))

    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = _build(rname, "layernorm_mlp", seed=5)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_module(m, fresh)

    kept = m.state_dict(keep_vars=True)
    assert all(kept[n] is getattr(m, n) for n in m._weight_names())
    older = {k: (v.detach() if isinstance(v, QuantizedTensor) else v) for k, v in kept.items()}
    older["_extra_state"] = extra_state.encode(m.scaling_state().states)  # version 1
    fresh = _build(rname, "layernorm_mlp", seed=5)
    fresh.load_state_dict(older)
    assert_same_module(m, fresh)


def test_extra_state_size_is_fixed_and_dcp_round_trips(tmp_path):
    """A fresh module's ``_extra_state`` has the trained one's size (DCP loads in place; the
    backward delayed-scaling state made by ``init_scaling_state``, as for plain weights), and
    ``torch.distributed.checkpoint`` (one process) saves and loads a quantized-weight module
    bit for bit (save, load into ``fresh.state_dict()``, ``load_state_dict``)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = _trained_weights(_build("fp8_delayed", "layernorm_mlp", seed=0), seed=1)
    with lowprec.autocast(recipe=RECIPES["fp8_delayed"]()):
        m(torch.randn(4, 128)).sum().backward()
    fresh = _build("fp8_delayed", "layernorm_mlp", seed=5)
    fresh.init_scaling_state(RECIPES["fp8_delayed"]())  # the backward state too, as trained
    assert fresh.state_dict()["_extra_state"].shape == m.state_dict()["_extra_state"].shape
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is ... a single process"
        dcp.save(m.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(sd)
    assert_same_module(m, fresh)


def test_extra_state_layout():
    """Version 2 of the ``_extra_state`` tensor: the delayed-scaling state reads as before
    (``decode``), the weights' bytes describe their layout; a module without quantized
    weights still writes version 1; an unknown version is named."""
    m = _build("fp8_current", "linear", seed=0)
    blob = m.get_extra_state()
    assert blob.dtype == torch.uint8 and blob.numel() > m.weight.numel()
    assert extra_state.decode(blob) == {}
    desc, pieces = extra_state.decode_weights(blob)["weight"]
    assert desc == extra_state.describe(m.weight)
    assert_same_quantized(extra_state.weight_from_bytes((desc, pieces), m.weight), m.weight)
    assert lowprec.Linear(128, 256).get_extra_state().numel() == 0
    bad = blob.clone()
    bad[8:16] = torch.tensor([7], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="version 7"):
        extra_state.decode(bad)


def test_meta_module_state_dict():
    """A quantized-weight module on the meta device has a state dict (meta values)."""
    with lowprec.quantized_model_init(recipe=MXFP8BlockScaling()):
        m = lowprec.Linear(128, 256, device="meta")
    sd = m.state_dict()
    assert sd["weight"].is_meta and sd["weight"].shape == (256, 128)
    assert sd["_extra_state"].numel() > 0
