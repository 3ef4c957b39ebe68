"""``lowprec compare --data``: text, directories, token arrays, tokenizers, splits and batches.

Expected tokens come from outside the loader: the bytes written to the file, ids numbered
here, arrays saved here with numpy; each test writes its data under ``tmp_path``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lowprec.compare.data import MIN_WINDOWS, Batches, Corpus, load_corpus, load_data
from lowprec.compare.model import PRESETS

CPU = torch.device("cpu")
SHORTEST = min(p.seq_len for p in PRESETS.values())
NEED = MIN_WINDOWS * (SHORTEST + 1)  # tokens each part must hold


class WordTokenizer:
    """Whitespace words to ids from 300 up, numbered in order of first sight."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.calls: list[dict] = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append({"add_special_tokens": add_special_tokens})
        out = [1] if add_special_tokens else []  # a BOS the loader must not ask for
        return out + [self.ids.setdefault(w, 300 + len(self.ids)) for w in text.split()]


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i % 997}" for i in range(start, start + n))


def test_text_file_is_its_utf8_bytes(tmp_path):
    text = "héllo, wörld → ünïcode\n" * 400
    path = tmp_path / "notes.txt"
    path.write_text(text, encoding="utf-8")
    c = load_data(str(path), val_fraction=0.1)
    raw = text.encode("utf-8")
    assert c.train.dtype == torch.uint8 and c.kind == "bytes"
    assert bytes(torch.cat([c.train, c.val]).tolist()) == raw
    assert c.val.numel() == int(len(raw) * 0.1)
    assert c.vocab_needed == max(raw) + 1 and c.min_vocab == 256
    d = c.describe()
    assert str(path) in d and "byte tokens" in d and "1 file" in d and "held out" in d


def test_directory_is_read_recursively_in_sorted_order_and_glob_selects(tmp_path):
    parts = {"b.txt": "B" * 300, "a/z.md": "Z" * 300, "a/c/y.md": "Y" * 300,
             "a.md": "A" * 300, ".hidden/x.txt": "H" * 300, ".dot.txt": "D" * 300}
    for name, body in parts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    c = load_data(str(tmp_path), val_fraction=0.25)
    # by path components: a/c/y.md, a/z.md, a.md, b.txt; dot names left out
    assert bytes(torch.cat([c.train, c.val]).tolist()) == b"".join(
        ch * 300 for ch in (b"Y", b"Z", b"A", b"B"))
    assert c.n_files == 4 and c.n_skipped == 0
    g = load_data(str(tmp_path), glob="**/*.md", val_fraction=0.5)
    assert set(bytes(torch.cat([g.train, g.val]).tolist())) == set(b"YZA")
    assert g.n_files == 3 and "'**/*.md'" in g.describe()
    only = load_data(str(tmp_path), glob="a/**/*.md", val_fraction=0.5)
    assert bytes(torch.cat([only.train, only.val]).tolist()) == b"Y" * 300 + b"Z" * 300
    with pytest.raises(ValueError, match=r"no files match '\*\.rst'"):
        load_data(str(tmp_path), glob="*.rst")


def test_binary_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "text.txt").write_text("x = 1\n" * 200)
    (tmp_path / "blob.dat").write_bytes(bytes(range(256)) * 4)  # not UTF-8
    (tmp_path / "nul.txt").write_bytes(b"abc\0def" * 100)       # decodes, but holds NULs
    c = load_data(str(tmp_path), val_fraction=0.25)
    assert bytes(torch.cat([c.train, c.val]).tolist()) == b"x = 1\n" * 200
    assert c.n_files == 1 and c.n_skipped == 2 and "2 binary skipped" in c.describe()
    with pytest.raises(ValueError, match=r"not UTF-8 text.*PATH:uint16"):
        load_data(str(tmp_path / "blob.dat"))
    only_bin = tmp_path / "bins"
    only_bin.mkdir()
    np.arange(3000, dtype=np.uint16).tofile(only_bin / "train.bin")
    with pytest.raises(ValueError, match=r"no UTF-8 text .*: 1 file is binary.*'train.bin'"):
        load_data(str(only_bin))


def test_toy_tokenizer_gives_ids_above_255_without_special_tokens(tmp_path):
    (tmp_path / "a.txt").write_text(words(1200))
    (tmp_path / "b.txt").write_text(words(1200, start=1200))
    tok = WordTokenizer()
    c = load_data(str(tmp_path), tokenizer=tok, val_fraction=0.4)
    ids = torch.cat([c.train, c.val])
    expect = [tok.ids[w] for w in (words(1200) + " " + words(1200, start=1200)).split()]
    assert ids.tolist() == expect and ids.dtype == torch.int32
    assert all(call == {"add_special_tokens": False} for call in tok.calls) and len(tok.calls) == 2
    assert ids.min() >= 300 and c.vocab_needed == 300 + 997 and c.kind == "tokenizer"
    assert "WordTokenizer" in c.describe() and "max id 1296" in c.describe()


