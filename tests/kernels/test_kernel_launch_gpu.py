"""``lowprec.kernels.launch.launch``: the compiled kernel it reuses is the one Triton would
pick (GPU only). Each case launches the same kernel with arguments Triton specializes on
differently (16-byte aligned or not, an integer equal to 1, another dtype, another
constexpr) after a cached launch, and checks every result against torch."""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_ONLY

import lowprec.kernels
from lowprec.kernels import launch as launch_mod

pytestmark = GPU_ONLY

if lowprec.kernels.triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _axpb_kernel(x_ptr, y_ptr, n, stride, a, b, BLOCK: tl.constexpr, NEG: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs * stride, mask=mask).to(tl.float32) * a + b
        if NEG:
            v = -v
        tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=mask)


def _run(x, n, stride, a, b, block=128, neg=False, out_dtype=torch.float32):
    y = torch.empty(n, device="cuda", dtype=out_dtype)
    launch_mod.launch(_axpb_kernel, (triton.cdiv(n, block),), x, y, n, stride, a, b,
                      BLOCK=block, NEG=neg, enable_fp_fusion=False)  # x * a + b as torch does
    ref = (x[::stride][:n].float() * a + b) * (-1 if neg else 1)
    return y, ref.to(out_dtype)


@pytest.fixture
def jit_runs(monkeypatch):
    """The launches of ``_axpb_kernel`` that went through ``JITFunction.run`` from here on
    (cache misses), one list entry each."""
    runs = []
    jit_run = _axpb_kernel.run
    monkeypatch.setattr(_axpb_kernel, "run", lambda *a, **k: runs.append(1) or jit_run(*a, **k))
    return runs


def test_cached_launches_match_each_specialization(jit_runs):
    launch_mod._compiled.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096, device="cuda", generator=gen)
    cases = [
        (base, 1000, 1, 2.0, 0.5, {}),              # first: compiles, cached
        (base, 1000, 1, 3.0, -1.0, {}),             # same specialization: cache hit
        (base[1:], 999, 1, 2.0, 0.5, {}),           # pointer not 16-byte aligned
        (base, 1000, 2, 2.0, 0.5, {}),              # stride 2 (1 is a constexpr to Triton)
        (base, 1024, 1, 2.0, 0.5, {}),              # n divisible by 16
        (base, 1, 1, 2.0, 0.5, {}),                 # n == 1
        (base.to(torch.bfloat16), 1000, 1, 2.0, 0.5, {}),   # another input dtype
        (base, 1000, 1, 2.0, 0.5, {"neg": True}),   # another constexpr
        (base, 1000, 1, 2.0, 0.5, {"block": 256}),
        (base, 1000, 1, 2.0, 0.5, {"out_dtype": torch.bfloat16}),
        (base[1:], 999, 1, 2.0, 0.5, {}),           # back to an earlier specialization
    ]
    for x, n, stride, a, b, kw in cases:
        y, ref = _run(x, n, stride, a, b, **kw)
        torch.cuda.synchronize()
        assert torch.equal(y, ref), (x.dtype, x.data_ptr() % 16, n, stride, kw)
    keys = [k for k in launch_mod._compiled if k[0] == id(_axpb_kernel)]
    # one entry per distinct specialization, each made by the one launch that missed; the
    # repeated ones (cases 2 and 11) were launched from the cache
    assert len(keys) == 9 and len(jit_runs) == 9, (len(keys), len(jit_runs))


