"""``lowprec make-llama`` (or ``python -m lowprec make-llama``): a Hugging Face Llama
directory for ``lowprec compare --model``.

It writes, with no hub access, a ``config.json`` (random init: no weights) and a byte-level
BPE tokenizer trained here on the text ``lowprec compare`` trains on by default (the
Python standard library's source, the same files in the same order; ``--data`` for other
text). The defaults make the README's ``./llama-110m``: hidden 768, 12 layers, 12 heads,
intermediate 2048, vocabulary 32000, embeddings tied to the output head, 109.5M
parameters (the shape of llama2.c's ``stories110M``).

The same text and options give the same files byte for byte: the files are read in
sorted order, and the BPE trainer's choices do not depend on hash order or threads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from .data import read_text, stdlib_dir, text_files

DEFAULT_OUT = "llama-110m"
DESCRIPTION = ("Write a Hugging Face Llama config (random init) and a byte-level BPE tokenizer "
               "trained locally on the text lowprec compare trains on, for lowprec compare "
               "--model DIR. The defaults make the README's 110M-parameter ./llama-110m.")
#: special tokens, at the ids LlamaConfig expects (bos 1, eos 2)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
#: the smallest vocabulary: the special tokens and the 256 byte symbols
MIN_VOCAB = len(SPECIAL_TOKENS) + 256


class MakeError(ValueError):
    """An option or output directory ``make-llama`` cannot use, saying what it accepts."""


@dataclass
class LlamaShape:
    vocab: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    layers: int = 12
    heads: int = 12
    max_position: int = 2048

    def check(self) -> None:
        for name in ("hidden_size", "intermediate_size", "layers", "heads", "max_position"):
            if getattr(self, name) < 1:
                raise MakeError(f"--{name.replace('_', '-')} must be >= 1, got "
                                f"{getattr(self, name)}")
        if self.vocab < MIN_VOCAB:
            raise MakeError(f"--vocab {self.vocab} is too small: a byte-level BPE vocabulary "
                            f"holds the 256 bytes and {len(SPECIAL_TOKENS)} special tokens, so "
                            f"it needs at least {MIN_VOCAB}")
        if self.hidden_size % self.heads or (self.hidden_size // self.heads) % 2:
            raise MakeError(f"--hidden-size {self.hidden_size} must split into --heads "
                            f"{self.heads} heads of an even size (rotary embeddings)")

    def config(self):
        from transformers import LlamaConfig
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads,
            max_position_embeddings=self.max_position, tie_word_embeddings=True,
            bos_token_id=SPECIAL_TOKENS.index("<s>"), eos_token_id=SPECIAL_TOKENS.index("</s>"))


@dataclass
class Made:
    """What :func:`make_llama` wrote."""

    out: str
    config: object
    n_params: int
    n_files: int
    n_bytes: int
    source: str
    seconds: float

    def describe(self) -> str:
        c = self.config
        return (f"{self.out}: LlamaForCausalLM of {self.n_params / 1e6:.1f}M parameters "
                f"(hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
                f"{c.num_attention_heads} heads, intermediate {c.intermediate_size}, vocab "
                f"{c.vocab_size}, tied embeddings, max positions {c.max_position_embeddings}; "
                f"random init, no weights), byte-level BPE tokenizer trained on "
                f"{self.n_bytes / 2**20:.1f} MiB of text from {self.source} ({self.n_files} "
                f"file{'s' if self.n_files != 1 else ''}) in {self.seconds:.1f} s")


def count_parameters(config) -> int:
    """The parameters of ``LlamaForCausalLM(config)``, a tied embedding counted once (the
    model is built on the meta device: nothing is allocated)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def train_tokenizer(texts, vocab: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab`` tokens trained on
    ``texts`` (an iterable of str); ``MakeError`` when the text holds too few distinct
    merges to reach it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size()
    if got < vocab:
        raise MakeError(f"--vocab {vocab}: the text has too few distinct merges for that; BPE "
                        f"stopped at {got} tokens. Use --vocab {got} or less, or more text "
                        f"(--data)")
    return tok


def save_tokenizer(tok, out: str, max_position: int) -> None:
    """``tok`` as transformers files (``tokenizer.json``, ``tokenizer_config.json``, ...)
    that ``AutoTokenizer.from_pretrained(out)`` loads."""
    from transformers import PreTrainedTokenizerFast
    unk, bos, eos = SPECIAL_TOKENS
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=unk, bos_token=bos, eos_token=eos,
        model_max_length=max_position, clean_up_tokenization_spaces=False,
    ).save_pretrained(out)