def test_tokenizer_with_plain_encode_and_the_stdlib_source(tmp_path):
    class Plain:  # encode(str) only, ids through an object with .ids like tokenizers'
        class Enc:
            def __init__(self, ids):
                self.ids = ids

        def encode(self, text):
            return self.Enc([1000 + b for b in text.encode()])

    c = load_data(None, tokenizer=Plain(), max_tokens=20_000)
    plain = load_corpus()
    assert c.n_tokens == 20_000 and c.truncated and "cut at max_tokens" in c.describe()
    assert torch.equal(torch.cat([c.train, c.val]) - 1000, plain.train[:20_000].int())


def test_npy_uint32_ids_are_read_back_exactly(tmp_path):
    ids = (np.arange(6000, dtype=np.uint32) * 7919) % 100_000 + 256
    np.save(tmp_path / "ids.npy", ids)
    c = load_data(str(tmp_path / "ids.npy"), val_fraction=0.1)
    assert c.train.dtype == torch.int32 and c.kind == "array"
    assert torch.cat([c.train, c.val]).tolist() == ids.tolist()
    assert c.vocab_needed == int(ids.max()) + 1
    assert "uint32" in c.describe() and "ids.npy" in c.describe()
    np.save(tmp_path / "f.npy", ids.astype(np.float32))
    with pytest.raises(ValueError, match="float32 values; token ids must be integers"):
        load_data(str(tmp_path / "f.npy"))
    with pytest.raises(ValueError, match="carries its own dtype"):
        load_data(str(tmp_path / "ids.npy") + ":uint32")


def test_bin_is_uint16_by_default_and_uint32_on_request(tmp_path):
    ids = (np.arange(6000) * 31 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")  # as nanoGPT's prepare.py writes it
    c = load_data(str(tmp_path / "train.bin"))
    assert torch.cat([c.train, c.val]).tolist() == ids.tolist() and "uint16" in c.describe()
    big = np.arange(70_000, 76_000, dtype=np.uint32)
    big.tofile(tmp_path / "big.bin")
    c32 = load_data(str(tmp_path / "big.bin") + ":uint32")
    assert torch.cat([c32.train, c32.val]).tolist() == big.tolist()
    assert c32.vocab_needed == 76_000
    (tmp_path / "odd.bin").write_bytes(b"\1" * 5001)
    with pytest.raises(ValueError, match="5001 bytes, not a whole number of uint16 ids"):
        load_data(str(tmp_path / "odd.bin"))
    cut = load_data(str(tmp_path / "train.bin"), max_tokens=3000, val_fraction=0.5)
    assert torch.cat([cut.train, cut.val]).tolist() == ids[:3000].tolist() and cut.truncated


def test_vocab_too_small_names_the_numbers(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(6000, dtype=np.int64) + 1000)
    with pytest.raises(ValueError) as err:
        load_data(str(tmp_path / "ids.npy"), vocab=4096)
    msg = str(err.value)
    assert "6999" in msg and "4096" in msg and "--vocab 7000" in msg
    load_data(str(tmp_path / "ids.npy"), vocab=7000)  # exactly enough

    (tmp_path / "t.txt").write_text(words(6000))
    with pytest.raises(ValueError, match=r"token id 1296 .* vocabulary of 512 .*--vocab 1297"
                                         r".*tokenizer the model was built with"):
        load_data(str(tmp_path / "t.txt"), tokenizer=WordTokenizer(), vocab=512)

    (tmp_path / "ascii.txt").write_text("abc\n" * 2000)
    with pytest.raises(ValueError, match=r"at least 256 \(this data's largest id is 99\).*is 128"):
        load_data(str(tmp_path / "ascii.txt"), vocab=128)
    with pytest.raises(ValueError, match=r"at least 256 .* is 255"):
        load_data(None, vocab=255, max_tokens=1 << 17)


def test_too_little_data_raises_with_the_numbers(tmp_path):
    (tmp_path / "small.txt").write_text("a" * 1000)
    with pytest.raises(ValueError) as err:
        load_data(str(tmp_path / "small.txt"))
    msg = str(err.value)
    assert re.search(r"1000 tokens, of which the last 50 .* held out and 950 left", msg)
    assert f"at least {NEED} tokens" in msg and "larger val_fraction" in msg
    assert load_data(str(tmp_path / "small.txt"), val_fraction=0.5).val.numel() == 500
    with pytest.raises(ValueError, match=r"held out and 100 left to train on") as err:
        load_data(str(tmp_path / "small.txt"), val_fraction=0.9)
    assert "larger val_fraction" not in str(err.value)  # the training part is short
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(ValueError, match=r"too little data .*: 0 tokens"):
        load_data(str(tmp_path / "empty"))


def test_train_and_val_do_not_overlap(tmp_path):
    n = 8000
    np.save(tmp_path / "pos.npy", np.arange(n, dtype=np.int32))  # each id is its position
    c = load_data(str(tmp_path / "pos.npy"), val_fraction=0.1)
    n_val = int(n * 0.1)
    assert c.train.tolist() == list(range(n - n_val))
    assert c.val.tolist() == list(range(n - n_val, n))
    b = Batches(c, 64, 8, seed=3, device=CPU)
    for _ in range(20):
        x, y = b.train_batch()
        assert int(torch.maximum(x, y).max()) < n - n_val
    for x, y in b.val_batches(3):
        assert int(torch.minimum(x, y).min()) >= n - n_val


def test_batches_over_token_ids_are_windows_and_deterministic(tmp_path):
    ids = np.arange(10_000, dtype=np.uint32) + 40_000  # > 255 and > int16
    np.save(tmp_path / "ids.npy", ids)
    c = load_data(str(tmp_path / "ids.npy"), val_fraction=0.2)
    seq, batch = 64, 4
    b1, b2 = Batches(c, seq, batch, seed=5, device=CPU), Batches(c, seq, batch, seed=5, device=CPU)
    x1, y1 = b1.train_batch()
    x2, y2 = b2.train_batch()
    assert x1.dtype == torch.long and x1.shape == (batch, seq)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1, x1 + 1)  # consecutive ids: the target is the next token
    assert torch.equal(x1, x1[:, :1] + torch.arange(seq))
    other = Batches(c, seq, batch, seed=6, device=CPU).train_batch()[0]
    assert not torch.equal(other, x1)
    starts = [int(x[i, 0]) - 48_000 for x, _ in b1.val_batches(2) for i in range(batch)]
    assert starts == torch.linspace(0, 2000 - seq - 1, 2 * batch).long().tolist()


