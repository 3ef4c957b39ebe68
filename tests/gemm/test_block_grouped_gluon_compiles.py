"""The Gluon kernels of the grouped block-scaled FP8 GEMM (``gemm/_block_grouped_gluon.py``)
compiled for a Hopper GPU (sm_90a) without one: Triton's whole pipeline down to ptxas's
cubin, for every config the tuning table picks and the warp-specialized kernel's, both
problem shapes (row groups, contraction groups) and both weight scale layouts. A kernel that
does not compile fails here, on the CPU machine, before any GPU run. Whether they compute
the right bits is ``tests/linear/test_grouped_block_fp8.py``'s GPU test."""

from __future__ import annotations

import pytest

runtime = pytest.importorskip("triton.experimental.gluon._runtime",
                              reason="this Triton has no Gluon")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from lowprec.kernels.tuning import tuning  # noqa: E402

INTS = ("M", "N", "G", "B_GROUP_ROWS", "B_GROUP_COLS", "s_dam", "s_dak", "s_dbg", "s_dbn",
        "s_dbk", "s_og", "s_om", "s_on")
POINTERS = {"da_ptr": "*fp32", "db_ptr": "*fp32", "out_ptr": "*bf16", "offs_ptr": "*i32"}


def _desc(rows: int) -> str:
    """The signature Triton gives a TMA descriptor of fp8 codes in (rows, 128) blocks,
    built as the launcher builds it (over a CPU tensor: only its type is read)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    codes = torch.empty(2 * rows, 256, dtype=torch.float8_e4m3fn)
    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
    desc = TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [rows, 128], layout)
    return mangle_type(desc)


def _compile(cfg, group_k: bool, b_rows: int):
    from lowprec.gemm import _block_grouped_gluon as kernels
    bn, stages, overlap, band, warps = cfg
    ws = overlap == 2
    kernel = kernels.block_grouped_ws_kernel if ws else kernels.block_grouped_gluon_kernel
    bm = 128 if ws else 16 * warps
    consts = dict(GROUP_K=group_k, A_ROWS=1, B_ROWS=b_rows, GP=8, GROUP_M=band,
                  STAGES=stages)
    if not ws:
        consts["OVERLAP"] = bool(overlap)
    consts["num_warps"] = warps
    signature = {"a_desc": _desc(bm), "b_desc": _desc(bn), **POINTERS,
                 **dict.fromkeys(INTS, "i32"), **dict.fromkeys(consts, "constexpr")}
    assert list(signature) == kernel.arg_names
    aligned = {(kernel.arg_names.index(p),): [["tt.divisibility", 16]] for p in POINTERS}
    source = runtime.GluonASTSource(fn=kernel, signature=signature, constexprs=consts,
                                    attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


CONFIGS = sorted({c for c in tuning.block_grouped_gluon_configs.values() if c is not None}
                 | {(128, 2, 2, 8, 4), (128, 3, 2, 8, 4)}, key=str)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(map(str, c)))
@pytest.mark.parametrize("group_k", [False, True], ids=["rows", "wgrad"])
@pytest.mark.parametrize("b_rows", [128, 1], ids=["w128x128", "w1x128"])
def test_block_grouped_gluon_kernel_compiles_for_hopper(cfg, group_k, b_rows):
    compiled = _compile(cfg, group_k, b_rows)
    assert compiled.asm.get("cubin"), "no cubin: ptxas did not run"
