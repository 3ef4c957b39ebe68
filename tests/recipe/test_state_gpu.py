"""The one-launch delayed-scaling update kernel against the torch update (GPU only).

Both paths start from the same random state (histories with zeros, NaN, Inf and huge and
tiny values) and must leave bit-identical scales, histories and zeroed current amaxes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_ONLY

from lowprec.kernels import reference_only
from lowprec.recipe import state_batch
from lowprec.recipe.recipes import DelayedScaling
from lowprec.recipe.state import DelayedScalingState

pytestmark = GPU_ONLY

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _random_state(recipe, n, gen):
    dtypes = [E4 if i % 2 == 0 else E5 for i in range(n)]
    st = DelayedScalingState(recipe, n, dtypes, torch.device("cuda"))
    h = recipe.amax_history_len
    hist = torch.rand(h, n, generator=gen) * 10.0 ** torch.randint(-40, 38, (h, n), generator=gen)
    special = torch.rand(h, n, generator=gen)
    hist[special < 0.05] = 0.0
    hist[(special > 0.05) & (special < 0.07)] = float("nan")
    hist[(special > 0.07) & (special < 0.08)] = float("inf")
    cur = torch.rand(n, generator=gen) * 10.0 ** torch.randint(-40, 38, (n,), generator=gen)
    cur[torch.rand(n, generator=gen) < 0.2] = 0.0
    st.amax_history.copy_(hist)
    st.amax_current.copy_(cur)
    st.scale.copy_(torch.rand(n, generator=gen) + 0.5)
    st.pending = True
    return st


def _same(a, b):
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.nan_to_num(a, nan=0.0).view(torch.int32),
                       torch.nan_to_num(b, nan=0.0).view(torch.int32))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("hist_len", [1, 2, 16, 1024, 4096])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 33])
@pytest.mark.parametrize("margin", [0, 1, 0.5, 3.7])
def test_update_kernel_matches_torch(algo, hist_len, n, margin):
    recipe = DelayedScaling(margin=margin, amax_history_len=hist_len, amax_compute_algo=algo)
    seed = hash((algo, hist_len, n, margin)) % 2 ** 31
    for step in range(3):
        a = _random_state(recipe, n, torch.Generator().manual_seed(seed + step))
        b = _random_state(recipe, n, torch.Generator().manual_seed(seed + step))
        assert a._update_with_kernel(algo)
        a.update()
        with reference_only():
            assert not b._update_with_kernel(algo)
            b.update()
        _same(a.scale, b.scale)
        _same(a.amax_history, b.amax_history)
        assert torch.equal(a.amax_current, torch.zeros_like(a.amax_current))
        assert torch.equal(b.amax_current, torch.zeros_like(b.amax_current))


def test_update_kernel_sequence_matches_torch():
    """Many updates in a row (the history shifting through) stay identical."""
    recipe = DelayedScaling(amax_history_len=5, margin=1)
    gen = torch.Generator().manual_seed(3)
    a = _random_state(recipe, 3, gen)
    b = DelayedScalingState(recipe, 3, [E4, E5, E4], torch.device("cuda"))
    b.amax_history.copy_(a.amax_history)
    b.scale.copy_(a.scale)
    for _ in range(12):
        cur = torch.rand(3, generator=gen).cuda() * 100
        a.amax_current.copy_(cur)
        b.amax_current.copy_(cur)
        a.pending = b.pending = True
        a.update()
        with reference_only():
            b.update()
        _same(a.scale, b.scale)
        _same(a.amax_history, b.amax_history)


# ---- many states in one launch (lowprec.recipe.state_batch) ---------------------------------
def _random_states(specs, seed):
    """One random state per (recipe, n) spec, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [_random_state(recipe, n, gen) for recipe, n in specs]


def _update_both_ways(batched, alone):
    """``batched`` updated together, ``alone`` one state at a time: the same states after."""
    state_batch.update_states(batched)
    for s in alone:
        s.update()
    for a, b in zip(batched, alone):
        _same(a.scale, b.scale)
        _same(a.amax_history, b.amax_history)
        _same(a.amax_current, b.amax_current)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("hist_len", [1, 2, 16, 1024])
def test_batched_update_matches_single_state_kernel(algo, hist_len):
    """States of 1 to 33 columns (several column blocks a state at long histories) in one
    launch end exactly as with one launch each."""
    recipe = DelayedScaling(margin=0.5, amax_history_len=hist_len, amax_compute_algo=algo)
    specs = [(recipe, n) for n in (3, 1, 33, 2, 7, 3)]
    for step in range(3):
        batched = _random_states(specs, 100 * hist_len + step)
        alone = _random_states(specs, 100 * hist_len + step)
        _update_both_ways(batched, alone)
        for a in batched:
            assert not a.pending
            assert torch.equal(a.amax_current, torch.zeros_like(a.amax_current))


