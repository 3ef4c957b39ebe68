"""One mixture-of-experts layer, forward + backward: bf16 grouped GEMMs against lowprec.

The layer: a bf16 router, softmax, top-k, the routed rows permuted by expert, the experts'
gate/up GEMM, SwiGLU, the down GEMM, and the weighted un-permute back to the tokens. The
per-expert token counts stay on the GPU (no host sync) in every peer but ``bf16-loop``.

Peers (in the same run): ``bf16-grouped`` (``torch._grouped_mm``), ``bf16-loop`` (one
``F.linear`` per expert), ``torchao-fp8-rowwise`` (torchao's FP8 MoE grouped GEMM, when it
imports), and ``lowprec-<recipe>`` (the experts as :class:`lowprec.GroupedExperts`, as a
converted model runs them, under ``lowprec.autocast(recipe=...)``: current, current-e4m3,
block, mxfp8, nvfp4).
Per peer: wall ms (CUDA events, median), GPU kernel ms (profiler), the host share, peak
memory, and the speedup over ``bf16-grouped``; rows go to the results CSV.

``--model mixtral|qwen3`` instead times a whole Hugging Face MoE model built from a config
(``--layers`` decoder layers of that shape, batch x sequence tokens): forward, backward
and fused AdamW, eager and ``torch.compile``d. bf16 runs transformers' own experts
(``experts_implementation="grouped_mm"``); lowprec converts every Linear but ``lm_head``
and the experts (``convert_model``) and trains under Float8CurrentScaling with E4M3
gradients.

    python benchmarks/bench_moe.py [--shapes mixtral,qwen3] [--recipes current]
    python benchmarks/bench_moe.py --model qwen3 [--layers 4] [--modes eager,compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import append_rows, gpu_kernel_ms, median_step_ms  # noqa: E402

import lowprec  # noqa: E402
from lowprec.gemm import grouped_mm
from lowprec.linear.grouped import group_ids  # noqa: E402

#: name: (hidden, experts, top-k, expert ffn)
SHAPES = {"mixtral": (4096, 8, 2, 14336), "qwen3": (2048, 128, 8, 768)}


def recipe(name: str):
    """The lowprec recipe of a peer name."""
    from lowprec.recipe.recipes import (
        Float8BlockScaling,
        Float8CurrentScaling,
        Format,
        MXFP8BlockScaling,
        NVFP4BlockScaling,
    )
    recipes = {"current": Float8CurrentScaling,
               "current-e4m3": lambda: Float8CurrentScaling(fp8_format=Format.E4M3),
               "block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling,
               "nvfp4": NVFP4BlockScaling}
    if name not in recipes:
        raise ValueError(f"unknown recipe {name!r}; use one of {sorted(recipes)}")
    return recipes[name]()


def _torch_grouped(x, w, counts):
    return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(counts, 0, dtype=torch.int32))


def _loop(x, w, counts):
    return torch.cat([F.linear(xg, w[g]) for g, xg in enumerate(x.split(counts.tolist()))])


def _torchao(x, w, counts):
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    # torchao 0.18 refuses to pad the groups itself (pad_token_groups_for_grouped_mm=True
    # is "not yet supported") and its FP8 wgrad needs every group to start at a multiple
    # of 16 rows: the rows go into a padded copy here, in torch ops, and back out.
    src, valid, padded_offs, _, dest = grouped_mm.padded_layout(
        counts, group_ids(counts, x.shape[0]), x.shape[0])
    # index_copy keeps the copy differentiable (padded_rows moves bits, no gradient)
    xp = x.new_zeros(src.shape[0], x.shape[1]).index_copy(0, dest, x)
    y = _to_fp8_rowwise_then_scaled_grouped_mm(xp, w.transpose(1, 2), padded_offs,
                                               pad_token_groups_for_grouped_mm=False)
    return y[dest]


class ExpertsModule:
    """A lowprec peer: the layer's experts as :class:`lowprec.GroupedExperts` (holding the
    layer's own w13 / w2) under ``lowprec.autocast(recipe=...)``, as a converted model
    runs them: routed rows laid out in the recipe's blocks, grouped GEMMs."""

    def __init__(self, name: str):
        self.recipe, self.module = recipe(name), None

    def bind(self, layer) -> None:
        source = SimpleNamespace(gate_up_proj=layer.w13, down_proj=layer.w2, act_fn=F.silu,
                                 _apply_gate=None, training=True)
        self.module = lowprec.GroupedExperts.from_experts(source, name="experts")

    def __call__(self, x, top_i, top_p):
        with lowprec.autocast(recipe=self.recipe):
            return self.module(x, top_i, top_p)


