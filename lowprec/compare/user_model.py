"""The model ``lowprec compare`` trains: a preset GPT, or the user's own.

``--model`` takes

* a preset name (``tiny``, ``small``, ``medium``, ``large``): the byte-level GPT of
  ``model.py``, built from lowprec modules;
* a local Hugging Face model directory (``config.json``, with or without weights):
  ``AutoModelForCausalLM`` loaded offline, randomly initialized from the config or, when
  the directory holds weights, from them (a fine-tuning comparison); its tokenizer is used
  for ``--data`` when the directory has one;
* ``path/to/file.py:build`` or ``package.module:build``: ``build()`` returns an
  ``nn.Module`` that maps token ids ``(batch, seq)`` (int64) to logits
  ``(batch, seq, vocab)`` (or an object with ``.logits``, or a tuple whose first item is
  the logits). The vocabulary is read from the model's output embedding
  (``get_output_embeddings()``) or its last ``nn.Linear``/``nn.Embedding``; ``--vocab``
  gives it when that cannot be read.

A user model is converted with ``lowprec.convert_model`` for every recipe alike (bf16
included, whose lowprec modules compute in high precision outside autocast), with one
filter: the Linears whose qualified names match a ``--keep-high-precision`` pattern stay
``nn.Linear``. Every recipe starts from the same weights: the same seed before a random
initialization, the same checkpoint otherwise.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .model import GPT, PRESETS, ModelConfig

#: files that hold a Hugging Face checkpoint's weights
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelError(ValueError):
    """A ``--model`` that cannot be loaded, with what was tried."""


@dataclass
class ModelSource:
    """How to build a fresh copy of the model each recipe trains."""

    kind: str  # "preset" | "hf" | "build"
    label: str
    vocab: int
    factory: Callable[[], nn.Module]
    tokenizer: object | None = None
    pretrained: bool = False
    keep_high_precision: tuple[str, ...] = ()
    #: builds the model's shapes only (no checkpoint read); default ``factory``
    shape_factory: Callable[[], nn.Module] | None = None

    def describe(self) -> str:
        what = {"preset": "preset", "hf": "Hugging Face model", "build": "user model"}[self.kind]
        init = "checkpoint weights" if self.pretrained else "random init"
        keep = (f", kept in high precision: {', '.join(self.keep_high_precision)}"
                if self.keep_high_precision else "")
        return f"{what} {self.label} (vocab {self.vocab}, {init}{keep})"

    def keep(self, fqn: str) -> bool:
        """Whether the Linear named ``fqn`` stays in high precision."""
        return any(fnmatch.fnmatchcase(fqn, pattern) for pattern in self.keep_high_precision)

    def build(self, device, dtype: torch.dtype = torch.bfloat16, *,
              shapes_only: bool = False) -> nn.Module:
        """A fresh model on ``device`` in ``dtype``, its Linears lowprec modules (the caller
        seeds the generator first: a random initialization draws from it).
        ``shapes_only``: a checkpoint's weights are not read."""
        model = (self.shape_factory or self.factory)() if shapes_only else self.factory()
        if self.kind != "preset":
            from ..model import convert_model
            model = model.to(dtype=dtype)
            convert_model(model, module_filter_fn=lambda m, fqn: not self.keep(fqn),
                          fuse_norms=False)
        return model.to(device=device, dtype=dtype)


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output (a tensor, ``.logits``, or a tuple's first item)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelError(f"the model returned a {type(output).__name__}; it must return logits "
                     f"(batch, seq, vocab), an object with .logits, or a tuple starting with them")


def is_preset(spec: str) -> bool:
    return spec in PRESETS


def resolve_model(spec: str, *, vocab: int | None = None,
                  keep_high_precision: tuple[str, ...] = ()) -> ModelSource:
    """The ``ModelSource`` for ``--model spec`` (see the module doc)."""
    keep = tuple(p for p in keep_high_precision if p)
    if is_preset(spec):
        cfg = PRESETS[spec]
        if keep:
            raise ModelError("--keep-high-precision applies to a Hugging Face or user model; a "
                             "preset quantizes every GEMM")
        return ModelSource("preset", spec, cfg.vocab, lambda: GPT(cfg, device="cpu"))
    if os.path.isdir(spec):
        source = _hf_source(spec, vocab)
    elif ":" in spec:
        source = _build_source(spec, vocab)
    else:
        raise ModelError(f"--model {spec!r} is not a preset ({', '.join(PRESETS)}), a directory, "
                         f"or path/to/file.py:build / module:build")
    source.keep_high_precision = keep
    return source


