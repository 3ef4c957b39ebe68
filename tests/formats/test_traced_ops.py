"""Per-tensor FP8's traced ops (``kernels.traced_op``): one node to dynamo, whose fake
gives the real op's outputs, and the reference's torch ops in the graph inductor receives."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.float8 import graph as fp8_graph
from lowprec.gemm import traced

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPS = [fp8_graph.fp8_tensorwise, fp8_graph.fp8_current_scale, fp8_graph.fp8_delayed,
       fp8_graph.fp8_tensor_amax, fp8_graph.fp8_scaled_cast, fp8_graph.fp8_cast_transposed,
       traced.fp8_gemm]


def test_every_traced_op_is_in_inductors_decomposition_table():
    """Without its entry inductor would run the op as an opaque kernel: correct, unfused."""
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    for op in OPS:
        assert op.op in table, op.op


def _inputs(device):
    base = torch.randn(32, 48, dtype=torch.bfloat16, device=device)
    scale = torch.tensor([3.5], device=device)
    return {"contiguous": base, "transposed": base.t(),
            "expanded": torch.tensor(0.75, dtype=torch.bfloat16, device=device).expand(32, 48)
            }, scale


def _calls(t, scale):
    wide = t.to(torch.float32)
    codes = fp8_graph.fp8_scaled_cast(t.contiguous(), scale, E4M3, False)
    return [
        (fp8_graph.fp8_tensorwise, (t, E4M3, False, 0.0, False)),
        (fp8_graph.fp8_tensorwise, (wide, E5M2, True, 1e-4, True)),
        (fp8_graph.fp8_current_scale, (t, E4M3, False, 0.0, False)),
        (fp8_graph.fp8_delayed, (t, scale, E4M3, False)),
        (fp8_graph.fp8_tensor_amax, (t, True)),
        (fp8_graph.fp8_scaled_cast, (t, scale, E5M2, False)),
        (fp8_graph.fp8_cast_transposed, (t, scale, E4M3, False)),
        (traced.fp8_gemm, (codes, scale, None, codes, scale, scale.reciprocal().reshape(()),
                           None, torch.bfloat16)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_fakes_give_the_real_outputs(layout, device):
    """Shape, strides and dtype of each output, as the function's own outputs have them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs, scale = _inputs(device)
    t = inputs[layout]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for call, args in _calls(t, scale):
        if call is traced.fp8_gemm and device == "cpu":
            continue  # torch._scaled_mm runs on CUDA only
        real = call.__wrapped__(*args)
        with mode:
            fake = call.op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                             for a in args])
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        for r, f in zip(real, fake, strict=True):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), call


def test_one_node_to_dynamo_and_torch_ops_to_inductor():
    """Dynamo's graph holds the op; the graph AOT autograd makes with inductor's
    decompositions holds the reference's ops (the amax, the cast) instead."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    dynamo_ops, inductor_ops = [], []

    def record(into):
        def keep(g, _inputs):
            into.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return g
        return keep

    def backend(gm, inputs):
        record(dynamo_ops)(gm, inputs)
        return aot_autograd(fw_compiler=record(inductor_ops),
                            decompositions=select_decomp_table())(gm, inputs)

    form = fp8_graph.Tensorwise(E4M3)
    t = torch.randn(32, 64, dtype=torch.bfloat16)
    got = torch.compile(lambda x: form._fp8(x).data, backend=backend, fullgraph=True)(t)
    assert torch.equal(got.view(torch.uint8), form._fp8(t).data.view(torch.uint8))
    assert "lowprec.fp8_tensorwise.default" in dynamo_ops
    assert not any(op.startswith("lowprec.") for op in inductor_ops)
    assert "aten.amax.default" in inductor_ops
