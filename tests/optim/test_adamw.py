"""lowprec.optim.AdamW: torch's AdamW bit for bit with fp32 state, bf16 state kept
unbiased by stochastic rounding, resumable bit for bit, bad settings refused."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

import lowprec
from lowprec.optim import AdamW

BF16 = torch.bfloat16


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (5,), (8, 4, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, skip=None):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if i == skip else (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)


def _groups(params, **extra):
    return [{"params": params[:2], **extra}, {"params": params[2:], "lr": 3e-3,
                                               "weight_decay": 0.0}]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_state_is_torch_adamw(foreach, maximize):
    """Parameter groups, weight decay, maximize, and a parameter without a gradient on
    some steps (its step count lags): every value equals torch.optim.AdamW's."""
    a, b = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, maximize=maximize)
    ours = AdamW(_groups(a), **kw)
    theirs = torch.optim.AdamW(_groups(b), foreach=foreach, **kw)
    for step in range(6):
        for ps in (a, b):
            _grads(ps, step, skip=1 if step % 3 == 0 else None)
        ours.step()
        theirs.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q), step
    for p, q in zip(a, b):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[p][k], theirs.state[q][k])


def test_bf16_params_with_fp32_masters_follow_fp32_training():
    """bf16 parameters with fp32 masters: the masters are torch's fp32 AdamW trajectory
    (same gradients), and each parameter is its master rounded to nearest."""
    a = _params(BF16)
    b = [torch.nn.Parameter(p.detach().float()) for p in a]
    ours = AdamW(a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        _grads(a, step)
        for p, q in zip(a, b):
            q.grad = p.grad.float()
        ours.step()
        theirs.step()
    for p, q in zip(a, b):
        assert torch.equal(ours.state[p]["master"], q)
        assert torch.equal(p, q.to(BF16))


FP8 = torch.float8_e4m3fn
COMBOS = list(itertools.product([torch.float32, BF16, FP8], [torch.float32, BF16, FP8],
                                ["fp32", "stochastic", None]))


@pytest.mark.parametrize("m_dtype,v_dtype,master", COMBOS)
def test_resume_is_bit_identical(m_dtype, v_dtype, master):
    """8 steps in one run equal 4 steps, a state_dict round trip into a new optimizer
    (through torch.save) and 4 more: parameters and every state tensor, dtypes kept."""
    kw = dict(lr=1e-2, weight_decay=0.05, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
              master_weights=master, seed=11)
    a = _params(BF16)
    opt = AdamW(_groups(a), **kw)
    for step in range(8):
        _grads(a, step)
        opt.step()
    b = _params(BF16)
    opt_b = AdamW(_groups(b), **kw)
    for step in range(4):
        _grads(b, step)
        opt_b.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in b], "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    c = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt_c = AdamW(_groups(c), **kw)
    opt_c.load_state_dict(saved["opt"])
    for step in range(4, 8):
        _grads(c, step)
        opt_c.step()
    for p, q in zip(a, c):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert v.dtype == opt_c.state[q][k].dtype and torch.equal(v, opt_c.state[q][k]), k
    assert opt.state[a[0]]["exp_avg"].dtype == m_dtype
    if v_dtype == FP8:  # kept as its square root; vectors keep bf16 state
        assert opt.state[a[0]]["exp_avg_sq_root"].dtype == FP8
        assert opt.state[a[1]]["exp_avg_sq"].dtype == BF16
    assert ("master" in opt.state[a[0]]) == (master == "fp32")


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_low_precision_second_moment_decays_on_average(dtype):
    """Round to nearest would keep a bf16 exp_avg_sq where it is: a 0.1% decay is less
    than half a bf16 unit (and far less than an FP8 one). Stochastic rounding lets it
    decay as in fp32, on average."""
    p = torch.nn.Parameter(torch.zeros(64, 256))
    opt = AdamW([p], lr=0.0, weight_decay=0.0, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    p.grad = torch.ones_like(p)
    opt.step()
    p.grad = torch.zeros_like(p)
    for _ in range(300):
        opt.step()
    want = (1 - 0.999) * 0.999 ** 300
    st = opt.state[p]
    if dtype == FP8:
        from lowprec.optim.fp8_state import decode
        got = decode(st["exp_avg_sq_root"], st["exp_avg_sq_root_scale"]).pow(2).mean().item()
    else:
        got = st["exp_avg_sq"].float().mean().item()
    assert abs(got / want - 1) < (0.01 if dtype == BF16 else 0.05)
    stuck = torch.tensor(1 - 0.999).to(BF16)
    for _ in range(300):  # what round to nearest does with the same decay
        stuck = (stuck.float() * 0.999).to(BF16)
    assert abs(stuck.item() / want - 1) > 0.2


def test_stochastic_bf16_weights_take_small_updates():
    """Updates far below half a bf16 unit: lost under round to nearest, accumulated on
    average with master_weights='stochastic'."""
    n = 1 << 14
    lr = 2.0 ** -12  # an Adam step moves each weight by about lr: 1/32 of a unit at 1.0
    runs = {}
    for master in ("stochastic", None):
        p = torch.nn.Parameter(torch.ones(n, dtype=BF16))
        opt = AdamW([p], lr=lr, weight_decay=0.0, master_weights=master)
        for _ in range(64):
            p.grad = -torch.ones_like(p)
            opt.step()
        runs[master] = p.float().mean().item()
    assert runs[None] == 1.0
    assert abs(runs["stochastic"] - (1 + 64 * lr)) < 64 * lr * 0.05


def test_state_bytes_per_parameter():
    p = torch.nn.Parameter(torch.zeros(1000, dtype=BF16))
    p.grad = torch.zeros_like(p)

    def state_bytes(**kw):
        opt = AdamW([p], **kw)
        opt.step()
        return sum(t.numel() * t.element_size() for k, t in opt.state[p].items()
                   if k != "step") / p.numel() + p.element_size()

    assert state_bytes() == 14
    assert state_bytes(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16) == 10
    assert state_bytes(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                       master_weights="stochastic") == 6
    p = torch.nn.Parameter(torch.zeros(64, 1024, dtype=BF16))  # FP8 state: matrices
    p.grad = torch.zeros_like(p)
    assert state_bytes(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8,
                       master_weights="stochastic") == 2 + 2 * (1 + 4 / 128)


def test_bad_settings_are_refused():
    ps = _params()
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(ps, amsgrad=True)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        AdamW(ps, exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):
        AdamW(ps, exp_avg_sq_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="master_weights"):
        AdamW(ps, master_weights="bf16")
    with pytest.raises(ValueError, match="betas"):
        AdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="fp16"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))],
              master_weights="stochastic")
    with pytest.raises(TypeError, match="float64"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with lowprec.quantized_model_init(recipe=lowprec.recipe.Float8CurrentScaling()):
        m = lowprec.Linear(32, 32, name="l")
    with pytest.raises(ValueError, match="stochastic"):
        AdamW(m.parameters(), master_weights="stochastic")
    free = lowprec.Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(
        torch.randn(32, 32))
    with pytest.raises(TypeError, match="quantized_model_init"):
        AdamW([free])
    opt = AdamW(ps[:1])
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})


