"""Delayed-scaling amax reduction over a process group (2 CPU gloo ranks, or NCCL)."""

import os

import pytest
import spawn
import torch
import torch.distributed as dist

import lowprec
from lowprec.recipe.recipes import DelayedScaling

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _worker(rank: int, world: int, reduce_amax: bool, out_dir: str, modules: int) -> None:
    with spawn.counted_all_reduces() as calls:
        torch.manual_seed(0)  # same weights on every rank
        lins = [lowprec.Linear(32, 16).to(spawn.device(rank)) for _ in range(modules)]
        # Rank r's input is scaled by (r + 1): the reduced amax is the largest rank's.
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * (rank + 1)
        x = x.to(spawn.device(rank)).requires_grad_(True)
        grad = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)) * (rank + 1)
        recipe = DelayedScaling(amax_history_len=2, reduce_amax=reduce_amax)
        with lowprec.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            y = sum(lin(x) for lin in lins)
        y.backward(grad.to(spawn.device(rank)))
    out = {"calls": torch.tensor(calls)}
    for i, lin in enumerate(lins):
        out[i] = {k: {n: t.detach().cpu().clone() for n, t in v.items()}
                  for k, v in lin.scaling_state().items()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("modules", [1, 3])
@pytest.mark.parametrize("reduce_amax", [True, False])
def test_delayed_scaling_reduces_amax_over_group(tmp_path, reduce_amax, modules):
    """Every module's forward and backward amaxes are reduced; with several modules the
    forward amaxes go in one all-reduce at the region's exit (``lowprec.recipe.state_batch``),
    the backward ones in one at the backward pass's end (``lowprec.recipe.backward_pass``)."""
    world = 2
    spawn.run(_worker, world, reduce_amax, str(tmp_path), modules)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]

    torch.manual_seed(0)
    w_amaxes = [lowprec.Linear(32, 16).weight.detach().abs().max() for _ in range(modules)]
    x0 = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    g0 = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    for r, res in enumerate(results):
        # one all-reduce of 3 forward amaxes a module, then one of 2 backward ones a module
        expect_calls = [3 * modules] + [2 * modules] if reduce_amax else []
        assert res["calls"].tolist() == expect_calls
        seen = world if reduce_amax else r + 1  # largest input scale this rank's history saw
        x_amax, g_amax = x0.abs().max() * seen, g0.abs().max() * seen
        for i, w_amax in enumerate(w_amaxes):
            st = res[i]
            fwd_hist = st["forward"]["amax_history"][0]
            torch.testing.assert_close(fwd_hist[:2], torch.stack([x_amax, w_amax]), rtol=0, atol=0)
            assert torch.equal(st["forward"]["scale"][0], torch.tensor(E4M3_MAX) / x_amax)
            assert torch.equal(st["backward"]["amax_history"][0][0], g_amax)
            assert torch.equal(st["backward"]["scale"][0], torch.tensor(E5M2_MAX) / g_amax)
