"""bf16 GEMMs through cuBLASLt with the output scale read from device memory (ctypes).

The bf16 emulation of NVFP4 (and of per-tensor FP8 paired with another format) must apply
the operands' fp32 divisors after the GEMM. They live on the device (computed from an amax
by a kernel), and torch passes device-side scales to cuBLAS only for fp8 operands
(``torch._scaled_mm``). Without that, the GEMM writes an fp32 result and a second kernel
scales it to bf16: 4 more bytes written and 6 more moved per output element, about a tenth
of an NVFP4 Linear step at 16384 tokens. cuBLASLt reads ``alpha`` through a device pointer
(``CUBLASLT_POINTER_MODE_DEVICE``) and applies it in its fp32 epilogue::

    D = RN_out(alpha * (A @ B^T)),   alpha = RN32(RN64(1 / (div_a * div_b)))

``alpha`` is the fp64 reciprocal of the exact fp64 product ``div_a * div_b``, rounded to
fp32 (so within one fp32 ulp of ``1 / (div_a * div_b)``), computed on the device by one
tiny kernel that also writes the zero ``beta`` beside it; it is clamped to the fp32 maximum
so that a zero row times an unrepresentable alpha stays 0 (out of range only for amax
products above ~1e45).

The library is the libcublasLt that torch itself loaded (same process, same version). Plans
(descriptors, the heuristic's algorithm) are kept per shape, strides, alignment and dtypes
(least recently used dropped past :data:`MAX_PLANS`); each device gets one handle, each
stream a 32 MiB workspace. Under CUDA graph capture no workspace is used (algorithms that
need none), so a captured GEMM shares no memory with eager ones. Where no library or no
algorithm is found, :func:`mm_scaled` returns None and the caller keeps its fp32-output path
(same values up to fp32 rounding).

Two cuBLASLt features are kept out on purpose, because they round differently from the
definition above: its bias epilogue (with a bf16 output it was measured more than one bf16
ulp away from adding the bias in fp32 and rounding once; H200, CUDA 13), so a GEMM with a bias
keeps the fp32-output path; and split-K reductions through the output type (bf16 partial
sums), excluded by the reduction-scheme mask (fp32 partials in the workspace stay allowed).
"""

from __future__ import annotations

import collections
import ctypes
import glob
import os
import threading

import torch

from ..kernels import FlagOff

#: Off inside :class:`disabled` (benchmarks' A/B against the fp32-output path).
_enabled = True

# ---- cuBLASLt constants (cublasLt.h / library_types.h) ------------------------------------
_CUBLAS_COMPUTE_32F = 68
_CUDA_TYPES = {torch.float32: 0, torch.bfloat16: 14}  # cuBLASLt: bf16 A/B give bf16/fp32 D
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB = 2, 3, 4
_POINTER_MODE_DEVICE = 1
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE, _PREF_REDUCTION_MASK = 1, 3
_REDUCTION_COMPUTE_TYPE = 2  # split-K partial sums in fp32 (the compute type) only
_PREF_MIN_ALIGN = {"a": 5, "b": 6, "c": 7, "d": 8}

WORKSPACE_BYTES = 32 << 20

#: Plans kept (least recently used dropped first): a workload with many token counts makes
#: a plan per shape, each holding four cuBLASLt descriptors.
MAX_PLANS = 256


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _library_path() -> str | None:
    """Path of the libcublasLt loaded in this process (torch's), else one beside torch."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS(Lt) if it has not yet
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "**", "libcublasLt.so*"), recursive=True))
        if hits:
            return hits[0]
    return None


def _bind(lib):
    vp, sz, i32, u64, i64 = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64,
                             ctypes.c_int64)
    pvp = ctypes.POINTER(vp)
    sigs = {
        "cublasLtCreate": [pvp],
        "cublasLtMatmulDescCreate": [pvp, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [pvp, i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [pvp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32,
                                           ctypes.POINTER(_Heuristic), ctypes.POINTER(i32)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
    lib.cublasLtGetStatusString.argtypes, lib.cublasLtGetStatusString.restype = (
        [i32], ctypes.c_char_p)
    return lib


class _State:
    lib = None
    tried = False
    lock = threading.Lock()
    handles: dict = {}       # device index -> cublasLt handle
    workspaces: dict = {}    # (device index, stream) -> workspace tensor
    plans = collections.OrderedDict()  # plan key -> _Plan or None (no algorithm), LRU


def _lib():
    if not _State.tried:
        with _State.lock:
            if not _State.tried:
                path = _library_path()
                try:
                    _State.lib = _bind(ctypes.CDLL(path)) if path else None
                except (OSError, AttributeError):
                    _State.lib = None
                _State.tried = True
    return _State.lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether cuBLASLt could be loaded (CUDA only) and is not :class:`disabled`. A compiled
    graph reads the answer as a constant of its trace (loading the library is no graph
    op), so a graph traced outside :class:`disabled` keeps cuBLASLt inside it."""
    return _enabled and _lib() is not None


