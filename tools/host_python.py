"""Python and allocation host cost of the block-scaled quantize and GEMM scale preparation,
with the Triton launch replaced by a no-op: runs on any machine (no GPU), so host-side
changes can be compared before spending device time. CPU tensors stand in for CUDA ones;
a CUDA host adds the launches and its allocator's cost on top.

    python tools/host_python.py          # run it in two trees to compare commits
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lowprec.formats.block.quantizer as block_quantizer  # noqa: E402
import lowprec.gemm.cublas_fp8 as cublas  # noqa: E402
import lowprec.kernels  # noqa: E402
import lowprec.kernels.block_scaled as block_kernels  # noqa: E402
from lowprec import Float8BlockQuantizer  # noqa: E402
from lowprec.kernels import reference_only  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def median_us(fn, calls: int = 3000, runs: int = 7) -> float:
    for _ in range(300):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(times)[runs // 2]


def main():
    block_kernels.block_scaled_quant_kernel = _NoLaunch()
    if lowprec.kernels.gluon_available():  # the 1x128 launches the launcher picks
        import lowprec.formats.block.gluon_kernels as gluon_kernels
        gluon_kernels.block1_both_kernel = gluon_kernels.block1_col_kernel = _NoLaunch()
    block_quantizer.use_kernels = lambda x: lowprec.kernels._enabled  # kernel path on CPU
    x = torch.randn(512, 512, dtype=torch.bfloat16)
    q1 = Float8BlockQuantizer(block_scaling_dim=1)
    q2 = Float8BlockQuantizer(block_scaling_dim=2)
    # GEMM operands with real scales (the no-op launch leaves its outputs uninitialized)
    # and, where the tensor class keeps them, the decode records a kernel quantize leaves
    with reference_only():
        a, b = q1.quantize(x), q2.quantize(x)
    for t in (a, b):
        for usage in ("rowwise", "columnwise"):
            if f"_decode_{usage}" in type(t)._derived:
                setattr(t, f"_decode_{usage}", t.derived_record(
                    getattr(t, f"{usage}_scale"), t.decode_scale(usage)))
    rows = [("block 1x128 quantize, both usages", lambda: q1.quantize(x)),
            ("block 128x128 quantize, both usages", lambda: q2.quantize(x)),
            ("GEMM block scales, fprop (1x128 x 128x128)",
             lambda: cublas._block_scales(a, "rowwise", b, "rowwise")),
            ("GEMM block scales, wgrad (1x128 x 1x128)",
             lambda: cublas._block_scales(a, "columnwise", a, "columnwise"))]
    for name, fn in rows:
        print(f"{name:45} {median_us(fn):7.1f} us")


if __name__ == "__main__":
    main()
