"""The training data of ``lowprec compare``: a token stream, a held-out tail, seeded batches.

By default the text is something every machine has offline: the Python standard
library's own source (the top-level ``*.py`` files of the running interpreter's
standard library in sorted order, up to ``max_bytes``) as byte tokens (vocabulary
256). :func:`load_data` also reads the user's own data (``--data``):

* a UTF-8 text file, or a directory of them read recursively in sorted order, as
  byte tokens or through a tokenizer;
* token ids already made: a ``.npy`` array, or a raw ``.bin`` file (uint16 by
  default, as nanoGPT's ``prepare.py`` writes them; ``PATH:uint32`` for others).

The last ``val_fraction`` of the stream is held out for the final evaluation and
never trained on. Batches are drawn from a generator seeded by the run's seed, so
every recipe sees the same batches in the same order.
"""

from __future__ import annotations

import inspect
import math
import os
import pathlib
import sys
import sysconfig
from dataclasses import dataclass
from functools import cached_property

import torch

from .model import PRESETS

DEFAULT_MAX_BYTES = 4 << 20
BYTE_VOCAB = 256
#: Each of the training and held-out parts must hold this many whole windows.
MIN_WINDOWS = 4
#: dtypes a raw token file may be read as (``PATH:DTYPE``); ``.bin`` alone means uint16.
RAW_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32,
              "int32": torch.int32, "int64": torch.int64}
DEFAULT_BIN_DTYPE = "uint16"
_BOM = b"\xef\xbb\xbf"


def stdlib_dir() -> str:
    """The running interpreter's standard-library directory (the default corpus)."""
    return sysconfig.get_paths()["stdlib"]


@dataclass
class Corpus:
    """A token stream split into ``train`` and a held-out ``val`` tail.

    Byte tokens are uint8 tensors; token ids from a tokenizer or an array are int32,
    so ids above 255 fit. ``kind`` says where the tokens came from: ``"stdlib"`` (the
    default corpus, byte tokens), ``"bytes"`` (the user's text as UTF-8 bytes),
    ``"tokenizer"`` (the user's text through ``tokenizer_name``) or ``"array"``
    (token ids read from a ``.npy``/raw file of ``array_dtype``).
    """

    train: torch.Tensor
    val: torch.Tensor
    n_files: int
    source: str
    kind: str = "stdlib"
    n_skipped: int = 0
    glob: str | None = None
    tokenizer_name: str | None = None
    array_dtype: str | None = None
    truncated: bool = False

    @property
    def n_tokens(self) -> int:
        return self.train.numel() + self.val.numel()

    @property
    def n_bytes(self) -> int:
        # Older name, from when every token was a byte; kept for existing callers.
        return self.n_tokens

    @cached_property
    def vocab_needed(self) -> int:
        """The smallest vocabulary that covers every token: the largest id + 1."""
        top = max(int(t.max()) for t in (self.train, self.val) if t.numel())
        return top + 1

    @property
    def min_vocab(self) -> int:
        """The vocabulary a model needs for this data: byte tokens need all 256 ids."""
        if self.kind in ("stdlib", "bytes"):
            return max(BYTE_VOCAB, self.vocab_needed)
        return self.vocab_needed

    def describe(self) -> str:
        """One line for the terminal and report.md: what the data is and how much."""
        if self.kind == "stdlib":
            return (f"{self.n_tokens / 2**20:.1f} MiB of Python {sys.version_info.major}."
                    f"{sys.version_info.minor} standard-library source ({self.n_files} files "
                    f"from {self.source}), byte tokens; last {self.val.numel() / 2**10:.0f} "
                    f"KiB held out")
        if self.kind == "array":
            what = (f"{_count(self.n_tokens)} token ids from {self.source} "
                    f"({self.array_dtype}, max id {self.vocab_needed - 1}"
                    f"{', cut at max_tokens' if self.truncated else ''})")
        else:
            files = f"{self.n_files} file{'s' if self.n_files != 1 else ''}"
            if self.glob:
                files += f" matching {self.glob!r}"
            if self.n_skipped:
                files += f", {self.n_skipped} binary skipped"
            if self.truncated:
                files += ", cut at max_tokens"
            if self.kind == "bytes":
                what = (f"{_count(self.n_tokens)} bytes of UTF-8 text from {self.source} "
                        f"({files}), byte tokens")
            else:
                what = (f"{_count(self.n_tokens)} tokens of text from {self.source} ({files}), "
                        f"tokenized by {self.tokenizer_name} (max id {self.vocab_needed - 1})")
        return f"{what}; last {_count(self.val.numel())} held out"

    def check_windows(self, seq_len: int) -> None:
        """Raise ``ValueError`` unless both parts hold ``MIN_WINDOWS`` windows of ``seq_len + 1``.

        Call it with the model's ``seq_len`` before training, so that too little data is
        a clear error rather than a failure inside the first batch.
        """
        need = MIN_WINDOWS * (seq_len + 1)
        short = [f"{name} has {t.numel()}" for name, t in (("training part", self.train),
                                                            ("held-out part", self.val))
                 if t.numel() < need]
        if short:
            raise ValueError(
                f"too little data in {self.source} for windows of {seq_len} tokens: "
                f"{' and '.join(short)} tokens; each needs at least {need} "
                f"({MIN_WINDOWS} windows of seq_len + 1 = {seq_len + 1}). Use more data or a "
                f"model with a shorter sequence")


