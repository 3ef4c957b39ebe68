"""Tile sweep of the two bf16 dequantize kernels of the GEMM emulation, checked bit for bit.

For MXFP8 (``lowprec.gemm.kernels.MX_DEQUANT_CONFIG``) and NVFP4
(``lowprec.kernels.tuning.tuning.nvfp4_config["dequant"]``): every candidate tile is first
compared with the pure-torch dequantization on odd and aligned shapes (a candidate
that differs in any bit is dropped), then timed on a 16384x4096 operand against a
device-to-device copy of the bf16 output size. Prints the fastest exact candidate per
kernel, with GB/s counting the bytes read (codes + scales) and written (bf16).

    python tools/sweep_dequant.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import l2_rotation, time_fn  # noqa: E402

from lowprec import MXFP8Quantizer, NVFP4Quantizer  # noqa: E402
from lowprec.formats.nvfp4 import launch as nv_launch  # noqa: E402
from lowprec.gemm import kernels
from lowprec.kernels.tuning import override, tuning  # noqa: E402

MX_CANDIDATES = [{"BR": 16, "NB": 16, "warps": 8}, {"BR": 32, "NB": 8, "warps": 8},
                 {"BR": 8, "NB": 16, "warps": 4}, {"BR": 16, "NB": 8, "warps": 4},
                 {"BR": 32, "NB": 16, "warps": 8}, {"BR": 64, "NB": 4, "warps": 8}]
NV_CANDIDATES = [{"KB": 8, "RB": 16}, {"KB": 16, "RB": 16}, {"KB": 4, "RB": 32},
                 {"KB": 8, "RB": 32}, {"KB": 16, "RB": 8}, {"KB": 32, "RB": 8}]
SHAPES = [(16384, 4096), (256, 512), (96, 160), (1000, 64)]


def _mx_tensors(shape, two_d=False):
    q = MXFP8Quantizer(torch.float8_e4m3fn, with_2d_quantization=two_d)
    q.set_usage(rowwise=True, columnwise=False)
    x = torch.randn(*shape, device="cuda") * torch.logspace(-8, 8, shape[1], device="cuda")
    return q.quantize(x.to(torch.bfloat16))


def _nv_tensors(shape, two_d=False):
    q = NVFP4Quantizer(with_2d_quantization=two_d)
    q.set_usage(rowwise=True, columnwise=False)
    x = torch.randn(*shape, device="cuda") * torch.logspace(-6, 6, shape[1], device="cuda")
    return q.quantize(x.to(torch.bfloat16))


def _same(a, b) -> bool:
    return bool((a.view(torch.int16) == b.view(torch.int16)).all())


def sweep(name, cfg_holder, key, candidates, make, run_kernel, run_ref, bytes_of):
    exact = []
    for cand in candidates:
        cfg_holder[key] = cand
        ok = True
        for shape in SHAPES:
            for two_d in (False, True):
                if two_d and (shape[0] % 32 or shape[1] % 32):
                    continue
                t = make(shape, two_d)
                ok &= _same(run_kernel(t), run_ref(t))
        print(f"{name} {cand}: {'exact' if ok else 'MISMATCH (dropped)'}", flush=True)
        if ok:
            exact.append(cand)
    m, k = SHAPES[0]
    sets = l2_rotation(lambda: (make((m, k), False),), 3 * m * k)
    dst = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    src = torch.empty_like(dst)
    copy_ms = time_fn(lambda: dst.copy_(src), [()], iters=50)
    copy_gbs = 4 * m * k / copy_ms / 1e6
    best = None
    for cand in exact:
        cfg_holder[key] = cand
        ms = time_fn(run_kernel, sets, iters=50)
        gbs = bytes_of(sets[0][0]) / ms / 1e6
        print(f"{name} {cand}: {ms * 1e3:7.1f} us  {gbs:6.0f} GB/s  {100 * gbs / copy_gbs:4.0f}% "
              f"of copy ({copy_gbs:.0f} GB/s)", flush=True)
        if best is None or ms < best[1]:
            best = (cand, ms)
    if best:
        cfg_holder[key] = best[0]
        print(f"BEST {name}: {best[0]} {best[1] * 1e3:.1f} us", flush=True)
    return best


def main():
    def mx_kernel(t):
        return kernels.mxfp8_dequantize_bf16(t.rowwise_data, t.rowwise_scale,
                                             32 if t.with_2d_quantization else 1)

    def mx_ref(t):
        return kernels.mxfp8_dequantize_bf16_torch(t.rowwise_data, t.rowwise_scale,
                                                   32 if t.with_2d_quantization else 1)

    def nv_kernel(t):
        return nv_launch.dequantize_unscaled_bf16(t, "rowwise")[0]

    def nv_ref(t):
        return nv_launch._dequantize_unscaled_torch(t.rowwise_data, t.rowwise_scale,
                                                    bool(t.with_2d_quantization))

    def nbytes(t):
        d, s = t.rowwise_data, t.rowwise_scale
        return d.numel() * d.element_size() + s.numel() * s.element_size() + 2 * t.numel()

    # the launchers read the module global / ``tuning`` at each call
    sweep("mxfp8 dequant", vars(kernels), "MX_DEQUANT_CONFIG", MX_CANDIDATES, _mx_tensors,
          mx_kernel, mx_ref, nbytes)
    with override(nvfp4_config=dict(tuning.nvfp4_config)):
        sweep("nvfp4 dequant", tuning.nvfp4_config, "dequant", NV_CANDIDATES, _nv_tensors,
              nv_kernel, nv_ref, nbytes)


if __name__ == "__main__":
    main()