def _hf_source(path: str, vocab: int | None) -> ModelSource:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"--model {path!r} is a directory without config.json; a Hugging Face "
                         f"model directory needs one")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ModelError(f"--model {path!r}: loading a Hugging Face model needs the "
                         f"transformers package (pip install transformers)") from None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"--model {path!r}: cannot read its config.json: {err}") from None
    pretrained = any(os.path.exists(os.path.join(path, f)) for f in _WEIGHT_FILES)

    # (fp32 after loading: the dtype keyword's name differs between transformers versions)
    def from_config():
        return AutoModelForCausalLM.from_config(config).float()

    def factory():
        if pretrained:
            return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float()
        return from_config()

    model_vocab = getattr(config, "vocab_size", None)
    if vocab is not None and model_vocab is not None and vocab != model_vocab:
        raise ModelError(f"--vocab {vocab} differs from the model's vocab_size {model_vocab}")
    if (vocab or model_vocab) is None:
        raise ModelError(f"--model {path!r}: its config has no vocab_size; pass --vocab")
    tokenizer = None
    if any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ModelError(f"--model {path!r}: its tokenizer files do not load: {err}") from None
    label = f"{os.path.basename(os.path.normpath(path))} ({type(config).__name__})"
    return ModelSource("hf", label, vocab or model_vocab, factory, tokenizer, pretrained,
                       shape_factory=from_config)


def _load_build(spec: str) -> Callable[[], nn.Module]:
    target, _, name = spec.rpartition(":")
    if not name.isidentifier():
        raise ModelError(f"--model {spec!r}: after ':' comes the name of a build function")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ModelError(f"--model {spec!r}: no file {target!r}")
        mod_name = "_lowprec_compare_model_" + os.path.splitext(os.path.basename(target))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, target)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file: say what it raised
            raise ModelError(f"--model {spec!r}: importing {target} raised "
                             f"{type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ModelError(f"--model {spec!r}: cannot import {target!r}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ModelError(f"--model {spec!r}: {target} has no callable {name!r}")
    return fn


def _build_source(spec: str, vocab: int | None) -> ModelSource:
    fn = _load_build(spec)

    def factory():
        model = fn()
        if not isinstance(model, nn.Module):
            raise ModelError(f"--model {spec!r}: build() returned a {type(model).__name__}, not "
                             f"an nn.Module")
        return model.float()

    probe = factory()
    found = _read_vocab(probe)
    if vocab is None and found is None:
        raise ModelError(f"--model {spec!r}: cannot read the vocabulary from the model (no "
                         f"get_output_embeddings(), Linear or Embedding); pass --vocab")
    if vocab is not None and found is not None and vocab != found:
        raise ModelError(f"--vocab {vocab} differs from the model's output size {found}")
    return ModelSource("build", spec, vocab or found, factory)


def _read_vocab(model: nn.Module) -> int | None:
    """The output size: the output embedding's, else the last Linear's, else the first
    Embedding's vocabulary."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Linear):
        return head.out_features
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1].out_features
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else None


def run_config(source: ModelSource, *, seq_len: int | None, batch_size: int | None,
               lr: float | None, steps: int | None, preset: str = "small") -> ModelConfig:
    """The ``ModelConfig`` a run uses: the preset's (with overrides), or, for a user model,
    the ``small`` preset's schedule with its vocabulary and the given shape."""
    import dataclasses
    base = PRESETS[source.label] if source.kind == "preset" else PRESETS[preset]
    changes = {k: v for k, v in (("seq_len", seq_len), ("batch_size", batch_size), ("lr", lr),
                                 ("default_steps", steps)) if v is not None}
    if source.kind != "preset":
        changes["vocab"] = source.vocab
    return dataclasses.replace(base, **changes)
