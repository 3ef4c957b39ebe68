"""Hugging Face end to end on the CPU: a tiny ``LlamaForCausalLM`` converted with its recipe
attached (``convert_model(..., attach=True)``) trains under ``transformers.Trainer`` with
gradient checkpointing, saves checkpoints (safetensors: the state dict holds only tensors)
and resumes from them bit for bit under every recipe, delayed-scaling state included;
``save_pretrained``/``from_pretrained`` round trip; ``accelerate.Accelerator.prepare``
trains a converted model as a plain loop does."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from same_run import delayed_states

import lowprec

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.filterwarnings("ignore")

RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4"]
STEPS, SAVE = 4, 2


def _recipe(name):
    extra = {"amax_history_len": 4} if name == "fp8_delayed" else {}
    return lowprec.Recipe.from_name(name, **extra)


def _llama():
    torch.manual_seed(0)
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
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    sa, sb = delayed_states(a), delayed_states(b)
    assert sa.keys() == sb.keys()
    for key, sd in sa.items():
        for k, v in sd.items():
            assert torch.equal(v, sb[key][k]), (key, k)


@pytest.mark.parametrize("rname", RECIPES)
def test_trainer_checkpoints_and_resumes_bit_for_bit(rname, tmp_path):
    """Trainer with gradient checkpointing saves at step 2 (safetensors) and a new Trainer
    resumed from that checkpoint goes on with the uninterrupted run's losses and ends with
    its weights and delayed-scaling state, bit for bit; the same run without gradient
    checkpointing is the same run (checked for delayed scaling and NVFP4's stochastic
    rounding)."""
    full, model = _train(rname, tmp_path / "full")
    assert sorted(full) == list(range(1, STEPS + 1))
    ckpt = tmp_path / "full" / f"checkpoint-{SAVE}"
    assert (ckpt / "model.safetensors").exists()
    resumed, resumed_model = _train(rname, tmp_path / "resumed", resume=str(ckpt))
    assert {s: resumed[s] for s in range(SAVE + 1, STEPS + 1)} == {
        s: full[s] for s in range(SAVE + 1, STEPS + 1)}
    _assert_same_model(model, resumed_model)
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
