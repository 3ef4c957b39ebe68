"""Training text that every machine has offline: the Python standard library's own source.

Tokens are bytes (vocabulary 256). The corpus is the top-level ``*.py`` files of the
running interpreter's standard library in sorted order, up to ``max_bytes``; the
last ``val_fraction`` of it is held out for the final evaluation. Batches are drawn
from a generator seeded by the run's seed, so every recipe sees the same batches in
the same order.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

DEFAULT_MAX_BYTES = 4 << 20


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@dataclass
class Corpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor
    n_files: int
    source: str

    @property
    def n_bytes(self) -> int:
        return self.train.numel() + self.val.numel()

    def describe(self) -> str:
        return (f"{self.n_bytes / 2**20:.1f} MiB of Python {sys.version_info.major}."
                f"{sys.version_info.minor} standard-library source ({self.n_files} files from "
                f"{self.source}), byte tokens; last {self.val.numel() / 2**10:.0f} KiB held out")


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05,
                directory: str | None = None) -> Corpus:
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


class Batches:
    """Random training windows (seeded) and fixed, evenly spaced validation windows."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int,
                 device: torch.device) -> None:
        self.corpus, self.seq_len, self.batch_size, self.device = corpus, seq_len, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor):
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = data[idx].long()
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)

    def train_batch(self):
        high = self.corpus.train.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return self._windows(self.corpus.train, starts)

    def val_batches(self, n: int):
        """``n`` fixed batches covering the held-out text evenly."""
        high = self.corpus.val.numel() - self.seq_len - 1
        starts = torch.linspace(0, high, n * self.batch_size).long()
        return [self._windows(self.corpus.val, starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n)]