class MoE(torch.nn.Module):
    def __init__(self, hidden, experts, topk, ffn, experts_fn):
        super().__init__()
        self.topk, self.ffn, self.experts_fn = topk, ffn, experts_fn
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w13 = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * hidden ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, ffn) * ffn ** -0.5)

    def forward(self, x):
        experts = self.w13.shape[0]
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_p, top_i = probs.topk(self.topk, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        if isinstance(self.experts_fn, ExpertsModule):
            return self.experts_fn(x, top_i, top_p.to(x.dtype))
        flat = top_i.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        token = order // self.topk
        h = self.experts_fn(x[token], self.w13, counts)
        a = F.silu(h[:, :self.ffn]) * h[:, self.ffn:]
        o = self.experts_fn(a, self.w2, counts)
        weight = top_p.reshape(-1)[order].to(o.dtype)
        return torch.zeros_like(x).index_add_(0, token, o * weight[:, None])


def _print_ops(step, rows):
    """The ``rows`` torch ops of one step with the most GPU time of their own."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows,
                                    max_name_column_width=60))


def run_shape(name, tokens, peers, steps, warmup, top=0, ops=0):
    hidden, experts, topk, ffn = SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    layer = MoE(hidden, experts, topk, ffn, None).to("cuda", torch.bfloat16)
    results = {}
    print(f"\n{name}: hidden {hidden}, {experts} experts, top-{topk}, expert ffn {ffn}, "
          f"{tokens} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'peer':24s} {'ms':>8s} {'GPU ms':>8s} {'host':>6s} {'peak GiB':>9s} "
          f"{'vs bf16-grouped':>16s}")
    for peer, fn in peers:
        layer.experts_fn = fn
        if isinstance(fn, ExpertsModule):
            fn.bind(layer)
        xx = x.clone().requires_grad_(True)

        def step(i):
            layer.zero_grad(set_to_none=True)
            xx.grad = None
            layer(xx).backward(dy)
        try:
            for i in range(warmup):
                step(i)
            missing = [n for n, p in layer.named_parameters() if p.grad is None
                       or not p.grad.abs().sum().item()]
            if missing or xx.grad is None:
                raise RuntimeError(f"no gradient for {missing or 'the input'}")
            ms, peak = median_step_ms(step, steps)
            gpu, kernels, heaviest = gpu_kernel_ms(step, steps=3, top=top)
        except Exception as exc:  # noqa: BLE001 - report the peer that cannot run and go on
            print(f"{peer:24s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        results[peer] = ms
        base = results.get("bf16-grouped")
        ratio = base / ms if base else float("nan")
        print(f"{peer:24s} {ms:8.2f} {gpu:8.2f} {1 - gpu / ms:6.1%} {peak:9.2f} {ratio:15.2f}x")
        for k_ms, launches, kname in heaviest:
            print(f"    {k_ms:7.2f} ms {launches:5.0f}x  {kname[:90]}")
        if ops and isinstance(fn, ExpertsModule):
            _print_ops(step, ops)
        append_rows([dict(bench="moe", shape=f"{name} {tokens}tok", recipe=peer,
                          metric="step_ms", value=round(ms, 3), baseline="bf16-grouped",
                          baseline_value=round(base, 3) if base else "",
                          ratio=round(ratio, 4) if base else "",
                          note=f"GPU kernels {gpu:.2f} ms ({kernels:.0f}); host share "
                               f"{1 - gpu / ms:.1%}; peak {peak:.2f} GiB")])
        torch.cuda.empty_cache()


def build_model(name: str, layers: int, experts_impl: str, device: str = "cuda"):
    import transformers

    hidden, experts, topk, ffn = SHAPES[name]
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=32000,
                  num_attention_heads=hidden // 128,
                  num_key_value_heads=min(8, hidden // 128),
                  max_position_embeddings=4096, use_cache=False)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=ffn, num_local_experts=experts,
                                         num_experts_per_tok=topk, **common)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=ffn, intermediate_size=ffn,
                                          num_experts=experts, num_experts_per_tok=topk,
                                          head_dim=128, **common)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(cfg, attn_implementation="sdpa",
                                experts_implementation=experts_impl).to(torch.bfloat16)


def _time_model(name, layers, peer, mode, ids, recipe, steps, warmup, top=0, ops=0):
    m = build_model(name, layers, "grouped_mm")
    ctx = None
    if peer != "bf16":
        lowprec.convert_model(m, module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)
        ctx = lambda: lowprec.autocast(recipe=recipe)  # noqa: E731
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
    fwd = torch.compile(m) if mode == "compiled" else m

    def step(i):
        with ctx() if ctx is not None else contextlib.nullcontext():
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start  # compile time included
    ms, peak = median_step_ms(step, steps)
    gpu, kernels, heaviest = gpu_kernel_ms(step, steps=2, top=top)
    if ops:
        _print_ops(step, ops)
    return ms, peak, gpu, kernels, heaviest, warm_s


def run_model(name, layers, batch, seq, modes, steps, warmup, top=0, recipes=("current-e4m3",),
              ops=0):
    tokens = batch * seq
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    print(f"\n{name} model, {layers} layers, {tokens} tokens a step, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'peer':24s} {'mode':9s} {'ms':>8s} {'GPU ms':>8s} {'host':>6s} {'peak GiB':>9s} "
          f"{'vs bf16 same mode':>18s}")
    base = {}
    for peer in ("bf16", *(f"lowprec-{r}" for r in recipes)):
        for mode in modes:
            try:
                ms, peak, gpu, kernels, heaviest, warm_s = _time_model(
                    name, layers, peer, mode, ids,
                    recipe(peer[len("lowprec-"):]) if peer != "bf16" else None, steps, warmup,
                    top, ops)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{peer:24s} {mode:9s} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            finally:
                torch.cuda.empty_cache()
            if peer == "bf16":
                base[mode] = ms
            ratio = base[mode] / ms if mode in base else float("nan")
            print(f"{peer:24s} {mode:9s} {ms:8.2f} {gpu:8.2f} {1 - gpu / ms:6.1%} {peak:9.2f} "
                  f"{ratio:17.2f}x  warm-up {warm_s:.0f} s")
            for k_ms, launches, kname in heaviest:
                print(f"    {k_ms:7.2f} ms {launches:5.0f}x  {kname[:90]}")
            append_rows([dict(bench="moe_model", shape=f"{name} {layers}L {tokens}tok",
                              recipe=f"{peer} {mode}", metric="step_ms", value=round(ms, 3),
                              baseline=f"bf16 {mode}",
                              baseline_value=round(base[mode], 3) if mode in base else "",
                              ratio=round(ratio, 4) if mode in base else "",
                              note=f"GPU kernels {gpu:.2f} ms ({kernels:.0f}); host share "
                                   f"{1 - gpu / ms:.1%}; peak {peak:.2f} GiB; "
                                   f"warm-up {warm_s:.0f} s ({warmup} steps)")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--recipes", default="current-e4m3,current",
                    help="lowprec recipes: current (HYBRID), current-e4m3, block, mxfp8, nvfp4 "
                         "(with --model: each converts the model's Linears and experts)")
    ap.add_argument("--no-loop", action="store_true", help="skip the bf16 per-expert loop")
    ap.add_argument("--top-kernels", type=int, default=0,
                    help="print each peer's N heaviest kernels (GPU ms a step)")
    ap.add_argument("--ops", type=int, default=0,
                    help="print the N torch ops with the most GPU time of each lowprec peer "
                         "(with --model: of every peer)")
    ap.add_argument("--model", default="", help="time a whole HF MoE model: mixtral, qwen3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.model:
        run_model(args.model, args.layers, args.batch, args.seq,
                  [m for m in args.modes.split(",") if m], args.steps, args.warmup,
                  args.top_kernels, [r for r in args.recipes.split(",") if r], args.ops)
        return
    peers = [("bf16-grouped", _torch_grouped)]
    if not args.no_loop:
        peers.append(("bf16-loop", _loop))
    try:
        import torchao.prototype.moe_training  # noqa: F401
        peers.append(("torchao-fp8-rowwise", _torchao))
    except ImportError as exc:
        print(f"torchao's MoE training does not import ({exc}); no torchao peer")
    peers += [(f"lowprec-{r}", ExpertsModule(r)) for r in args.recipes.split(",") if r]
    for name in args.shapes.split(","):
        run_shape(name, args.tokens, peers, args.steps, args.warmup, args.top_kernels,
                  args.ops)


if __name__ == "__main__":
    main()
