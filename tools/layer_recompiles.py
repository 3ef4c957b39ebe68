"""How many times a Hugging Face Llama whose decoder layers are compiled one by one (the
torchtitan order) compiles the layer's code, per recipe: 1 where every layer shares the
code, the number of layers where each layer compiles its own (dynamo then stops at its
``recompile_limit``, 8, and runs the layers after it eagerly). Prints the frames, graph
breaks, the first recompile's reason and the calls left as one opaque op.

    python tools/layer_recompiles.py [--recipes current,delayed] [--layers 4]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch._dynamo.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_model as B  # noqa: E402

import lowprec  # noqa: E402
from lowprec.compile.call import _FALLBACKS  # noqa: E402


class _Reasons(logging.Handler):
    """Keeps the recompile reasons dynamo logs."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record) -> None:
        lines = record.getMessage().splitlines()
        guard = next((ln.strip() for ln in lines if ln.strip().startswith("- ")), "")
        self.reasons.append(guard[:240])


def run(recipe_name, layers: int, steps: int = 2, compiled: bool = True) -> dict:
    """``steps`` training steps of the Llama under ``recipe_name`` (a ``bench_model.py``
    recipe name, or a recipe), its decoder layers
    compiled one by one (``compiled``) or eager: {"frames": frames compiled, "breaks":
    graph breaks, "reasons": recompile reasons, "fallbacks": calls left opaque, "losses":
    the steps' losses, "grads": the last step's gradients}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _FALLBACKS.clear()
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    lowprec.convert_model(model, module_filter_fn=B.not_lm_head)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    if compiled:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, backend=counter)
    recipe = B.RECIPES[recipe_name]() if isinstance(recipe_name, str) else recipe_name
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    handler = _Reasons()
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    losses = []
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with lowprec.autocast(recipe=recipe):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"frames": counter.frame_count, "breaks": breaks, "reasons": handler.reasons,
            "fallbacks": list(_FALLBACKS), "losses": losses, "grads": grads}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(B.RECIPES))
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    shared = True
    for name in args.recipes.split(","):
        got = run(name, args.layers)
        n, breaks, reasons = got["frames"], got["breaks"], got["reasons"]
        shared &= n == 1 and not breaks and not got["fallbacks"]
        print(f"{name:22s} frames {n}  graph breaks {breaks}  opaque calls "
              f"{len(got['fallbacks'])}"
              + (f"\n    first recompile: {reasons[0]}" if reasons else "")
              + "".join(f"\n    opaque: {r}" for r in got["fallbacks"]), flush=True)
    return 0 if shared else 1


if __name__ == "__main__":
    sys.exit(main())
