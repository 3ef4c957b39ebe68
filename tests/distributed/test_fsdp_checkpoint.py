"""Activation checkpointing under FSDP2, as torchtitan and accelerate apply it: each
layer wrapped by ``checkpoint_wrapper`` (non-reentrant or reentrant) and sharded by
``fully_shard``, on 2 CPU gloo ranks. The recompute re-gathers the layer's
weights (FSDP2's own pre-forward hook) and replays the forward's recipe and scales, so
losses, weights and delayed-scaling states equal the same sharded run without
checkpointing, bit for bit, with and without quantized all-gathers."""

from __future__ import annotations

import pytest
import spawn
import torch
from test_ddp import _states
from test_fsdp import RECIPES, _model, full_state, fully_shard, train

from lowprec.distributed import quantized_all_gather

#: (recipe, quantized all-gather). Formats whose columnwise side does not derive from the
#: gathered rowwise one (MXFP8 1x32, block 1x128) gather only the columnwise side in
#: backward, which a recompute cannot use: they gather in high precision here
#: (docs/distributed.md, "Limits"). NVFP4's 16x16 weight tiles derive theirs.
CASES = [("current", True), ("delayed", False), ("mxfp8", False), ("nvfp4", True)]


def _checkpointed(model, how: str):
    """Each layer wrapped by ``checkpoint_wrapper``, non-reentrant or reentrant."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
    # a reentrant checkpoint whose inputs need no gradient has none to give (torch's rule):
    # the first layer, fed the data, stays as it is there
    first = 1 if how == "reentrant" else 0
    for i in range(first, len(model.layers)):
        model.layers[i] = checkpoint_wrapper(model.layers[i], checkpoint_impl=impl)
    return model


def _unwrapped(d: dict) -> dict:
    return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in d.items()}


def _run(rank, rname, gather, how):
    model = _model(rank=rank)
    recipe = RECIPES[rname]()
    if gather:
        quantized_all_gather(model, recipe)
    if how is not None:
        _checkpointed(model, how)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses = train(model, recipe)
    return {"losses": losses.cpu(), "state": _unwrapped(full_state(model)),
            "delayed": _unwrapped(_states(model))}


def _worker(rank, world, out_dir):
    results = {}
    for rname, gather in CASES:
        for how in (None, "non_reentrant", "reentrant"):
            results[(rname, how)] = _run(rank, rname, gather, how)
    if rank == 0:
        torch.save(results, f"{out_dir}/ck.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp_ck")
    spawn.run(_worker, 2, str(path))
    return torch.load(path / "ck.pt", weights_only=False)


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("rname,gather", CASES, ids=[c[0] for c in CASES])
def test_fsdp_checkpointing_is_bit_identical(results, rname, gather, how):
    want, got = results[(rname, None)], results[(rname, how)]
    assert torch.equal(got["losses"], want["losses"])
    assert want["state"].keys() == got["state"].keys()
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), k
    assert got["delayed"].keys() == want["delayed"].keys()
    for k, v in want["delayed"].items():
        assert torch.equal(got["delayed"][k], v), k
    if rname == "delayed":
        assert want["delayed"]  # the states compared are real