def _count(n: int) -> str:
    for div, unit in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05,
                directory: str | None = None) -> Corpus:
    """The standard-library source as byte tokens (uint8), the last ``val_fraction`` held out.

    At least 16 KiB is held out whatever ``val_fraction``, so the final evaluation is
    stable on small corpora.
    """
    directory = directory or stdlib_dir()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    except OSError as err:
        raise RuntimeError(f"cannot list the standard library at {directory!r}: {err}") from None
    chunks, total, used = [], 0, 0
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
        used += 1
        if total >= max_bytes:
            break
    blob = b"".join(chunks)
    if len(blob) < 1 << 16:
        raise RuntimeError(f"found only {len(blob)} bytes of Python source under {directory!r}; "
                           f"need at least 64 KiB of text to train on")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_val = max(int(len(blob) * val_fraction), 1 << 14)
    return Corpus(train=tokens[:-n_val].clone(), val=tokens[-n_val:].clone(), n_files=used,
                  source=directory)


def load_data(path: str | None, *, tokenizer=None, vocab: int | None = None,
              glob: str | None = None, val_fraction: float = 0.05,
              max_tokens: int | None = None) -> Corpus:
    """Load the training data named by ``--data`` (``path``) as a :class:`Corpus`.

    ``path`` is one of:

    * ``None``: the standard-library corpus (:func:`load_corpus`), byte tokens; with a
      ``tokenizer``, the same source files tokenized by it instead.
    * a text file, or a directory read recursively in sorted path order. Without
      ``glob`` every file that is UTF-8 text is used (names starting with ``.`` are
      left out, so a ``.git`` directory is not read) and every other file is skipped
      and counted as binary (one that does not decode as UTF-8, or holds a NUL byte);
      with ``glob`` (relative to the directory, e.g. ``"**/*.md"``) only the matching
      files are read, binary ones still skipped. Files are tokenized one at a time and
      joined end to end with nothing between them; a leading byte-order mark is dropped.
      Without a ``tokenizer`` the tokens are the UTF-8 bytes (vocabulary 256). A
      ``tokenizer`` is any object with ``encode(str)``, returning a list of ints or an
      object with ``.ids`` (a ``tokenizers.Tokenizer``); it is called with
      ``add_special_tokens=False`` where its ``encode`` takes that argument (transformers
      and tokenizers do), so no BOS/EOS is inserted per file, and with
      ``disallowed_special=()`` where it takes that (tiktoken), so text that looks like a
      special token is encoded as text rather than refused.
    * a ``.npy`` file of integer token ids (any integer dtype; a multi-dimensional array
      is read flat in C order), or a raw ``.bin`` file of little-endian uint16 ids (what
      nanoGPT's ``prepare.py`` writes). Append ``:DTYPE`` to read any file as raw ids of
      another dtype, e.g. ``train.bin:uint32`` (one of ``uint8, uint16, uint32, int32,
      int64``). The ids are used as they are; ``tokenizer`` is not used.

    ``vocab``: the model's vocabulary size; a ``ValueError`` is raised when a token id
    does not fit (byte tokens need 256). ``max_tokens`` keeps only the first that many
    tokens (files past it are not read). The last ``val_fraction`` of the tokens is
    held out. Too little data for both parts to hold a few windows of the shortest
    model preset's sequence is a ``ValueError`` with the numbers; check the chosen
    model's with :meth:`Corpus.check_windows`. ``FileNotFoundError`` when ``path`` does
    not exist.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if vocab is not None and vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if path is None:
        _check_glob(None, glob)
        if tokenizer is None:
            corpus = load_corpus(max_bytes=max_tokens or DEFAULT_MAX_BYTES,
                                 val_fraction=val_fraction)
        else:
            corpus = _load_stdlib_tokenized(tokenizer, val_fraction, max_tokens)
    else:
        corpus = _load_path(os.fspath(path), tokenizer, glob, val_fraction, max_tokens)
    if vocab is not None:
        _check_vocab(corpus, vocab)
    return corpus


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r}: no such file or directory")


def _check_glob(path: str | None, glob: str | None) -> None:
    """``--data-glob`` selects files of a data directory: refused with no ``--data``
    (``path`` None) or with an existing ``path`` that is a file."""
    if glob is None:
        return
    if path is None:
        raise ValueError(f"the glob {glob!r} (--data-glob) selects files of a data "
                         f"directory; give the directory too")
    if not os.path.isdir(path):
        raise ValueError(f"the glob {glob!r} (--data-glob) selects files of a directory, "
                         f"but {path!r} is a file")


def _load_path(path, tokenizer, glob, val_fraction, max_tokens) -> Corpus:
    path, raw_dtype = _split_dtype_suffix(path)
    _check_exists(path)
    if os.path.isdir(path):
        if raw_dtype:
            raise ValueError(f"{path!r} is a directory; ':{raw_dtype}' applies to a raw "
                             f"token file")
        files = text_files(path, glob)
        tokens, used, skipped, cut = _read_text_files(files, tokenizer, max_tokens)
        if not used:
            raise ValueError(_no_text_message(path, files, skipped, glob))
        return _split(tokens, val_fraction, path, n_files=used, n_skipped=skipped, glob=glob,
                      kind="bytes" if tokenizer is None else "tokenizer",
                      tokenizer_name=_tokenizer_name(tokenizer), truncated=cut)
    _check_glob(path, glob)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        if raw_dtype:
            raise ValueError(f"{path!r}: a .npy file carries its own dtype; drop ':{raw_dtype}'")
        tokens, dtype, cut = _read_npy(path, max_tokens)
    elif ext == ".bin" or raw_dtype:
        tokens, dtype, cut = _read_raw(path, raw_dtype or DEFAULT_BIN_DTYPE, max_tokens)
    else:
        tokens, used, skipped, cut = _read_text_files([path], tokenizer, max_tokens)
        if not used:
            raise ValueError(f"{path!r} is not UTF-8 text (it does not decode, or holds NUL "
                             f"bytes); token ids go in a .npy file, or a raw file read as "
                             f"PATH:uint16 / PATH:uint32")
        return _split(tokens, val_fraction, path, n_files=1,
                      kind="bytes" if tokenizer is None else "tokenizer",
                      tokenizer_name=_tokenizer_name(tokenizer), truncated=cut)
    return _split(tokens, val_fraction, path, n_files=1, kind="array", array_dtype=dtype,
                  truncated=cut)


def _split_dtype_suffix(path: str) -> tuple[str, str | None]:
    # Only a known dtype name counts as a suffix, and only when the whole string is not
    # itself an existing file, so paths with colons (C:\..., a:b.txt) read as themselves.
    base, sep, tail = path.rpartition(":")
    if sep and tail.lower() in RAW_DTYPES and base and not os.path.exists(path):
        return base, tail.lower()
    return path, None


def _list_files(directory: str, glob: str | None) -> list[str]:
    root = pathlib.Path(directory)
    if glob is None:
        found = []
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            found.extend(pathlib.Path(dirpath, f) for f in filenames if not f.startswith("."))
    else:
        try:
            found = [p for p in root.glob(glob) if p.is_file()]
        except (ValueError, NotImplementedError) as err:
            raise ValueError(f"bad glob {glob!r}: {err}") from None
    # Sorting by path components keeps each directory's files together.
    return [str(p) for p in sorted(found, key=lambda p: p.relative_to(root).parts)]


def _no_text_message(path, files, skipped, glob) -> str:
    msg = (f"no UTF-8 text in {path!r}: {'all ' if skipped > 1 else ''}{skipped} "
           f"{'matching ' if glob else ''}file{'s are' if skipped > 1 else ' is'} binary")
    arrays = [f for f in files if f.lower().endswith((".npy", ".bin"))]
    if arrays:
        msg += (f"; for token ids name one file (--data), e.g. "
                f"{os.path.relpath(arrays[0], path)!r} inside it")
    return msg


def read_text(name: str) -> tuple[bytes, str] | None:
    """A file's UTF-8 text as ``(bytes, str)``, a leading byte-order mark dropped; ``None``
    for a binary file (one holding a NUL byte, or not UTF-8). ``ValueError`` when it
    cannot be read."""
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"cannot read {name!r}: {err.strerror or err}") from None
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # A byte-order mark is an encoding marker, not text the model should learn.
    if data.startswith(_BOM):
        data, text = data[len(_BOM):], text[1:]
    return data, text


def _read_text_files(files, tokenizer, max_tokens):
    """(tokens, files used, files skipped as binary, cut at max_tokens) for these files."""
    encode = None if tokenizer is None else _encoder(tokenizer)
    parts, total, used, skipped, cut = [], 0, 0, 0, False
    for name in files:
        if max_tokens is not None and total >= max_tokens:
            cut = True
            break
        found = read_text(name)
        if found is None:
            skipped += 1
            continue
        data, text = found
        used += 1
        if not data:
            continue
        if encode is None:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            t = _ids_tensor(encode(text), name)
        if max_tokens is not None and total + t.numel() > max_tokens:
            t, cut = t[:max_tokens - total], True
        parts.append(t)
        total += t.numel()
    empty = torch.empty(0, dtype=torch.uint8 if tokenizer is None else torch.int32)
    return (torch.cat(parts) if parts else empty), used, skipped, cut


def _encoder(tokenizer):
    """``text -> ids`` through ``tokenizer.encode``, with no special tokens added."""
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"the tokenizer ({type(tokenizer).__name__}) has no encode(str) method")
    kwargs = {}
    try:
        params = inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        params = {}
    if "add_special_tokens" in params:
        kwargs["add_special_tokens"] = False
    if "disallowed_special" in params:
        kwargs["disallowed_special"] = ()
    if any(c.__module__.startswith("transformers.") for c in type(tokenizer).__mro__):
        # A file is longer than the model's context; the stream is cut into windows
        # later, so transformers' "sequence length is longer than..." warning is noise.
        kwargs["verbose"] = False

    def encode(text: str):
        out = tokenizer.encode(text, **kwargs)
        return getattr(out, "ids", out)
    return encode


def _tokenizer_name(tokenizer) -> str | None:
    if tokenizer is None:
        return None
    name = type(tokenizer).__name__
    origin = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", None)
    return f"{name} {origin!r}" if isinstance(origin, str) and origin else name


def _ids_tensor(ids, name) -> torch.Tensor:
    try:
        t = torch.as_tensor(ids, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"the tokenizer's encode() of {name!r} did not return a list of int "
                         f"ids: {err}") from None
    if t.dim() != 1:
        raise ValueError(f"the tokenizer's encode() of {name!r} returned shape "
                         f"{tuple(t.shape)}, expected a flat list of ids")
    return _checked_int32(t, f"the tokenizer's ids for {name!r}")


def _checked_int32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise ValueError(f"{what} include a negative id ({lo}); token ids are >= 0")
        if hi >= 2**31:
            raise ValueError(f"{what} include id {hi}, beyond any vocabulary (>= 2**31); is "
                             f"the dtype right?")
    return t.to(torch.int32)


def _read_npy(path, max_tokens):
    try:
        import numpy as np
    except ImportError:
        raise ValueError(f"reading {path!r} needs numpy: pip install numpy") from None
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(f"cannot read {path!r} as a .npy array: {err}") from None
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{path!r} holds {arr.dtype} values; token ids must be integers")
    flat = arr.reshape(-1)
    cut = max_tokens is not None and flat.size > max_tokens
    if cut:
        flat = flat[:max_tokens]
    dtype = str(arr.dtype)
    if arr.dtype == np.uint8:
        return torch.from_numpy(np.array(flat)), dtype, cut
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= 2**31):
        raise ValueError(f"{path!r} holds ids from {int(flat.min())} to {int(flat.max())}; "
                         f"token ids must be between 0 and 2**31 - 1")
    return torch.from_numpy(np.asarray(flat, dtype=np.int32).copy()), dtype, cut


def _read_raw(path, dtype_name, max_tokens):
    dtype = RAW_DTYPES[dtype_name]
    item = dtype.itemsize
    size = os.path.getsize(path)
    if size % item:
        raise ValueError(f"{path!r} is {size} bytes, not a whole number of {dtype_name} ids "
                         f"({item} bytes each); is the dtype right? Pick another as PATH:DTYPE")
    n = size // item
    cut = max_tokens is not None and n > max_tokens
    with open(path, "rb") as f:
        data = bytearray(f.read(min(n, max_tokens or n) * item))
    if sys.byteorder != "little":  # pragma: no cover - the files are little-endian
        raise ValueError(f"raw token files are read as little-endian; this machine is "
                         f"{sys.byteorder}-endian: convert {path!r} to .npy")
    t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    if dtype == torch.uint8:
        return t, dtype_name, cut
    # uint32 has few ops (no max); int64 holds every uint32 value exactly for the check.
    return _checked_int32(t.to(torch.int64), f"the ids in {path!r}"), dtype_name, cut


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The files of the default corpus as a tokenizer reads them: the standard library's
    top-level ``*.py`` files in sorted order, whole, until ``max_bytes`` are reached (the
    same source text as the byte corpus)."""
    directory = stdlib_dir()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    except OSError as err:
        raise RuntimeError(f"cannot list the standard library at {directory!r}: {err}") from None
    files, total = [], 0
    for n in names:
        p = os.path.join(directory, n)
        try:
            total += os.path.getsize(p)
        except OSError:
            continue
        files.append(p)
        if total >= max_bytes:
            break
    return files