def _check_out(out: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise MakeError(f"--out {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise MakeError(f"--out {out!r} exists and is not empty; name a new or empty "
                            f"directory, or pass --force to replace it (its contents are "
                            f"deleted)")
        here = os.path.realpath(os.getcwd())
        if os.path.commonpath([here, os.path.realpath(out)]) == os.path.realpath(out):
            raise MakeError(f"--out {out!r} is the current directory or holds it; --force "
                            f"will not delete that")


def make_llama(out: str = DEFAULT_OUT, *, shape: LlamaShape | None = None,
               data: str | None = None, glob: str | None = None,
               force: bool = False) -> Made:
    """Write the config and tokenizer into ``out`` (see the module doc). The directory
    appears complete or not at all: everything is written to a temporary sibling first.
    ``MakeError`` (a ``ValueError``) for options or text it cannot use."""
    shape = shape or LlamaShape()
    shape.check()
    out = os.path.abspath(out)
    _check_out(out, force)
    start = time.perf_counter()
    texts, n_bytes = [], 0
    for name in text_files(data, glob):
        found = read_text(name)
        if found is not None:
            texts.append(found[1])
            n_bytes += len(found[0])
    if not n_bytes:
        raise MakeError(f"--data {data!r}: no UTF-8 text to train the tokenizer on")
    tok = train_tokenizer(texts, shape.vocab)
    config = shape.config()
    n_params = count_parameters(config)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.")
    try:
        config.save_pretrained(tmp)
        save_tokenizer(tok, tmp, shape.max_position)
        if os.path.isdir(out):
            shutil.rmtree(out) if force else os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source = f"the standard library at {stdlib_dir()}" if data is None else data
    return Made(out, config, n_params, len(texts), n_bytes, source,
                time.perf_counter() - start)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LlamaShape()
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"the directory to write (default: ./{DEFAULT_OUT}); it must be new or "
                        f"empty unless --force")
    p.add_argument("--force", action="store_true",
                   help="replace an existing non-empty --out (its contents are deleted)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text to train the tokenizer on: a text file or a directory of them "
                        "(recursively, sorted; binary files skipped), as lowprec compare "
                        "reads --data (default: the Python standard-library source lowprec "
                        "compare trains on)")
    p.add_argument("--data-glob", default=None, metavar="GLOB",
                   help="with a --data directory: the files to read (e.g. '**/*.md')")
    p.add_argument("--vocab", type=int, default=d.vocab,
                   help=f"vocabulary size, special tokens and bytes included (default "
                        f"{d.vocab}, at least {MIN_VOCAB})")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size,
                   help=f"default {d.hidden_size}")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                   help=f"the MLP's width (default {d.intermediate_size})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"default {d.layers}")
    p.add_argument("--heads", type=int, default=d.heads,
                   help=f"attention heads, as many key/value heads (default {d.heads})")
    p.add_argument("--max-position", type=int, default=d.max_position,
                   help=f"max_position_embeddings (default {d.max_position})")


def run(args, stdout=None, stderr=None) -> int:
    """``lowprec make-llama`` with parsed ``args``: 0, or 2 after printing an error."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    shape = LlamaShape(vocab=args.vocab, hidden_size=args.hidden_size,
                       intermediate_size=args.intermediate_size, layers=args.layers,
                       heads=args.heads, max_position=args.max_position)
    try:
        made = make_llama(args.out, shape=shape, data=args.data, glob=args.data_glob,
                          force=args.force)
    except (ValueError, OSError) as err:
        print(f"lowprec make-llama: error: {err}", file=stderr)
        return 2
    print(made.describe(), file=stdout)
    shown = os.path.relpath(made.out)
    if shown.startswith(os.pardir):
        shown = made.out
    print(f"train it: lowprec compare --model {shown}", file=stdout)
    return 0