class disabled(FlagOff):
    """Context manager: the bf16 emulation writes fp32 and scales it in a second kernel,
    without cuBLASLt (for A/B comparisons)."""

    _module, _flag = __name__, "_enabled"


def _check(status: int, what: str):
    if status != 0:
        msg = _State.lib.cublasLtGetStatusString(status)
        raise RuntimeError(f"cuBLASLt {what} failed: status {status} "
                           f"({msg.decode() if msg else 'unknown'})")


def _handle(idx: int):
    h = _State.handles.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = ctypes.c_void_p()
            _check(_State.lib.cublasLtCreate(ctypes.byref(h)), "create")
        _State.handles[idx] = h
    return h


def _workspace(device: torch.device, idx: int, stream: int) -> torch.Tensor | None:
    """This stream's workspace (two GEMMs running at once must not share one); None under
    graph capture, where a cached eager workspace would be shared with the replays."""
    if torch.cuda.is_current_stream_capturing():
        return None
    ws = _State.workspaces.get((idx, stream))
    if ws is None:
        ws = _State.workspaces[(idx, stream)] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                            device=device)
    return ws


def _set(setter, obj, attr: int, value, ctype):
    v = ctype(value)
    _check(setter(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), f"attribute {attr}")


def _alignment(ptr: int, ld_bytes: int) -> int:
    """Largest power of two (<= 256) dividing the base address and the row pitch."""
    bits = ptr | ld_bytes | 256
    return bits & -bits


class _Plan:
    """Descriptors and algorithm for one GEMM signature (see :func:`_plan_locked`)."""

    def __init__(self, handle, m, n, k, lda, ldb, in_type, out_type, aligns, ws_bytes):
        lib = _State.lib
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F,
                                            _CUDA_TYPES[torch.float32]), "desc")
        sd = lib.cublasLtMatmulDescSetAttribute
        _set(sd, self.desc, _DESC_POINTER_MODE, _POINTER_MODE_DEVICE, ctypes.c_int32)
        _set(sd, self.desc, _DESC_TRANSA, _OP_T, ctypes.c_int32)
        _set(sd, self.desc, _DESC_TRANSB, _OP_N, ctypes.c_int32)
        # row-major out (m, n) = a (m, k) @ b (n, k)^T is column-major out^T (n, m):
        # cuBLAS A = b (k x n, ld ldb) transposed, B = a (k x m, ld lda), D (n x m, ld n:
        # out is contiguous)
        self.layouts = []
        for rows, cols, ld, t in ((k, n, ldb, in_type), (k, m, lda, in_type),
                                  (n, m, n, out_type)):
            lay = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _CUDA_TYPES[t], rows, cols,
                                                  ld), "layout")
            self.layouts.append(lay)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        sp = lib.cublasLtMatmulPreferenceSetAttribute
        _set(sp, pref, _PREF_MAX_WORKSPACE, ws_bytes, ctypes.c_uint64)
        _set(sp, pref, _PREF_REDUCTION_MASK, _REDUCTION_COMPUTE_TYPE, ctypes.c_uint32)
        for key, align in zip("abcd", aligns):
            _set(sp, pref, _PREF_MIN_ALIGN[key], align, ctypes.c_uint32)
        self.heuristic = _Heuristic()
        count = ctypes.c_int(0)
        la, lb, ld_ = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, la, lb, ld_, ld_, pref, 1,
                                                    ctypes.byref(self.heuristic),
                                                    ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        self.ok = status == 0 and count.value > 0 and self.heuristic.state == 0

    def destroy(self):
        """Frees the descriptors (a GEMM already queued with them has copied what it needs:
        cuBLASLt reads descriptors on the host at launch)."""
        lib = _State.lib
        for lay in self.layouts:
            lib.cublasLtMatrixLayoutDestroy(lay)
        lib.cublasLtMatmulDescDestroy(self.desc)
        self.layouts = []


