"""The fused AdamW kernel equals the reference step on the same GPU bit for bit: every
state precision, parameter dtype and master-weight mode, unaligned shapes, maximize, a
large beta1, parameters whose step counts differ, and a resume."""

from __future__ import annotations

import itertools

import pytest
import torch

from lowprec.kernels import reference_only, triton_available
from lowprec.optim import AdamW, launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(),
                                reason="needs CUDA and Triton")

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
#: unaligned rows (K=17, 129), a row of whole blocks, a vector, a 3-D tensor, a scalar
SHAPES = [(33, 17), (5, 129), (64, 256), (300,), (3, 4, 48), ()]


def _params(dtype, shapes=SHAPES, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").to(dtype))
            for s in shapes]


def _grads(params, step, skip=None):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    for i, p in enumerate(params):
        # a spread of magnitudes, so FP8 blocks get different scales
        scale = 10.0 ** (i % 4 - 3)
        p.grad = None if i == skip else (torch.randn(p.shape, generator=g, device="cuda")
                                         * scale).to(p.dtype)


def _run(kernel: bool, steps: int = 4, dtype=BF16, skip_first=False, **kw):
    params = _params(dtype)
    opt = AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], lr=1e-2,
                weight_decay=0.1, **kw)
    calls = []
    real = launch.adamw_step

    def counted(*a, **k):
        calls.append(1)
        real(*a, **k)
    launch.adamw_step = counted
    try:
        for step in range(steps):
            _grads(params, step, skip=1 if skip_first and step == 0 else None)
            if kernel:
                opt.step()
            else:
                with reference_only():
                    opt.step()
    finally:
        launch.adamw_step = real
    assert bool(calls) == kernel
    return params, opt


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert torch.equal(_bytes(p), _bytes(q)), f"parameter {i}"
        sa, sb = oa.state[p], ob.state[q]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert torch.equal(_bytes(sa[k]), _bytes(sb[k])), f"parameter {i}: {k}"


COMBOS = list(itertools.product([torch.float32, BF16, FP8], [torch.float32, BF16, FP8],
                                ["fp32", "stochastic", None]))


@pytest.mark.parametrize("m_dtype,v_dtype,master", COMBOS)
def test_kernel_is_reference(m_dtype, v_dtype, master):
    kw = dict(exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, master_weights=master)
    _assert_same(_run(True, **kw), _run(False, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_parameter_dtypes(dtype):
    kw = dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=BF16, master_weights="fp32")
    _assert_same(_run(True, dtype=dtype, **kw), _run(False, dtype=dtype, **kw))


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)])
def test_maximize_betas_and_lagging_steps(betas):
    """maximize; beta1 < 0.5 takes lerp's other formula; a parameter that skips the first
    step is one step behind the others (two launches a step)."""
    kw = dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8, master_weights="stochastic",
              maximize=True, betas=betas, seed=7)
    _assert_same(_run(True, skip_first=True, **kw), _run(False, skip_first=True, **kw))


def test_resume_through_the_kernel():
    kw = dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8, master_weights="stochastic")
    whole = _run(True, steps=6, **kw)
    params, opt = _run(True, steps=3, **kw)
    saved = opt.state_dict()
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = AdamW([{"params": params2[:3]}, {"params": params2[3:], "lr": 3e-3}], lr=1e-2,
                 weight_decay=0.1, **kw)
    opt2.load_state_dict(saved)
    for step in range(3, 6):
        _grads(params2, step)
        opt2.step()
    _assert_same(whole, (params2, opt2))
