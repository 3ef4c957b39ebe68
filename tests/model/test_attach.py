"""A recipe attached to a model (``lowprec.attach_recipe``, ``convert_model(attach=True)``)
runs every call of it as ``lowprec.autocast`` would, bit for bit; an explicit autocast
wins; the attachment survives pickling and compiles; under DelayedScaling a fresh model's
extra state has its trained size, so ``torch.distributed.checkpoint`` loads it in place."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from same_run import RECIPES, assert_same_run, delayed_states

import lowprec

D = 128
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = lowprec.Linear(D, 2 * D, name="up")
        self.down = lowprec.Linear(2 * D, D, name="down")

    def forward(self, x):
        # relu: inductor's fused gelu backward is not eager's bit for bit
        return self.down(torch.relu(self.up(x)))


def _pair():
    torch.manual_seed(0)
    a = Net()
    return a, copy.deepcopy(a)


def _steps(model, recipe, explicit: bool, seed=1):
    """STEPS forward+backward+SGD steps; returns the last (x, y)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # NVFP4's stochastic rounding draws from the global RNG
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(32, D, generator=g).requires_grad_()
        opt.zero_grad(set_to_none=True)
        if explicit:
            with lowprec.autocast(recipe=recipe):
                y = model(x)
        else:
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
    return x, y


@pytest.mark.parametrize("rname", ["current", "delayed", "mxfp8", "nvfp4"])
def test_attached_equals_autocast(rname):
    a, b = _pair()
    recipe = RECIPES[rname]()
    lowprec.attach_recipe(b, recipe)
    assert lowprec.attached_recipe(b).recipe is recipe
    xa, ya = _steps(a, recipe, explicit=True)
    xb, yb = _steps(b, recipe, explicit=False)
    assert_same_run(a, b, xa, xb, ya, yb)


def test_explicit_autocast_wins():
    torch.manual_seed(0)
    m = Net()
    lowprec.attach_recipe(m, RECIPES["nvfp4"]())
    x = torch.randn(8, D)
    with torch.no_grad():
        plain = Net.forward(m, x)  # the modules outside any autocast: high precision
        with lowprec.autocast(enabled=False):
            assert torch.equal(m(x), plain)
        mx = RECIPES["mxfp8"]()
        with lowprec.autocast(recipe=mx):
            want = m.down(torch.relu(m.up(x)))
            assert torch.equal(m(x), want)
        assert not torch.equal(m(x), want)  # its own recipe again


def test_detach_and_replace():
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(8, D)
    lowprec.attach_recipe(m, RECIPES["current"]())
    lowprec.attach_recipe(m, RECIPES["mxfp8"]())  # replaces
    assert len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1
    with torch.no_grad():
        with lowprec.autocast(recipe=RECIPES["mxfp8"]()):
            want = m(x)
        assert torch.equal(m(x), want)
        lowprec.detach_recipe(m)
        assert lowprec.attached_recipe(m) is None and not m._forward_hooks
        assert torch.equal(m(x), Net.forward(m, x))


def test_convert_model_attach():
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU(), torch.nn.Linear(D, D))
    ref = lowprec.convert_model(copy.deepcopy(src))
    recipe = RECIPES["delayed"]()
    m = lowprec.convert_model(src, recipe, attach=True)
    assert lowprec.attached_recipe(m).recipe is recipe
    xa, ya = _steps(ref, recipe, explicit=True)
    xb, yb = _steps(m, recipe, explicit=False)
    assert_same_run(ref, m, xa, xb, ya, yb)
    with pytest.raises(ValueError, match="needs a recipe"):
        lowprec.convert_model(torch.nn.Linear(4, 4), attach=True)
    with pytest.raises(TypeError, match="lowprec recipe"):
        lowprec.attach_recipe(m, "fp8")


def test_attached_recipe_pickles_and_copies():
    torch.manual_seed(0)
    a = Net()
    recipe = RECIPES["delayed"]()
    lowprec.attach_recipe(a, recipe)
    _steps(a, None, explicit=False)
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    for copied in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a),
                   torch.load(buf, weights_only=False)):
        assert lowprec.attached_recipe(copied).recipe == recipe
        ref = copy.deepcopy(a)
        lowprec.detach_recipe(ref)
        xr, yr = _steps(ref, recipe, explicit=True, seed=5)
        xc, yc = _steps(copied, None, explicit=False, seed=5)
        assert_same_run(ref, copied, xr, xc, yr, yc)


@pytest.mark.parametrize("rname", ["current", "delayed"])
def test_attached_recipe_compiles_bit_identical(rname):
    """The hooks trace with the model: the region lives in the graph (delayed scaling's
    forward update included, its states made at attach time so the first call traces)."""
    a, b = _pair()
    recipe = RECIPES[rname]()
    lowprec.attach_recipe(a, recipe)
    lowprec.attach_recipe(b, recipe)
    # aot_eager: the hooks' tracing is what differs from a plain compiled model, and
    # inductor's kernels around the calls are test_compiled_call's and test_traced's
    compiled = torch.compile(b, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(32, D, generator=g) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), compiled(xb)
        ya.square().mean().backward()
        yb.square().mean().backward()
        assert_same_run(a, b, xa, xb, ya, yb)


def test_delayed_state_made_at_attach_has_the_trained_size():
    """A fresh model with DelayedScaling attached holds fresh state (so its extra state
    has the trained size before any forward); it follows the model's device moves and
    survives meta-device init (to_empty + reset_parameters)."""
    recipe = RECIPES["delayed"]()
    torch.manual_seed(0)
    trained = lowprec.attach_recipe(Net(), recipe)
    _steps(trained, None, explicit=False)
    fresh = lowprec.attach_recipe(Net(), recipe)
    saved, blank = trained.state_dict(), fresh.state_dict()
    for k in saved:
        assert saved[k].shape == blank[k].shape, k
    assert all(not sd["amax_history"].any() for sd in delayed_states(fresh).values())
    with torch.device("meta"):
        meta = Net()
    lowprec.attach_recipe(meta, recipe)
    meta.to_empty(device="cpu")
    for mod in meta.modules():
        if isinstance(mod, lowprec.Linear):
            mod.reset_parameters()
    assert {k: v.shape for k, v in meta.state_dict().items()} == {
        k: v.shape for k, v in saved.items()}
    # in-place loading (DCP's way) into the placeholder, then load_state_dict
    placeholder = meta.state_dict()
    for k, v in saved.items():
        placeholder[k].copy_(v)
    meta.load_state_dict(placeholder)
    assert delayed_states(meta).keys() == delayed_states(trained).keys()
    for key, sd in delayed_states(trained).items():
        for k, v in sd.items():
            assert torch.equal(delayed_states(meta)[key][k], v), (key, k)


def test_dcp_loads_delayed_state_into_a_fresh_attached_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    recipe = RECIPES["delayed"]()
    torch.manual_seed(0)
    trained = lowprec.attach_recipe(Net(), recipe)
    _steps(trained, None, explicit=False)
    dcp.save(trained.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    torch.manual_seed(1)
    fresh = lowprec.attach_recipe(Net(), recipe)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(sd)
    xa, ya = _steps(trained, None, explicit=False, seed=9)
    xb, yb = _steps(fresh, None, explicit=False, seed=9)
    assert_same_run(trained, fresh, xa, xb, ya, yb)
