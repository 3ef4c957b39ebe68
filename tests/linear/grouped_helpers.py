"""What the grouped-linear tests share: a forward+backward of a grouped function and the
per-expert reference (one quantized Linear per group)."""

from __future__ import annotations

import torch

from lowprec.linear.function import quantized_linear


def run_grads(fn, x, w, dy):
    """(y, dX, dW) of ``fn(x, w)`` backpropagated from ``dy``."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def per_expert(quantizers, sizes):
    """``fn(x, w)``: each group of rows through its own quantized Linear."""
    def fn(x, w):
        return torch.cat([quantized_linear(xg, w[g], quantizers=quantizers)
                          for g, xg in enumerate(torch.split(x, list(sizes)))])
    return fn


def assert_grouped_equals_per_expert(x, w, dy, sizes, quantizers):
    """grouped_linear's output and gradients equal the per-expert Linears' bit for bit
    (the sizes given as a tensor on x's device)."""
    from lowprec.linear.grouped import grouped_linear
    sizes_t = torch.tensor(sizes, device=x.device)
    got = run_grads(lambda a, b: grouped_linear(a, b, sizes_t, quantizers=quantizers), x, w, dy)
    ref = run_grads(per_expert(quantizers, sizes), x, w, dy)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def grouped_data(sizes, k, n, *, w_scale=0.1, seed=0, device="cpu"):
    """bf16 (x, w, dy) for groups of ``sizes`` rows: x (M, K), w (G, N, K) times
    ``w_scale``, dy (M, N), from a seeded CPU generator, then on ``device``."""
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(len(sizes), n, k, generator=g) * w_scale).bfloat16()
    dy = torch.randn(m, n, generator=g).bfloat16()
    return x.to(device), w.to(device), dy.to(device)


def assert_grouped_never_syncs(x, w, dy, sizes, quantizers):
    """A warm-up forward+backward of grouped_linear (kernels compile), then one under
    ``torch.cuda.set_sync_debug_mode("error")``: nothing waits for the host."""
    from lowprec.linear.grouped import grouped_linear
    x.requires_grad_(True)
    w.requires_grad_(True)
    grouped_linear(x, w, sizes, quantizers=quantizers).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_linear(x, w, sizes, quantizers=quantizers).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