def text_files(path: str | None = None, glob: str | None = None) -> list[str]:
    """The files whose text ``--data path`` (with ``--data-glob glob``) names, in the order
    they are read: the standard library's (:func:`stdlib_files`) for ``None``, a file
    itself, or a directory's files (see :func:`load_data`). Binary files among them are
    left for :func:`read_text` to tell."""
    if path is None:
        _check_glob(None, glob)
        return stdlib_files()
    path = os.fspath(path)
    _check_exists(path)
    if not os.path.isdir(path):
        _check_glob(path, glob)
        return [path]
    files = _list_files(path, glob)
    if not files:
        raise ValueError(f"no files match {glob!r} under {path!r}" if glob else
                         f"no files under {path!r}")
    return files


def _load_stdlib_tokenized(tokenizer, val_fraction, max_tokens) -> Corpus:
    files = stdlib_files()
    tokens, used, skipped, cut = _read_text_files(files, tokenizer, max_tokens)
    return _split(tokens, val_fraction, stdlib_dir(), n_files=used, n_skipped=skipped,
                  kind="tokenizer", tokenizer_name=_tokenizer_name(tokenizer), truncated=cut)


def _split(tokens: torch.Tensor, val_fraction: float, source: str, **fields) -> Corpus:
    """The last ``val_fraction`` held out; a ``ValueError`` when either part is too small."""
    n = tokens.numel()
    n_val = int(n * val_fraction)
    seq = min(p.seq_len for p in PRESETS.values())
    need = MIN_WINDOWS * (seq + 1)
    if n_val < need or n - n_val < need:
        total = math.ceil(max(need / val_fraction, need / (1 - val_fraction)))
        raise ValueError(
            f"too little data in {source}: {n} tokens, of which the last {n_val} "
            f"(val_fraction {val_fraction:g}) are held out and {n - n_val} left to train on; "
            f"each part needs at least {need} tokens ({MIN_WINDOWS} windows of {seq + 1}, the "
            f"shortest model's seq_len + 1), so about {total} tokens in all at this "
            f"val_fraction. Use more data"
            + (" or a larger val_fraction" if n_val < need and n - n_val >= need else ""))
    return Corpus(train=tokens[:n - n_val].clone(), val=tokens[n - n_val:].clone(),
                  source=source, **fields)


