"""Launcher of the fused AdamW kernel (:mod:`.triton_kernels`): one launch steps every
parameter of a batch (``adamw._step_batch``: one device, dtype and state layout).

The optimizer step is not traced (under ``torch.compile`` the step runs the reference's
torch ops), so the launcher is a plain function: it reads tensor addresses into a table,
which a traced graph could not hold.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import use_kernels
from ..kernels.launch import launch

#: int64 fields per tensor (``triton_kernels.FIELDS``)
FIELDS = 12
#: 128-element blocks a program
BLOCKS = 8
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# FMA contraction off: only the kernel's explicit fmas fuse, as in torch's CUDA kernels
_LAUNCH_OPTS = {"enable_fp_fusion": False, "num_warps": 4}


def _kernels():
    from . import triton_kernels
    return triton_kernels


def takes(params, grads, states) -> bool:
    """Whether the kernel can step these local tensors: CUDA with Triton, kernels enabled,
    nothing traced, and every tensor contiguous with the gradient in its parameter's
    dtype (anything else steps through the reference)."""
    if not params or not use_kernels(params[0]) or torch.compiler.is_compiling():
        return False
    for p, g, st in zip(params, grads, states):
        if g.dtype != p.dtype or not (p.is_contiguous() and g.is_contiguous()):
            return False
        if not all(v.is_contiguous() for k, v in st.items() if k != "step"):
            return False
    return True


def _moment(st: dict, name: str) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(storage kind, stored values, block scales or None) of moment ``name``: FP8 keeps
    the second moment's square root (``adamw._init_state``)."""
    stored = name + "_root" if name + "_root" in st else name
    scales = st.get(stored + "_scale")
    values = st[stored]
    return (_KINDS[torch.float8_e4m3fn] if scales is not None else _KINDS[values.dtype],
            values, scales)


@functools.lru_cache(maxsize=64)
def _program_table(device: torch.device, blocks: tuple[int, ...]) -> torch.Tensor:
    """(tensor, first block) of every program, int32, on ``device``; ``blocks``: each
    tensor's count of 128-element blocks."""
    counts = torch.tensor([-(-b // BLOCKS) for b in blocks], dtype=torch.int64)
    tensor = torch.repeat_interleave(torch.arange(len(blocks)), counts)
    starts = torch.cumsum(counts, 0) - counts
    first = (torch.arange(int(counts.sum())) - starts[tensor]) * BLOCKS
    return torch.stack([tensor, first], 1).to(torch.int32).to(device)


def adamw_step(params: list, grads: list, states: list, offsets: list, stream_ids: list,
               group: dict, step: int, base: int, fp8_rows: bool) -> None:
    """One AdamW step of local tensors ``params`` (their ``grads``, state dicts and element
    offsets), all at ``step``. ``stream_ids``: each parameter's first random-stream id (its
    exp_avg's; exp_avg_sq's and the weight's follow), whose keys the kernel derives from
    ``base`` (``rounding.stream_base``); ``fp8_rows``: a moment is FP8, whose blocks run
    along each row."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    first = states[0]
    m_kind, v_kind = _moment(first, "exp_avg")[0], _moment(first, "exp_avg_sq")[0]
    master = "master" in first
    rows, blocks = [], []
    aligned = True
    for p, g, st, off, sid in zip(params, grads, states, offsets, stream_ids):
        n = p.numel()
        if n == 0:
            continue
        k = p.shape[-1] if fp8_rows and p.dim() >= 2 else n
        _, m, m_scale = _moment(st, "exp_avg")
        _, v, v_scale = _moment(st, "exp_avg_sq")
        ptrs = [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                st["master"].data_ptr() if master else 0,
                m_scale.data_ptr() if m_scale is not None else 0,
                v_scale.data_ptr() if v_scale is not None else 0]
        aligned = aligned and k % 16 == 0 and all(a % 16 == 0 for a in ptrs)
        per_row = -(-k // 128)
        count = n // k * per_row
        rows.extend(ptrs + [k, count, off, sid, base])
        blocks.append(count)
    if not blocks:
        return
    device = params[0].device
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
    table = table.to(device, non_blocking=True)
    programs = _program_table(device, tuple(blocks))
    w1 = 1 - beta1
    launch(_kernels().adamw_kernel, (programs.shape[0],), table, programs,
           1 - lr * group["weight_decay"], w1, beta2, 1 - beta2, eps,
           (1 - beta2 ** step) ** 0.5, -(lr / (1 - beta1 ** step)),
           P_TYPE=_tl_dtype(params[0].dtype), MASTER=master,
           STOCHASTIC_W=group["master_weights"] == "stochastic" and not master
           and params[0].dtype == torch.bfloat16,
           M_KIND=m_kind, V_KIND=v_kind, MAXIMIZE=bool(group["maximize"]),
           SMALL_W1=abs(w1) < 0.5, ALIGNED=aligned, BLOCKS=BLOCKS, **_LAUNCH_OPTS)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]
