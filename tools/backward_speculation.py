"""Which compiled modules' backwards dynamo traces twice, and from where.

Dynamo traces an autograd Function's backward in a strict mode in which asking a tensor's
strides (``stride``, ``is_contiguous``, ``storage_offset``) raises; it then rewrites the
backward with ``contiguous`` calls and traces it again. That doubles the backward's
tracing time, and torch (2.11 to 2.13) leaves the first attempt's ``torch.autocast`` state behind
("Global autocast(cuda)_enabled state changed while dynamo tracing"), so a compiled step
under ``torch.autocast`` fails. For each module, recipe and autocast setting this compiles
one forward (``fullgraph=True``, AOT autograd) and prints how often a backward was traced
again, with the lowprec frames that asked. Exits 1 if any was.

Without a GPU the GPU code path is traced (no-op launches, ``benchmarks/harness.pretend_gpu``;
cuBLASLt taken as present): tracing is all this looks at, so what runs afterwards may fail on the
CPU and is reported, not counted.

    python tools/backward_speculation.py
    python tools/backward_speculation.py --modules linear --recipes fp8_block,nvfp4 --amp only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

MODULES = {
    "linear": lambda lp, dt, dev: lp.Linear(256, 128, name="l", params_dtype=dt, device=dev),
    "layernorm_linear": lambda lp, dt, dev: lp.LayerNormLinear(256, 128, name="l",
                                                               params_dtype=dt, device=dev),
    "layernorm_mlp": lambda lp, dt, dev: lp.LayerNormMLP(
        256, 512, normalization="RMSNorm", activation="swiglu", name="l", params_dtype=dt,
        device=dev),
    "grouped_linear": lambda lp, dt, dev: lp.GroupedLinear(2, 256, 128, name="l",
                                                           params_dtype=dt, device=dev),
}
RECIPES = ("fp8_current,fp8_delayed,fp8_block,mxfp8,nvfp4,mxfp8_fwd_nvfp4_bwd,"
           "fp8_row_mxfp8_col,fp8_current:high_precision,fp8_block:dequantized,"
           "nvfp4:dequantized")


def _user_frames() -> list[str]:
    """The frames of the code dynamo is tracing (file:line:function), outermost first."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    frames, seen, f = [], set(), sys._getframe()
    root = str(Path(__file__).resolve().parent.parent) + "/"
    while f is not None:
        tx = f.f_locals.get("self")
        if isinstance(tx, InstructionTranslatorBase) and id(tx) not in seen:
            seen.add(id(tx))
            frames.append(f"{tx.f_code.co_filename.replace(root, '')}:{tx.lineno}:"
                          f"{tx.f_code.co_name}")
        f = f.f_back
    return frames[::-1]


def _watch() -> list:
    """A list each backward traced again appends the tracing frames of its first try to."""
    import torch._dynamo.exc as exc
    import torch._dynamo.variables.tensor as tensor_vars

    found = []

    class Seen(exc.UnknownPropertiesDuringBackwardTrace):
        def __init__(self, *args):
            found.append(_user_frames())
            super().__init__(*args)
    # dynamo raises it from its tensor variables and catches it by the class in exc
    exc.UnknownPropertiesDuringBackwardTrace = Seen
    tensor_vars.UnknownPropertiesDuringBackwardTrace = Seen
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--recipes", default=RECIPES, help="names, a backward mode after ':'")
    ap.add_argument("--amp", default="both", choices=("both", "only", "off"),
                    help="also (only, never) under torch.autocast(bf16) with fp32 parameters")
    ap.add_argument("--frames", type=int, default=6, help="innermost frames shown")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from harness import pretend_gpu

        from lowprec.gemm import cublaslt
        pretend_gpu()
        cublaslt.available = lambda: True
    import lowprec
    from lowprec.recipe import Recipe

    found = _watch()
    amps = {"both": (None, torch.bfloat16), "only": (torch.bfloat16,), "off": (None,)}[args.amp]
    again = 0
    for module in args.modules.split(","):
        for spec in args.recipes.split(","):
            name, _, mode = spec.partition(":")
            for amp in amps:
                torch._dynamo.reset()
                found.clear()
                dtype = torch.float32 if amp else torch.bfloat16
                m = MODULES[module](lowprec, dtype, device)
                x = torch.randn(256, 256, dtype=dtype, device=device, requires_grad=True)
                call = (x, [128, 128]) if module == "grouped_linear" else (x,)
                recipe = Recipe.from_name(name, **({"backward_mode": mode} if mode else {}))
                try:
                    with lowprec.autocast(recipe=recipe), \
                            torch.autocast(device, dtype=amp or dtype, enabled=amp is not None):
                        torch.compile(m, backend="aot_eager", fullgraph=True)(*call)
                    outcome = "ran"
                except Exception as e:  # reported: on the CPU, running may fail after tracing
                    outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                again += len(found)
                print(f"{module} {spec}{' amp' if amp else ''}: traced again {len(found)} "
                      f"({outcome})", flush=True)
                for frames in found:
                    print("    " + "\n    ".join(frames[-args.frames:]))
    return 1 if again else 0


if __name__ == "__main__":
    sys.exit(main())
