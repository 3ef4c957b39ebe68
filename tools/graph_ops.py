"""The ops one compiled linear puts into the graphs AOT autograd hands inductor (forward and
backward), per peer: a lowprec recipe, torchao float8, bf16 ``nn.Linear``. Graph size is
what dynamo, AOT autograd and inductor each spend their compile time on.

    python tools/graph_ops.py --peers bf16,torchao-tensorwise,lowprec-current --list
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def graphs_of(peer: str, m: int, k: int, n: int, device: str):
    import bench_model as B

    import lowprec

    torch._dynamo.reset()
    dtype = torch.bfloat16
    lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    ctx = None
    if peer.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        model = torch.nn.Sequential(lin)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(
            peer.split("-", 1)[1]))
    elif peer.startswith("lowprec-"):
        model = lowprec.convert_model(torch.nn.Sequential(lin))
        recipe = B.RECIPES[peer.split("-", 1)[1]]()
        ctx = lambda: lowprec.autocast(recipe=recipe)  # noqa: E731
    else:
        model = torch.nn.Sequential(lin)
    graphs = []

    def backend(gm, inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._inductor.decomposition import select_decomp_table

        def keep(g, _):
            graphs.append(g)
            return g.forward
        # inductor's decompositions: the graphs inductor receives (lowprec's traced ops
        # become their torch ops there, kernels.traced_op)
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep,
                                     decompositions=select_decomp_table())

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    for _ in range(2):
        if ctx is not None:
            with ctx():
                y = compiled(x)
        else:
            y = compiled(x)
        y.float().sum().backward()
    return graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="bf16,torchao-tensorwise,lowprec-current")
    ap.add_argument("--shape", default="4096x2048x2048", help="MxKxN")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--list", action="store_true", help="print every graph's ops in order")
    args = ap.parse_args()
    m, k, n = (int(v) for v in args.shape.split("x"))
    for peer in args.peers.split(","):
        graphs = graphs_of(peer, m, k, n, args.device)
        for name, g in zip(("forward", "backward"), graphs[:2]):
            calls = [nd for nd in g.graph.nodes if nd.op == "call_function"]
            kinds = collections.Counter(str(nd.target) for nd in calls)
            print(f"{peer} {name}: {len(calls)} ops; "
                  + ", ".join(f"{t} {c}" for t, c in kinds.most_common()))
            if args.list:
                print(g.code)


if __name__ == "__main__":
    main()