def _check_vocab(corpus: Corpus, vocab: int) -> None:
    need = corpus.min_vocab
    if need <= vocab:
        return
    top = corpus.vocab_needed - 1
    if corpus.kind in ("stdlib", "bytes"):
        raise ValueError(
            f"byte tokens need a vocabulary of at least {BYTE_VOCAB} (this data's largest id "
            f"is {top}), but the model's vocabulary is {vocab}: use a vocabulary of "
            f"{BYTE_VOCAB} or more (--vocab), or a tokenizer of the model's own")
    fix = ("use the tokenizer the model was built with" if corpus.kind == "tokenizer" else
           "check the ids came from the model's tokenizer, and the dtype (PATH:uint32)")
    raise ValueError(
        f"token id {top} in {corpus.source} does not fit the model's vocabulary of {vocab} "
        f"(ids 0..{vocab - 1}); the data needs a vocabulary of at least {need}: pass "
        f"--vocab {need} or more, or {fix}")


class Batches:
    """Random training windows (seeded) and fixed, evenly spaced validation windows."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int,
                 device: torch.device) -> None:
        corpus.check_windows(seq_len)
        self.corpus, self.seq_len, self.batch_size, self.device = (corpus, seq_len, batch_size,
                                                                   device)
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor):
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = data[idx].long()
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)

    def train_batch(self):
        """``(inputs, targets)`` of ``batch_size`` windows at seeded random starts."""
        high = self.corpus.train.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return self._windows(self.corpus.train, starts)

    def val_batches(self, n: int):
        """``n`` fixed batches covering the held-out text evenly."""
        high = self.corpus.val.numel() - self.seq_len - 1
        starts = torch.linspace(0, high, n * self.batch_size).long()
        return [self._windows(self.corpus.val,
                              starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n)]
