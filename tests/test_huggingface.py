"""Hugging Face end to end on the CPU: a tiny ``LlamaForCausalLM`` converted with its recipe
attached (``convert_model(..., attach=True)``) trains under ``transformers.Trainer`` with
gradient checkpointing, saves checkpoints (safetensors: the state dict holds only tensors)
and resumes from them bit for bit under every recipe, delayed-scaling state included;
``save_pretrained``/``from_pretrained`` round trip; ``accelerate.Accelerator.prepare``
trains a converted model as a plain loop does. The same Llama with quantized weights
(``quantized_model_init``) saves with ``save_pretrained`` and Trainer, loads its quantized
weights back bit for bit, and its checkpoints load into the unconverted model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import assert_same_quantized
from same_run import delayed_states
from torch import nn

import lowprec
from lowprec.formats.base import QuantizedTensor
from lowprec.optim import QuantizedWeightOptimizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.filterwarnings("ignore")

RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4"]
STEPS, SAVE = 4, 2


def _recipe(name):
    extra = {"amax_history_len": 4} if name == "fp8_delayed" else {}
    return lowprec.Recipe.from_name(name, **extra)


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _converted(rname):
    return lowprec.convert_model(_llama(), _recipe(rname), attach=True)


def _data(n=32, seq=32):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (seq,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _train(rname, out, *, checkpointing=True, resume=None):
    """Train for STEPS steps (saving every SAVE); returns (step losses, model)."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, save_steps=SAVE,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, learning_rate=1e-3,
        gradient_checkpointing=checkpointing, disable_tqdm=True)
    model = _converted(rname)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return losses, model


def _assert_same_model(a, b):
    """Every parameter (a quantized weight's bytes) and the delayed-scaling state."""
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if isinstance(p, QuantizedTensor):
            assert isinstance(q, nn.Parameter), n
            assert_same_quantized(p, q, n)
        else:
            assert torch.equal(p, q), n
    sa, sb = delayed_states(a), delayed_states(b)
    assert sa.keys() == sb.keys()
    for key, sd in sa.items():
        for k, v in sd.items():
            assert torch.equal(v, sb[key][k]), (key, k)


def _resumed_run_matches(train, rname, tmp_path):
    """``train`` run whole and resumed from its step-``SAVE`` checkpoint (safetensors): the
    same losses after it, the same weights and state at the end; the whole run's (losses, model)."""
    full, model = train(rname, tmp_path / "full")
    assert sorted(full) == list(range(1, STEPS + 1))
    ckpt = tmp_path / "full" / f"checkpoint-{SAVE}"
    assert (ckpt / "model.safetensors").exists()
    resumed, resumed_model = train(rname, tmp_path / "resumed", resume=str(ckpt))
    assert {s: resumed[s] for s in range(SAVE + 1, STEPS + 1)} == {
        s: full[s] for s in range(SAVE + 1, STEPS + 1)}
    _assert_same_model(model, resumed_model)
    return full, model


@pytest.mark.parametrize("rname", [
    # a recipe reaches the checkpoint through its state and its random draws only: the
    # block formats, which have neither (as per-tensor FP8, run by default), with --slow;
    # every recipe's quantized weights save and load in the quantized-weight tests
    r if r in ("fp8_current", "fp8_delayed", "nvfp4") else pytest.param(
        r, marks=pytest.mark.slow) for r in RECIPES])
def test_trainer_checkpoints_and_resumes_bit_for_bit(rname, tmp_path):
    """Trainer with gradient checkpointing saves at step 2 (safetensors) and a new Trainer
    resumed from that checkpoint goes on with the uninterrupted run's losses and ends with
    its weights and delayed-scaling state, bit for bit; the same run without gradient
    checkpointing is the same run (checked for delayed scaling and NVFP4's stochastic
    rounding)."""
    full, model = _resumed_run_matches(_train, rname, tmp_path)
    if rname == "fp8_delayed":
        assert delayed_states(model)  # the state compared above is real
    if rname in ("fp8_delayed", "nvfp4"):  # (the checkpointing tests cover every recipe)
        plain, plain_model = _train(rname, tmp_path / "plain", checkpointing=False)
        assert plain == full
        _assert_same_model(model, plain_model)


