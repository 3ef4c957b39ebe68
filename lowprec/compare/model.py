"""The small GPT that ``lowprec compare`` trains, built from lowprec modules.

Every GEMM is a lowprec module, so a recipe quantizes all of them: per block a
``LayerNormLinear`` (pre-norm + fused QKV projection), attention through
``torch.nn.functional.scaled_dot_product_attention`` (causal), a ``Linear``
output projection and a ``LayerNormMLP`` (GELU); a final ``LayerNormLinear``
(norm + LM head). Embeddings stay in high precision, as in every FP8 recipe.

Presets keep every dimension a multiple of 128 (and the tokens of a batch too),
so every recipe, Float8BlockScaling's 128x128 weight blocks included, applies to
every layer without padding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import LayerNormLinear, LayerNormMLP, Linear

VOCAB = 256  # byte-level tokens


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    ffn_mult: int = 4
    lr: float = 1e-3
    default_steps: int = 100
    vocab: int = VOCAB

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def describe(self) -> str:
        return (f"d_model={self.d_model}, layers={self.n_layers}, heads={self.n_heads}, "
                f"seq={self.seq_len}, batch={self.batch_size} ({self.tokens_per_step} tokens/step)")

    def as_dict(self) -> dict:
        return asdict(self)


#: Size presets. ``small`` is the default: it fits a 2-core CPU in well under three
#: minutes for four recipes; ``medium`` and ``large`` are for a GPU.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, n_layers=2, n_heads=2, seq_len=64, batch_size=2,
                        default_steps=20),
    "small": ModelConfig(d_model=128, n_layers=2, n_heads=2, seq_len=128, batch_size=4,
                         default_steps=120),
    "medium": ModelConfig(d_model=512, n_layers=8, n_heads=8, seq_len=512, batch_size=16,
                          lr=1e-3, default_steps=300),
    "large": ModelConfig(d_model=1024, n_layers=16, n_heads=16, seq_len=1024, batch_size=16,
                         lr=3e-4, default_steps=300),
}


def check_config(cfg: ModelConfig) -> None:
    """Every GEMM dimension a multiple of 128, so every recipe's blocks fit."""
    dims = {"d_model": cfg.d_model, "ffn": cfg.d_model * cfg.ffn_mult, "vocab": cfg.vocab,
            "tokens per step (seq_len * batch_size)": cfg.tokens_per_step}
    bad = {k: v for k, v in dims.items() if v % 128}
    if bad:
        raise ValueError(f"model dimensions must be multiples of 128 for every recipe's blocks "
                         f"(Float8BlockScaling uses 128x128 weight blocks); got {bad}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        d, name = cfg.d_model, f"blocks.{index}"
        self.n_heads = cfg.n_heads
        kw = dict(params_dtype=dtype, device=device)
        self.qkv = LayerNormLinear(d, 3 * d, name=f"{name}.qkv", **kw)
        self.proj = Linear(d, d, name=f"{name}.proj", **kw)
        self.mlp = LayerNormMLP(d, cfg.ffn_mult * d, activation="gelu", name=f"{name}.mlp", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx) -> logits`` (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab, d, dtype=dtype, device=device)
        self.pos_emb = nn.Embedding(cfg.seq_len, d, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Block(cfg, i, dtype, device) for i in range(cfg.n_layers))
        self.head = LayerNormLinear(d, cfg.vocab, bias=False, name="lm_head", params_dtype=dtype,
                                    device=device)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers).
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                resid = name.endswith("proj.weight") or name.endswith("fc2_weight")
                p.normal_(0.0, resid_std if resid else std)
            elif name.endswith("bias"):
                p.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
