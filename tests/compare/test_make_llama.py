"""``lowprec make-llama``: a Llama config and a byte-level BPE tokenizer made locally, small
variants (vocabulary 512, hidden 64, two layers) on a few standard-library files, so each
build takes well under a second on CPU."""

from __future__ import annotations

import csv
import os
import shutil

import pytest
import torch

from lowprec.compare import cli
from lowprec.compare.data import stdlib_files
from lowprec.compare.make_llama import LlamaShape, count_parameters

transformers = pytest.importorskip("transformers")

SMALL = ["--vocab", "512", "--hidden-size", "64", "--intermediate-size", "128", "--layers", "2",
         "--heads", "2", "--max-position", "256"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first standard-library files, about 200 KB of Python."""
    root = tmp_path_factory.mktemp("corpus")
    for name in stdlib_files(max_bytes=200_000):
        shutil.copy(name, root / os.path.basename(name))
    return root


def make(out, corpus, *extra):
    return cli.main(["make-llama", "--out", str(out), "--data", str(corpus), *SMALL, *extra])


@pytest.fixture(scope="module")
def small(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("made") / "llama"
    assert make(out, corpus) == 0
    return out


def test_default_shape_is_the_readmes_110m():
    config = LlamaShape().config()
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (32000, 768, 12, 12, 12, 2048)
    assert config.tie_word_embeddings
    # embedding 32000 x 768 once (tied) + 12 x (attention 4 x 768^2 + MLP 3 x 768 x 2048
    # + two norms) + the final norm
    expected = 32000 * 768 + 12 * (4 * 768**2 + 3 * 768 * 2048 + 2 * 768) + 768
    assert count_parameters(config) == expected == 109_529_856


def test_config_and_tokenizer_load_in_transformers(small, corpus, capsys):
    assert sorted(os.listdir(small)) == ["config.json", "tokenizer.json",
                                         "tokenizer_config.json"]
    config = transformers.AutoConfig.from_pretrained(small, local_files_only=True)
    assert (config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers,
            config.num_attention_heads, config.intermediate_size,
            config.max_position_embeddings) == ("llama", 512, 64, 2, 2, 128, 256)
    assert config.tie_word_embeddings and (config.bos_token_id, config.eos_token_id) == (1, 2)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tok = transformers.AutoTokenizer.from_pretrained(small, local_files_only=True)
    assert len(tok) == 512 and tok.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    # byte-level: any text round-trips, unseen characters included, with no <unk>
    for text in ["def f(x):\n    return x  # héllo → 世界\t\r\n  ",
                 (corpus / sorted(os.listdir(corpus))[0]).read_text()]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text and 0 not in ids
    code = (corpus / sorted(os.listdir(corpus))[0]).read_text()
    assert len(tok.encode(code, add_special_tokens=False)) < 0.7 * len(code.encode())  # merges
    ids = torch.tensor([tok.encode("import os\n", add_special_tokens=False)])
    assert model(ids).logits.shape == (1, ids.shape[1], 512)


def test_prints_the_parameter_count(tmp_path, corpus, capsys):
    assert make(tmp_path / "llama", corpus) == 0
    out = capsys.readouterr().out
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama", local_files_only=True)
    n = count_parameters(config)
    assert f"{n / 1e6:.1f}M parameters" in out and "vocab 512" in out and "tied" in out
    assert f"train it: lowprec compare --model {tmp_path / 'llama'}" in out  # outside the cwd


def test_two_builds_give_identical_files(small, corpus, tmp_path):
    again = tmp_path / "again"
    assert make(again, corpus) == 0
    assert sorted(os.listdir(again)) == sorted(os.listdir(small))
    for name in os.listdir(small):
        assert (again / name).read_bytes() == (small / name).read_bytes(), name


def test_existing_directory_needs_force(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "llama"
    out.mkdir()
    assert make(out, corpus) == 0  # an empty directory is fine
    capsys.readouterr()
    (out / "model.safetensors").write_text("old weights")
    assert make(out, corpus) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err and "--force" in err
    assert make(out, corpus, "--force") == 0
    assert not (out / "model.safetensors").exists() and (out / "config.json").exists()
    capsys.readouterr()
    monkeypatch.chdir(out)
    assert make(".", corpus, "--force") == 2  # never deletes the working directory
    assert "current directory" in capsys.readouterr().err and (out / "config.json").exists()
    file = tmp_path / "file"
    file.write_text("x")
    assert make(file, corpus) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_unreachable_vocab_fails_and_keeps_the_old_directory(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "llama"
    out.mkdir()
    (out / "keep.txt").write_text("kept")
    assert make(out, text, "--force") == 2
    err = capsys.readouterr().err
    assert "--vocab 512" in err and "stopped at" in err and "more text" in err
    assert sorted(os.listdir(tmp_path)) == ["llama", "short.txt"]  # no temporary left
    assert (out / "keep.txt").read_text() == "kept"


@pytest.mark.parametrize("change, message", [
    (["--vocab", "200"], "--vocab 200 is too small"),
    (["--heads", "3"], "--hidden-size 64 must split into --heads 3"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
])
def test_bad_shapes_are_named(tmp_path, corpus, capsys, change, message):
    assert make(tmp_path / "llama", corpus, *change) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "llama").exists()


def test_compare_trains_the_directory(small, corpus, tmp_path):
    out = tmp_path / "out"
    rc = cli.main(["compare", "--model", str(small), "--data", str(corpus), "--steps", "2",
                   "--seq-len", "64", "--batch-size", "2", "--recipes", "bf16,mxfp8",
                   "--no-noise-floor", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {r["recipe"] for r in rows} == {"bf16", "mxfp8"}
    assert "tokenized by" in (out / "report.md").read_text()