def test_launch_hooks_take_the_ordinary_path():
    from triton import knobs
    x = torch.randn(256, device="cuda")
    _run(x, 200, 1, 1.0, 0.0)  # cached
    seen = []

    def hook(metadata):
        seen.append(metadata)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        y, ref = _run(x, 200, 1, 1.0, 0.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert torch.equal(y, ref) and len(seen) == 1


def test_slow_launches_skip_the_cache():
    x = torch.randn(512, device="cuda")
    _run(x, 500, 1, 1.0, 0.0)
    before = dict(launch_mod._compiled)
    with launch_mod.slow_launches():
        y, ref = _run(x, 500, 1, 1.5, 2.0, block=64)  # a new specialization: not recorded
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    assert launch_mod._compiled == before


def test_launch_on_another_stream_and_under_capture(jit_runs):
    x = torch.randn(2048, device="cuda")
    _run(x, 2000, 1, 1.0, 0.0)  # cached (or a miss, counted before the check below)
    misses = len(jit_runs)  # from here on every launch must come from the cache
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y, ref = _run(x, 2000, 1, 4.0, 1.0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    y = torch.empty(2000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_mod.launch(_axpb_kernel, (16,), x, y, 2000, 1, 4.0, 1.0, BLOCK=128, NEG=False,
                          enable_fp_fusion=False)
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x[:2000] * 4.0 + 1.0)
    assert len(jit_runs) == misses, "a cached specialization went through JITFunction.run"


def test_debug_mode_is_part_of_the_key():
    from triton import knobs
    x = torch.randn(256, device="cuda")
    _run(x, 200, 1, 1.0, 0.0)
    before = len(launch_mod._compiled)
    saved = knobs.runtime.debug
    knobs.runtime.debug = True
    try:
        y, ref = _run(x, 200, 1, 1.0, 0.0)  # the debug build: compiled anew, not the cached one
    finally:
        knobs.runtime.debug = saved
    torch.cuda.synchronize()
    assert torch.equal(y, ref) and len(launch_mod._compiled) == before + 1


def test_bound_launch_reruns_the_compiled_kernel_with_new_tensors():
    """``bind`` after a launch: the bound launch writes what ``kernel[grid]`` writes for
    new tensors at its leading positions; an unlaunched specialization binds nothing."""
    n = 1000
    x = torch.randn(n, device="cuda")
    y, ref = _run(x, n, 1, 2.0, 0.5)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    grid = (triton.cdiv(n, 128),)
    bound = launch_mod.bind(_axpb_kernel, grid, 2, x, y, n, 1, 2.0, 0.5, BLOCK=128, NEG=False,
                            enable_fp_fusion=False)
    assert bound is not None
    for _ in range(3):
        x2 = torch.randn(n, device="cuda")
        y2 = torch.full((n,), float("nan"), device="cuda")
        bound(x2, y2)
        torch.testing.assert_close(y2, x2 * 2.0 + 0.5, rtol=0, atol=0)
    # BLOCK=8 never ran through launch(): nothing compiled to bind
    assert launch_mod.bind(_axpb_kernel, (triton.cdiv(n, 8),), 2, x, y, n, 1, 2.0, 0.5,
                           BLOCK=8, NEG=False, enable_fp_fusion=False) is None


def test_bound_calls_place_each_calls_tensors(jit_runs):
    """``BoundCalls``: a kind's first call launches through ``launch`` (compiling), its
    second binds, later ones run the bound launch with that call's tensors in their places
    (here not the leading ones, one passed by name); a call with a tensor off 16-byte
    alignment, or inside ``slow_launches``, takes the usual path; every result is torch's."""
    calls_made = launch_mod.BoundCalls()
    n, block = 1000, 64

    def step(x, y, a=2.0):
        def calls():
            # y by name: a named tensor argument is placed too
            return [(_axpb_kernel, (triton.cdiv(n, block),), (x,),
                     dict(y_ptr=y, n=n, stride=1, a=a, b=0.5, BLOCK=block, NEG=True,
                          enable_fp_fusion=False))]
        calls_made.run(("axpb", n, a), (y, None, x), calls)  # y first: places, not order
        torch.testing.assert_close(y, -(x * a + 0.5), rtol=0, atol=0)

    base = torch.randn(4 * n, device="cuda")
    for i in range(4):
        step(torch.randn(n, device="cuda"), torch.full((n,), float("nan"), device="cuda"))
    first = len(jit_runs)
    step(torch.randn(n, device="cuda"), torch.full((n,), float("nan"), device="cuda"))
    assert len(jit_runs) == first  # bound: no JITFunction.run
    step(base[1:n + 1], torch.full((n,), float("nan"), device="cuda"))  # unaligned x
    with launch_mod.slow_launches():
        step(torch.randn(n, device="cuda"), torch.full((n,), float("nan"), device="cuda"))
    step(torch.randn(n, device="cuda"), torch.full((n,), float("nan"), device="cuda"), a=3.0)


def test_bound_calls_keep_no_tensor_alive():
    """The binding call's tensors are not held by the bound launches (they would leak one
    set of outputs a kind, and CUDA graph trees refuse untracked live allocations)."""
    import gc
    import weakref
    calls_made = launch_mod.BoundCalls()
    n = 512

    def step():
        x, y = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        calls_made.run("k", (x, y), lambda: [(_axpb_kernel, (triton.cdiv(n, 128),),
                                               (x, y, n, 1, 2.0, 0.5),
                                               dict(BLOCK=128, NEG=False,
                                                    enable_fp_fusion=False))])
        torch.testing.assert_close(y, x * 2.0 + 0.5, rtol=0, atol=0)
        return weakref.ref(x), weakref.ref(y)

    refs = [step() for _ in range(3)]  # launched, bound, run bound
    gc.collect()
    assert all(r() is None for pair in refs for r in pair)