def test_batched_update_mixed_recipes_and_the_torch_path():
    """States of different history lengths, margins and algorithms (a callable one too, which
    takes the torch path) in one call: each set updates together, each state as alone."""
    recipes = [DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=2),
               DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent"),
               DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h[-1])]
    specs = [(recipes[i % 4], 2 + i % 3) for i in range(10)]
    batched, alone = _random_states(specs, 7), _random_states(specs, 7)
    batched[3].pending = alone[3].pending = False  # not recorded since its last update
    _update_both_ways(batched, alone)


def test_batched_update_table_follows_the_states():
    """The address table of a set of states is kept while they live; new states (even where
    ids come back) get a new one."""
    recipe = DelayedScaling(amax_history_len=4)
    for seed in range(4):
        batched = _random_states([(recipe, 3)] * 3, seed)
        alone = _random_states([(recipe, 3)] * 3, seed)
        for _ in range(2):
            for a, b in zip(batched, alone):
                a.amax_current.fill_(float(seed + 1))
                b.amax_current.fill_(float(seed + 1))
                a.pending = b.pending = True
            _update_both_ways(batched, alone)
        del batched, alone


def _side_stream_steps(steps=3):
    """A three-layer model stepped with its forward (and the region's batched update) on a
    side stream and ``backward()`` called on the default stream; the states after."""
    import lowprec
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[lowprec.Linear(64, 64, device="cuda") for _ in range(3)])
    recipe = DelayedScaling(amax_history_len=4)
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = (torch.randn(32, 64, generator=gen) * (step + 1)).cuda().requires_grad_(True)
        g = (torch.randn(32, 64, generator=gen) * 10.0 ** step).cuda()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), lowprec.autocast(recipe=recipe):
            y = model(x)
        torch.cuda.current_stream().wait_stream(side)
        y.backward(g)
    torch.cuda.synchronize()
    return [m.scaling_state() for m in model]


def test_batched_updates_on_the_modules_streams():
    batched = _side_stream_steps()
    with state_batch.per_state_updates():
        alone = _side_stream_steps()
    for sb, sa in zip(batched, alone):
        for mode in ("forward", "backward"):
            for name in ("scale", "amax_history"):
                _same(sb[mode][name], sa[mode][name])


def test_update_kernel_clamps_tiny_amax_to_the_fp32_max():
    recipe = DelayedScaling(amax_history_len=2, margin=1, amax_compute_algo="most_recent")
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a = DelayedScalingState(recipe, 3, [e4m3, e4m3, e5m2], torch.device("cuda"))
    a.amax_current.copy_(torch.tensor([1e-40, 1e-36, 3.0]))
    a.pending = True
    assert a._update_with_kernel("most_recent")
    a.update()
    fmax = torch.finfo(torch.float32).max
    assert a.scale[0].item() == fmax and a.scale[1].item() == fmax
    expected = torch.tensor(57344.0) / torch.tensor(3.0) / 2  # fp32, as the torch path
    assert a.scale[2].item() == expected.item()


def _seeded_steps(recipe, steps, mode):
    """(losses, gradients) of 3-Linear bf16 steps under ``recipe`` on CUDA: ``mode`` "eager"
    (the kernels: the amax pass before the cast while a slot has no scale), "reference"
    (the pure-torch path) or "compiled" (inductor)."""
    import lowprec
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(lowprec.Linear(256, 256, params_dtype=torch.bfloat16,
                                                 device="cuda") for _ in range(3)))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-6
    fn = torch.compile(model) if mode == "compiled" else model
    out = []
    for _ in range(steps):
        ctx = reference_only() if mode == "reference" else torch.enable_grad()
        with ctx:
            with lowprec.autocast(recipe=recipe):
                y = fn(x)
            y.backward(dy)
        out.append([y.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    return out, model


def test_first_step_scales_kernels_reference_and_compiled_agree():
    """``DelayedScaling()``'s first step on the GPU: the kernels' amax-first quantize, the
    reference and inductor give the same bits, step by step; tiny gradients (1e-6) are not
    flushed; after the first update every used slot has a scale and eager casts in one
    pass again."""
    recipe = DelayedScaling()
    eager, model = _seeded_steps(recipe, 3, "eager")
    reference, _ = _seeded_steps(recipe, 3, "reference")
    compiled, _ = _seeded_steps(recipe, 3, "compiled")
    for e, r, c in zip(eager, reference, compiled):
        for a, b, d in zip(e, r, c):
            assert torch.equal(a, b) and torch.equal(a, d)
    assert torch.count_nonzero(eager[0][2]) == eager[0][2].numel()  # first weight's grad
    fwd, bwd = (model[0]._recipe_states[m].delayed for m in ("forward", "backward"))
    # input, weight and dY slots hold scales; the unused output and grad_input do not
    assert [f.unseeded for f in fwd.firsts] == [False, False, True]
    assert [f.unseeded for f in bwd.firsts] == [False, True]
