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
