"""Host and GPU cost of one Linear forward+backward three ways: bf16 ``nn.Linear``, lowprec's
eager Function, and the traced plan (``lowprec.linear.traced``) run eagerly with its plan
decided once. Host: many steps on 128 tokens without a sync (the GPU keeps up); GPU:
CUDA events around steps at a large token count. Optional cProfile of each lowprec form.

    python tools/probe_eager_plan.py [--recipes current,mxfp8] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import lowprec
from lowprec.linear import traced
from lowprec.recipe.recipes import Recipe


def host_us(step, n=300):
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[2]


def gpu_ms(step, n=20):
    for _ in range(5):
        step()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        step()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def steps(recipe_name, m, k=2048, n=2048):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    lin = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    recipe = Recipe.from_name(recipe_name)

    def bf16():
        ref(x).backward(dy)

    def eager():
        with lowprec.autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)

    eager()  # a stateful recipe's state exists from the first call on
    with lowprec.autocast(recipe=recipe):
        got = lin.traced_quantizers(x, lin.weight)
        plan = (traced.plan_for(got[0][0], got[1], x, lin.weight, None)
                if not isinstance(got, str) else got)
    if isinstance(plan, str):
        return bf16, eager, None, plan
    qs, mode, delayed = got

    def planned():
        y = traced.traced_linear(qs[0], mode, x, lin.weight, None, delayed, plan=plan)
        y.backward(dy)

    # the planned form's results against eager's
    x.grad = None
    lin.weight.grad = None
    with lowprec.autocast(recipe=recipe):
        y0 = lin(x)
    y0.backward(dy)
    g0 = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.weight.grad = None
    y1 = traced.traced_linear(qs[0], mode, x, lin.weight, None, delayed, plan=plan)
    y1.backward(dy)
    same = (torch.equal(y0, y1) and torch.equal(g0[0], x.grad)
            and torch.equal(g0[1], lin.weight.grad))
    return bf16, eager, planned, f"plan {plan.routes}, bits {'same' if same else 'DIFFER'}"


def profile(fn, label, calls=200, sort="tottime", rows=22, chars=5000):
    """cProfile of ``calls`` calls of ``fn``: the ``rows`` heaviest functions by ``sort``."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats(sort).print_stats(rows)
    print(f"--- cProfile {label} ({calls} calls)\n" + out.getvalue()[-chars:])