def test_trains_a_model_with_quantized_gemms():
    """A lowprec model under a recipe trains with bf16 state: the loss goes down."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(lowprec.Linear(64, 64, name="a", params_dtype=BF16),
                                torch.nn.GELU(),
                                lowprec.Linear(64, 64, name="b", params_dtype=BF16))
    opt = AdamW(model.parameters(), lr=3e-3, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                master_weights="stochastic")
    x = torch.randn(256, 64, dtype=BF16)
    target = torch.randn(256, 64, dtype=BF16) * 0.5
    losses = []
    for _ in range(30):
        with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling()):
            loss = (model(x).float() - target.float()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def _quantized_model(seed=0):
    torch.manual_seed(seed)
    with lowprec.quantized_model_init(recipe=lowprec.recipe.Float8CurrentScaling()):
        return torch.nn.Sequential(lowprec.Linear(64, 64, name="a"), torch.nn.GELU(),
                                   lowprec.Linear(64, 32, name="b"))


def _train_quantized(model, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(128, 64, generator=g)
        with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling()):
            loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_quantized_weights_are_stepped_as_the_wrapper_steps_them():
    """quantized_model_init weights: AdamW keeps their fp32 masters itself and re-quantizes
    them in place, as QuantizedWeightOptimizer around it does, bit for bit."""
    a, b = _quantized_model(), _quantized_model()
    ours = AdamW(a.parameters(), lr=1e-2)
    wrapped = lowprec.optim.QuantizedWeightOptimizer(b, AdamW, lr=1e-2)
    la, lb = _train_quantized(a, ours, 4), _train_quantized(b, wrapped, 4)
    assert la == lb and la[-1] < la[0]
    for p, q in zip(a.parameters(), b.parameters()):
        assert type(p) is type(q)
        assert torch.equal(p.dequantize(), q.dequantize()) if isinstance(
            p, lowprec.formats.base.QuantizedTensor) else torch.equal(p, q)


@pytest.mark.parametrize("master", ["fp32", None])
def test_quantized_weights_resume_bit_identically(master):
    kw = dict(lr=1e-2, exp_avg_dtype=FP8, exp_avg_sq_dtype=BF16, master_weights=master)
    whole = _quantized_model()
    opt = AdamW(whole.parameters(), **kw)
    _train_quantized(whole, opt, 5)
    first = _quantized_model()
    opt1 = AdamW(first.parameters(), **kw)
    _train_quantized(first, opt1, 3)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    second = _quantized_model(seed=1)
    second.load_state_dict(saved["model"])
    opt2 = AdamW(second.parameters(), **kw)
    opt2.load_state_dict(saved["optim"])
    _train_quantized(second, opt2, 2, first=3)
    for p, q in zip(whole.parameters(), second.parameters()):
        pv = p.dequantize() if isinstance(p, lowprec.formats.base.QuantizedTensor) else p
        qv = q.dequantize() if isinstance(q, lowprec.formats.base.QuantizedTensor) else q
        assert torch.equal(pv, qv)
