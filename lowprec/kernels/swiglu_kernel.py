"""@triton.jit kernels of the SwiGLU of a (M, 2I) tensor (launchers:
:mod:`lowprec.kernels.swiglu`), written to give eager torch's bits for
``silu(h[:, :I]) * h[:, I:]`` and its autograd backward with 16-bit inputs.

Each step rounds where eager rounds and computes as its CUDA kernels compute (fp32
"opmath"): ``silu(g) = g / (1 + exp(-g))`` (correctly rounded exp and division, as nvcc
builds them by default) rounded to the input dtype; the product rounded again; backward
``d_up = round(da * s)``, ``d_s = round(da * up)``, ``d_g = round(d_s * sig * fma(g, 1 - sig,
1))`` with ``sig = 1 / (1 + exp(-g))``, nvcc's contraction of ``1 + g * (1 - sig)``.

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice


@triton.jit
def _tile(h_ptr, M, I, s_h, BM: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    base = h_ptr + rows.to(tl.int64)[:, None] * s_h + cols[None, :]
    return rows, cols, mask, base


@triton.jit
def swiglu_fwd_kernel(h_ptr, a_ptr, M, I, s_h, s_a, BM: tl.constexpr, BI: tl.constexpr):
    """``a = silu(gate) * up`` of one (BM, BI) tile."""
    rows, cols, mask, base = _tile(h_ptr, M, I, s_h, BM, BI)
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + I, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)
    a = (s.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * s_a + cols[None, :], a, mask=mask)


@triton.jit
def swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, M, I, s_h, s_da, s_dh,
                      BM: tl.constexpr, BI: tl.constexpr):
    """``dh = [d_gate, d_up]`` of one (BM, BI) tile from ``h`` and ``da``."""
    rows, cols, mask, base = _tile(h_ptr, M, I, s_h, BM, BI)
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + I, mask=mask, other=0.0)
    da = tl.load(da_ptr + rows.to(tl.int64)[:, None] * s_da + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    e = 1.0 + libdevice.exp(-g)
    s = tl.math.div_rn(g, e).to(gate.dtype)
    d_up = (da * s.to(tl.float32)).to(gate.dtype)
    d_s = (da * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    sig = tl.math.div_rn(1.0, e)
    d_g = ((d_s * sig) * tl.fma(g, 1.0 - sig, 1.0)).to(gate.dtype)
    out = dh_ptr + rows.to(tl.int64)[:, None] * s_dh + cols[None, :]
    tl.store(out, d_g, mask=mask)
    tl.store(out + I, d_up, mask=mask)