def gemm_host():
    """Host microseconds of one GEMM call, 128x2048x2048: torch.mm against torch._scaled_mm."""
    a = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    one1 = torch.ones(1, device="cuda")
    for label, fn in [
            ("mm", lambda: a @ b.t()),
            ("_scaled_mm 0-d scales", lambda: torch._scaled_mm(
                a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
            ("_scaled_mm (1,) scales", lambda: torch._scaled_mm(
                a8, b8.t(), scale_a=one1, scale_b=one1, out_dtype=torch.bfloat16)),
            ("_scaled_mm fp32 out", lambda: torch._scaled_mm(
                a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)),
            ("empty", lambda: torch.empty(128, 2048, device="cuda")),
            ("new_empty u8", lambda: a.new_empty((128, 2048), dtype=torch.uint8))]:
        print(f"  host {label}: {host_us(fn, 1000):.1f} us", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--recipes", default="fp8_current,fp8_block,mxfp8,nvfp4,fp8_row_mxfp8_col,"
                                         "mxfp8_fwd_nvfp4_bwd,fp8_delayed")
    p.add_argument("--profile", default="")
    p.add_argument("--big", type=int, default=16384)
    p.add_argument("--gemm-host", action="store_true")
    p.add_argument("--launch-host", action="store_true")
    a = p.parse_args()
    if a.launch_host:
        launch_host()
        return
    if a.gemm_host:
        gemm_host()
        try:
            floor_current()
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            print(f"floor failed: {type(e).__name__}: {e}", flush=True)
    for name in a.recipes.split(","):
        try:
            bf16, eager, planned, note = steps(name, 128)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        def old_eager(eager=eager):
            with traced.eager_plans_off():
                eager()
        hb, he, ho = host_us(bf16), host_us(eager), host_us(old_eager)
        hp = host_us(planned) if planned else float("nan")
        bf16_l, eager_l, planned_l, _ = steps(name, a.big)
        gb, ge = gpu_ms(bf16_l), gpu_ms(eager_l)
        gp = gpu_ms(planned_l) if planned_l else float("nan")
        print(f"{name}: host us eager Function {ho:.0f} ({ho / hb:.1f}x)")
        print(f"{name}: host us bf16 {hb:.0f} eager {he:.0f} ({he / hb:.1f}x) planned {hp:.0f} "
              f"({hp / hb:.1f}x) | GPU ms @{a.big} bf16 {gb:.3f} eager {ge:.3f} planned "
              f"{gp:.3f} | {note}", flush=True)
        if name in a.profile.split(","):
            profile(eager, f"{name} eager")
            if planned:
                profile(planned, f"{name} planned")


def floor_current(m=128, k=2048, n=2048, big=16384):
    """The floor of an eager current-scaling step: a bare autograd Function over the
    prepared kernel quantizes (raw fields, no tensor subclass) and ``torch._scaled_mm``."""
    from lowprec import Float8CurrentScalingQuantizer

    def make(m):
        qx = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        qw = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
        qg = Float8CurrentScalingQuantizer(torch.float8_e5m2)
        dev = torch.device("cuda", torch.cuda.current_device())
        px = qx._prepared(torch.Size((m, k)), torch.bfloat16, dev, True, True)
        pw = qw._prepared(torch.Size((n, k)), torch.bfloat16, dev, True, True)
        pg = qg._prepared(torch.Size((m, n)), torch.bfloat16, dev, True, True)
        usual = {id(px): (qx, m, k), id(pw): (qw, n, k), id(pg): (qg, m, n)}

        def q(p, t):
            f = p(t)
            if f is None:  # the first calls go the usual way (compile, bind)
                qq = usual[id(p)][0]
                qq.set_usage(rowwise=True, columnwise=True)
                tt = qq.quantize(t)
                return tt.rowwise_data, tt.columnwise_data, tt.decode_scale()
            return f["rowwise_data"], f["columnwise_data"], f["_decode"][2].reshape(())

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):
                xr, xc, xd = q(px, x)
                wr, wc, wd = q(pw, w)
                ctx.save_for_backward(xc, xd, wc, wd)
                return torch._scaled_mm(xr, wr.t(), scale_a=xd, scale_b=wd,
                                        out_dtype=torch.bfloat16)

            @staticmethod
            def backward(ctx, dy):
                xc, xd, wc, wd = ctx.saved_tensors
                gr, gc, gd = q(pg, dy)
                dx = torch._scaled_mm(gr, wc.t(), scale_a=gd, scale_b=wd,
                                      out_dtype=torch.bfloat16)
                dw = torch._scaled_mm(gc, xc.t(), scale_a=gd, scale_b=xd,
                                      out_dtype=torch.bfloat16)
                return dx, dw
        return F

    for rows in (m, big):
        F = make(rows)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

        def step():
            F.apply(x, w).backward(dy)
        if rows == m:
            print(f"floor current: host {host_us(step):.0f} us", flush=True)
        else:
            print(f"floor current: GPU @{rows} {gpu_ms(step):.3f} ms", flush=True)


def launch_host(m=128, k=2048):
    """Host microseconds of a prepared current-scaling quantize and of its pieces."""
    from lowprec import Float8CurrentScalingQuantizer
    from lowprec.formats.float8 import launch as fl
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    for rowwise, columnwise in ((True, False), (True, True)):
        p = q._prepared(torch.Size((m, k)), torch.bfloat16, dev, rowwise, columnwise)
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        for _ in range(3):
            if p(x) is None:
                q.quantize(x)
        print(f"  prepared current quantize row={rowwise} col={columnwise}: "
              f"{host_us(lambda: p(x), 2000):.1f} us; launches {len(p.launches)}", flush=True)
    bound = p.launches
    words = fl.kept_amax_words(q, dev)
    scales = fl._scale_buffer(x)
    row = x.new_empty((m, k), dtype=torch.uint8)
    col = x.new_empty((k, m), dtype=torch.uint8)
    print(f"  amax launch: {host_us(lambda: bound[0](x, words), 2000):.1f} us", flush=True)
    for i, cast in enumerate(bound[1:]):
        print(f"  cast launch {i}: "
              f"{host_us(lambda: cast(x, row, col, words, scales, scales, scales), 2000):.1f} us",
              flush=True)
    print(f"  kept_amax_words: {host_us(lambda: fl.kept_amax_words(q, dev), 2000):.1f} us")
    print(f"  _scale_buffer: {host_us(lambda: fl._scale_buffer(x), 2000):.1f} us")
    def two_empty():
        return (x.new_empty((m, k), dtype=torch.uint8), x.new_empty((k, m), dtype=torch.uint8))
    print(f"  2 x new_empty: {host_us(two_empty, 2000):.1f} us")
    print(f"  torch.cuda.current_device: {host_us(torch.cuda.current_device, 2000):.1f} us")
    print(f"  _cuda_getCurrentRawStream: "
          f"{host_us(lambda: torch._C._cuda_getCurrentRawStream(0), 2000):.1f} us")


if __name__ == "__main__":
    main()
