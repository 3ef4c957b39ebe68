"""``lowprec compare --model`` on the user's own model: a Hugging Face directory (config
only, or with weights and a tokenizer) and a ``file.py:build`` function, offline on CPU."""

from __future__ import annotations

import csv
import textwrap

import pytest
import torch
from torch import nn

import lowprec
from lowprec.compare import cli
from lowprec.compare.user_model import ModelError, logits_of, resolve_model

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=128)


def _llama_dir(path, weights: bool = False, tokenizer: bool = False):
    config = transformers.LlamaConfig(**HF_CONFIG)
    if weights:
        torch.manual_seed(3)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        words = ["def", "return", "class", "self", "import", "x", "y", "=", "(", ")", ":"]
        vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"
                                             ).save_pretrained(path)
    return path


def _run(tmp_path, *args):
    out = tmp_path / "out"
    rc = cli.main(["compare", "--steps", "3", "--seq-len", "64", "--batch-size", "2",
                   "--out", str(out), "--no-noise-floor", *args])
    rows = list(csv.DictReader(open(out / "results.csv"))) if (out / "results.csv").exists() else []
    return rc, rows, out


def test_hf_directory_config_only(tmp_path):
    """A config-only Llama directory trains from a random init, converted alike for every
    recipe, and the bf16 run matches the unconverted model's first loss."""
    path = _llama_dir(tmp_path / "llama")
    source = resolve_model(str(path))
    assert source.kind == "hf" and not source.pretrained and source.vocab == 256
    torch.manual_seed(0)
    a = source.build("cpu")
    torch.manual_seed(0)
    b = source.build("cpu")
    assert any(isinstance(m, lowprec.Linear) for m in a.modules())
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n  # every recipe starts from the same weights
    rc, rows, out = _run(tmp_path, "--model", str(path), "--recipes", "bf16,fp8_current")
    assert rc == 0, (out / "report.md").read_text() if (out / "report.md").exists() else rc
    assert {r["recipe"] for r in rows} >= {"bf16", "fp8_current"}


def test_hf_directory_with_weights_and_tokenizer(tmp_path):
    """Weights in the directory are the starting point; its tokenizer reads --data."""
    path = _llama_dir(tmp_path / "llama", weights=True, tokenizer=True)
    source = resolve_model(str(path))
    assert source.pretrained and source.tokenizer is not None
    saved = transformers.LlamaForCausalLM.from_pretrained(path)
    model = source.build("cpu", dtype=torch.float32)
    torch.testing.assert_close(model.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(["def x ( self ) : return y = x"] * 2000))
    rc, rows, out = _run(tmp_path, "--model", str(path), "--recipes", "bf16,mxfp8",
                         "--data", str(text))
    assert rc == 0
    assert "tokenizer" in (out / "report.md").read_text().lower() or rows


BUILD_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 128)
            self.mid = nn.Linear(128, 128)
            self.head = nn.Linear(128, 256, bias=False)

        def forward(self, ids):
            return self.head(torch.relu(self.mid(self.emb(ids))))

    def build():
        return Tiny()

    def not_a_module():
        return 3
""")


def test_build_function_model(tmp_path):
    """path/to/file.py:build: vocabulary read from the last Linear, --keep-high-precision
    leaves the named layer an nn.Linear for every recipe."""
    f = tmp_path / "my_model.py"
    f.write_text(BUILD_FILE)
    source = resolve_model(f"{f}:build", keep_high_precision=("head",))
    assert source.kind == "build" and source.vocab == 256
    model = source.build("cpu")
    assert isinstance(model.mid, lowprec.Linear) and type(model.head) is nn.Linear
    rc, rows, _ = _run(tmp_path, "--model", f"{f}:build", "--recipes", "bf16,fp8_current",
                       "--keep-high-precision", "head")
    assert rc == 0 and {r["recipe"] for r in rows} >= {"bf16", "fp8_current"}


def test_grad_accumulation_counts_tokens(tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(BUILD_FILE)
    rc, rows, out = _run(tmp_path, "--model", f"{f}:build", "--recipes", "bf16",
                         "--grad-accum", "2")
    assert rc == 0
    assert "2 micro-batches" in (out / "report.md").read_text()


@pytest.mark.parametrize("spec, match", [
    ("no_such_dir_or_preset", "not a preset"),
    ("{tmp}/empty_dir", "without config.json"),
    ("{tmp}/my_model.py:not_a_module", "not an nn.Module"),
    ("{tmp}/my_model.py:missing", "no callable"),
    ("{tmp}/nope.py:build", "no file"),
])
def test_bad_model_specs(tmp_path, spec, match):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "my_model.py").write_text(BUILD_FILE)
    with pytest.raises(ModelError, match=match):
        resolve_model(spec.format(tmp=tmp_path))


def test_vocab_mismatch_and_logits(tmp_path):
    path = _llama_dir(tmp_path / "llama")
    with pytest.raises(ModelError, match="--vocab 300"):
        resolve_model(str(path), vocab=300)
    with pytest.raises(ModelError, match="logits"):
        logits_of({"x": 1})
    assert logits_of((torch.ones(1), None)).shape == (1,)


def test_unaligned_layer_names_keep_high_precision(tmp_path, capsys):
    """A layer whose shape a recipe cannot quantize fails before training, naming the
    --keep-high-precision way out."""
    f = tmp_path / "odd.py"
    f.write_text(BUILD_FILE.replace("nn.Linear(128, 256, bias=False)",
                                    "nn.Linear(128, 200, bias=False)")
                 .replace("256, 128", "200, 128"))
    rc = cli.main(["compare", "--model", f"{f}:build", "--recipes", "bf16,fp8_block", "--steps",
                   "2", "--seq-len", "64", "--batch-size", "2", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--keep-high-precision" in capsys.readouterr().err


def test_moe_directory_shows_each_expert(tmp_path):
    """A transformers MoE directory (Qwen3-MoE, config only): the experts are converted
    (GroupedExperts) and the per-layer SQNR lists every expert's GEMMs."""
    path = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=64, vocab_size=256,
                                max_position_embeddings=128, num_experts=4,
                                num_experts_per_tok=2).save_pretrained(path)
    source = resolve_model(str(path))
    assert any(isinstance(m, lowprec.GroupedExperts) for m in source.build("cpu").modules())
    rc, rows, out = _run(tmp_path, "--model", str(path), "--recipes", "bf16,fp8_current")
    assert rc == 0 and {r["recipe"] for r in rows} >= {"bf16", "fp8_current"}
    report = (out / "report.md").read_text()
    for layer in (0, 1):
        for e in range(4):
            for gemm in ("gate_up", "down"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{gemm} |" in report