def _plan_locked(handle, key) -> _Plan | None:
    """The cached plan of ``key`` (built on a miss); call with ``_State.lock`` held, and
    launch before releasing it (an eviction frees the descriptors)."""
    if key in _State.plans:
        _State.plans.move_to_end(key)
        return _State.plans[key]
    plan = _Plan(handle, *key[1:])
    if not plan.ok:
        plan.destroy()
        plan = None
    _State.plans[key] = plan
    while len(_State.plans) > MAX_PLANS:
        old = _State.plans.popitem(last=False)[1]
        if old is not None:
            old.destroy()
    return plan


def shape_ok(am: torch.Tensor, bm: torch.Tensor, out_dtype: torch.dtype,
             strides: bool = True) -> bool:
    """What can be decided without data pointers (so also under tracing): dtypes, shapes
    and, unless ``strides`` is False, :func:`strides_ok`."""
    if not available() or am.dtype != torch.bfloat16 or bm.dtype != torch.bfloat16:
        return False
    if out_dtype not in _CUDA_TYPES or am.dim() != 2 or bm.dim() != 2:
        return False
    m, k = am.shape
    n = bm.shape[0]
    if min(m, n, k) == 0 or bm.shape[1] != k or k % 8:
        return False
    return not strides or strides_ok(am, bm)


def strides_ok(am: torch.Tensor, bm: torch.Tensor) -> bool:
    """Rows contiguous, not overlapping, and a 16-byte row pitch."""
    k = am.shape[1]
    if am.stride(1) != 1 or bm.stride(1) != 1:
        return False
    if am.stride(0) < k or bm.stride(0) < k:  # overlapping rows (expanded views)
        return False
    return am.stride(0) % 8 == 0 and bm.stride(0) % 8 == 0


def mm_scaled(am: torch.Tensor, bm: torch.Tensor, alpha_beta: torch.Tensor,
              out_dtype: torch.dtype, out: torch.Tensor | None = None,
              workspace: torch.Tensor | None = None) -> torch.Tensor | None:
    """``alpha * (am @ bm.T)`` rounded once to ``out_dtype``, with ``alpha_beta`` the (2,)
    fp32 device tensor ``[alpha, 0.0]`` (alpha and cuBLAS's beta); None when cuBLASLt has
    no algorithm for these operands (the caller then takes another path). ``shape_ok`` must
    hold, and the current device must be the operands'. ``out``: a contiguous (M, N)
    tensor of ``out_dtype`` to write to. ``workspace``: ``WORKSPACE_BYTES`` of the caller's
    (a compiled graph's), else this stream's own."""
    lib = _lib()  # loaded here too: a caller need not have asked ``available()`` first
    if lib is None:
        return None
    m, k = am.shape
    n = bm.shape[0]
    dev = am.device
    idx = dev.index
    stream = torch._C._cuda_getCurrentRawStream(idx)
    ws = _workspace(dev, idx, stream) if workspace is None else workspace
    ws_bytes = 0 if ws is None else WORKSPACE_BYTES
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=dev)
    elif tuple(out.shape) != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"mm_scaled: out must be a contiguous ({m}, {n}) {out_dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    isz, osz = am.element_size(), out.element_size()
    align_out = _alignment(out.data_ptr(), n * osz)   # C and D are the same buffer
    aligns = (_alignment(bm.data_ptr(), bm.stride(0) * isz),
              _alignment(am.data_ptr(), am.stride(0) * isz), align_out, align_out)
    key = (idx, m, n, k, am.stride(0), bm.stride(0), am.dtype, out_dtype, aligns, ws_bytes)
    alpha = alpha_beta.data_ptr()
    with _State.lock:
        handle = _handle(idx)
        plan = _plan_locked(handle, key)
        if plan is None:
            return None
        la, lb, ld_ = plan.layouts
        _check(lib.cublasLtMatmul(handle, plan.desc, alpha, bm.data_ptr(), la, am.data_ptr(),
                                  lb, alpha + 4, out.data_ptr(), ld_, out.data_ptr(), ld_,
                                  ctypes.byref(plan.heuristic.algo),
                                  None if ws is None else ws.data_ptr(), ws_bytes, stream),
               "matmul")
    return out