def test_save_pretrained_round_trips(tmp_path):
    """``save_pretrained`` writes the converted model's weights under the original names
    (plus the modules' extra-state tensors); ``from_pretrained`` gives a plain model with
    those weights, and the saved state dict loaded into a converted model continues the
    delayed-scaling run exactly."""
    from safetensors.torch import load_file
    model = _converted("fp8_delayed")
    batch = torch.stack([d["input_ids"] for d in _data(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "pre")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pre")
    assert isinstance(plain.model.layers[0].mlp.up_proj, torch.nn.Linear)
    plain_sd = plain.state_dict()
    for k, v in model.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(plain_sd[k], v), k
    again = _converted("fp8_delayed")
    again.load_state_dict(load_file(tmp_path / "pre" / "model.safetensors"))
    ref = copy.deepcopy(model)
    with torch.no_grad():
        a = ref(input_ids=batch, labels=batch).loss
        b = again(input_ids=batch, labels=batch).loss
    assert torch.equal(a, b)
    _assert_same_model(ref, again)


def test_accelerate_prepare_trains_as_a_plain_loop():
    """``Accelerator.prepare(model, optimizer, dataloader)`` with a converted model whose
    recipe is attached: the same losses and weights as the plain loop."""
    from accelerate import Accelerator

    def run(use_accelerate):
        model = _converted("fp8_current")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(_data(8), batch_size=4)
        if use_accelerate:
            acc = Accelerator(cpu=True)
            model, opt, loader = acc.prepare(model, opt, loader)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            (acc.backward(loss) if use_accelerate else loss.backward())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model

    (la, ma), (lb, mb) = run(False), run(True)
    assert la == lb
    _assert_same_model(ma, mb)


# ---- weights built under quantized_model_init ---------------------------------------------------
def _quantized_llama(rname, seed=0):
    """The tiny Llama with every ``nn.Linear`` (lm_head included) replaced by a
    ``lowprec.Linear`` built under ``quantized_model_init``, its weight quantized from the
    Linear's; the recipe attached. A Linear whose weight the recipe's format cannot hold
    (k/v_proj's 64 rows in 128x128 blocks) stays ``nn.Linear``, as ``convert_model`` leaves
    it."""
    recipe = _recipe(rname)
    model = _llama(seed)
    with lowprec.quantized_model_init(recipe=recipe):
        for pname, parent in list(model.named_modules()):
            for cname, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    try:
                        new = lowprec.Linear(child.in_features, child.out_features,
                                             bias=child.bias is not None,
                                             params_dtype=child.weight.dtype,
                                             name=f"{pname}.{cname}".lstrip("."))
                    except ValueError:  # the format's blocks do not divide the weight
                        continue
                    with torch.no_grad():
                        new.weight.copy_(child.weight)  # re-quantized
                    setattr(parent, cname, new)
    lowprec.attach_recipe(model, recipe)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, QuantizedTensor)
    return model


@pytest.mark.parametrize("rname", RECIPES)
def test_quantized_weights_save_pretrained_round_trips(rname, tmp_path):
    """A Llama whose Linear weights are quantized (``quantized_model_init``), after
    ``QuantizedWeightOptimizer`` steps: ``save_pretrained`` writes safetensors holding each
    quantized weight as its dequantized values (plus the modules' ``_extra_state``);
    ``from_pretrained`` gives the unconverted model those values; the saved state dict loaded
    into a quantized model built with other weights restores every quantized byte and the
    delayed-scaling state, and the two compute the same loss."""
    from safetensors.torch import load_file
    model = _quantized_llama(rname)
    batch = torch.stack([d["input_ids"] for d in _data(4)])
    opt = QuantizedWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "pre")
    assert (tmp_path / "pre" / "model.safetensors").exists()

    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pre")
    assert type(plain.model.layers[0].mlp.up_proj) is nn.Linear
    plain_sd = plain.state_dict()
    for k, v in model.state_dict(keep_vars=True).items():
        if k.endswith("_extra_state"):
            continue
        want = v.dequantize() if isinstance(v, QuantizedTensor) else v
        assert torch.equal(plain_sd[k], want), k

    again = _quantized_llama(rname, seed=1)
    result = again.load_state_dict(load_file(tmp_path / "pre" / "model.safetensors"))
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same_model(model, again)
    with torch.no_grad():
        a = model(input_ids=batch, labels=batch).loss
        b = again(input_ids=batch, labels=batch).loss
    assert torch.equal(a, b)


def _train_quantized(rname, out, *, resume=None):
    """Trainer over the quantized-weight Llama with ``QuantizedWeightOptimizer`` (its
    scheduler on the wrapped optimizer), saving every SAVE steps."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, save_steps=SAVE,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, gradient_checkpointing=True,
        disable_tqdm=True)
    model = _quantized_llama(rname)
    opt = QuantizedWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                   optimizers=(opt, sched))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return losses, model


@pytest.mark.parametrize("rname", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_trainer_checkpoints_and_resumes_quantized_weights(rname, tmp_path):
    """Trainer saves the quantized-weight model's checkpoints (safetensors) and a Trainer
    resumed from one goes on with the uninterrupted run's losses and ends with its quantized
    weights and delayed-scaling state, bit for bit (the weights the resumed run's first
    forward reads are the saved bytes, not a re-quantization of their values)."""
    _resumed_run_matches(_train_quantized, rname, tmp_path)
