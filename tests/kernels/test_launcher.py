"""lowprec.kernels.launcher: the cached direct launch must run exactly what ``kernel[grid]``
runs, for every argument specialization (alignment, integer value classes)."""

from __future__ import annotations

import pytest
import torch

import lowprec
import lowprec.kernels
from lowprec.kernels import launcher


def test_spec_tells_apart_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.uint8)
    assert launcher._spec(base[0:]) != launcher._spec(base[1:])  # 16-byte alignment
    assert launcher._spec(base) != launcher._spec(base.view(torch.int8))  # dtype
    assert len({launcher._spec(v) for v in (1, 16, 17, 2**31)}) == 4
    assert launcher._spec(True) != launcher._spec(1)
    assert launcher._spec(0.5) == launcher._spec(2.0)
    with pytest.raises(TypeError):
        launcher._spec("text")


class _RecordingKernel:
    """Stands in for a kernel: records the normal-path launches."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_non_triton_kernels_take_the_normal_path():
    k = _RecordingKernel()
    launcher.launch(k, (3,), 1, 2.0, BLOCK=4)
    launcher.launch(k, (3,), 1, 2.0, BLOCK=4)
    assert k.calls == [((3,), (1, 2.0), {"BLOCK": 4})] * 2


needs_gpu = pytest.mark.skipif(not lowprec.kernels.triton_available(),
                               reason="needs a CUDA device and Triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qname", ["current", "delayed", "block1", "mxfp8"])
def test_cached_launches_match_the_reference_across_specializations(qname):
    """The same kernels launched on aligned and misaligned inputs, sizes 1, 16k and odd, in
    an order that makes every entry after the first a cache hit of another entry's kernel."""
    make = {
        "current": lambda: lowprec.Float8CurrentScalingQuantizer(),
        "delayed": lambda: lowprec.Float8Quantizer(torch.ones(1, device="cuda") * 4,
                                                   torch.zeros(1, device="cuda")),
        "block1": lambda: lowprec.Float8BlockQuantizer(block_scaling_dim=1),
        "mxfp8": lambda: lowprec.MXFP8Quantizer(),
    }[qname]
    torch.manual_seed(0)
    flat = torch.randn(1 + 256 * 384, device="cuda", dtype=torch.bfloat16) * 3
    inputs = [flat[:256 * 384].view(256, 384), flat[1:].view(256, 384),  # 2-byte offset
              flat[:128 * 128].view(128, 128), flat[:256 * 384].view(256, 384)]
    if qname in ("current", "delayed"):
        inputs += [flat[:16].view(1, 16), flat[1:8 * 33 + 1].view(8, 33)]
    for x in inputs * 2:
        got = make().quantize(x)
        with lowprec.kernels.reference_only():
            ref = make().quantize(x)
        for name, t in ref.inner_tensors().items():
            g = getattr(got, name)
            assert (t is None) == (g is None), name
            if t is not None:
                same = (torch.equal(g.view(torch.uint8), t.view(torch.uint8))
                        if t.dtype.itemsize == 1 else torch.equal(g.cpu(), t.cpu()))
                assert same, (name, tuple(x.shape), x.data_ptr() % 16)