def test_batches_check_the_model_window(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(6000, dtype=np.int32))
    c = load_data(str(tmp_path / "ids.npy"))  # 300 held out
    with pytest.raises(ValueError, match=r"held-out part has 300 tokens; each needs at least "
                                         r"516 \(4 windows of seq_len \+ 1 = 129\)"):
        Batches(c, 128, 4, seed=0, device=CPU)
    Batches(c, 64, 4, seed=0, device=CPU).val_batches(1)


def test_bad_arguments_are_clear(tmp_path):
    (tmp_path / "t.txt").write_text("a" * 10_000)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_data(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="val_fraction must be between 0 and 1"):
        load_data(str(tmp_path / "t.txt"), val_fraction=1.0)
    with pytest.raises(ValueError, match="selects files of a directory"):
        load_data(str(tmp_path / "t.txt"), glob="*.txt")
    with pytest.raises(ValueError, match="give the directory too"):
        load_data(None, glob="*.txt")
    with pytest.raises(TypeError, match="no encode"):
        load_data(str(tmp_path / "t.txt"), tokenizer=object())


def test_old_corpus_still_constructs_positionally():
    c = Corpus(torch.arange(600, dtype=torch.uint8).repeat(2), torch.zeros(300, dtype=torch.uint8),
               1, "here")
    assert c.kind == "stdlib" and c.vocab_needed == 256 and c.n_bytes == 1500


def test_a_transformers_tokenizer_built_offline(tmp_path, capfd):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    vocab = {"[UNK]": 0, "[BOS]": 1, **{f"w{i}": 300 + i for i in range(997)}}
    core = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    # A BOS on every encode, as many model tokenizers add: the loader must turn it off.
    core.post_processor = TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]",
                                               bos_token="[BOS]", model_max_length=64)
    assert tok.encode("w1 w2")[0] == 1  # the BOS is there by default
    text = words(3000)
    (tmp_path / "t.txt").write_text(text)
    c = load_data(str(tmp_path / "t.txt"), tokenizer=tok, vocab=len(vocab) + 300,
                  val_fraction=0.2)
    ids = torch.cat([c.train, c.val]).tolist()
    assert ids == [300 + int(w[1:]) for w in text.split()]
    assert type(tok).__name__ in c.describe()  # TokenizersBackend in transformers 5
    # 3000 tokens > model_max_length: no "sequence length is longer" warning per file
    assert "longer than the specified maximum" not in capfd.readouterr().err
    # The raw tokenizers.Tokenizer works too (its encode returns an Encoding).
    raw = load_data(str(tmp_path / "t.txt"), tokenizer=core, val_fraction=0.2)
    assert torch.equal(raw.train, c.train) and torch.equal(raw.val, c.val)
