"""Run a function on N ranks on 127.0.0.1, bounded in time, for the distributed tests.

gloo on CPU by default (CI); ``LOWPREC_DIST_BACKEND=nccl`` runs the same tests with NCCL,
one GPU a rank (``device()``), on a machine with as many GPUs."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: seconds a collective may wait before the process group fails (never a hang in CI)
PG_TIMEOUT = 60
BACKEND = os.environ.get("LOWPREC_DIST_BACKEND", "gloo")


def device(rank: int = 0) -> torch.device:
    """The device rank ``rank`` computes on (the main test process: rank 0's)."""
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def check_world(world: int) -> None:
    """Skip a test that needs more GPUs than the machine has (NCCL only)."""
    import pytest
    if BACKEND == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs for NCCL, the machine has {torch.cuda.device_count()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def counted_all_reduces():
    """Inside, record the element count of every ``dist.all_reduce``; yields the list."""
    calls = []
    all_reduce = dist.all_reduce

    def counted(t, *args, **kwargs):
        calls.append(t.numel())
        return all_reduce(t, *args, **kwargs)
    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = all_reduce


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    # Leave without running destructors: a gloo worker thread still owned by FSDP state at
    # interpreter exit can abort the process ("terminate called without an active
    # exception") after the test's work is done and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn, world: int, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` new processes; raises if any fails.

    gloo ranks are forked from a forkserver that has imported torch and lowprec once (a
    spawned rank spends seconds importing them: most of a small test's time); NCCL ranks
    are spawned, each initializing CUDA afresh."""
    check_world(world)
    # gloo ranks compute on the CPU. FSDP2's default mesh and DeviceMesh pick CUDA whenever
    # a GPU is visible, so on a GPU machine the ranks would move their shards there; hiding
    # the GPUs from the rank processes keeps them on the CPU, as on a CPU-only machine. (The
    # forkserver starts inside this block, so its children inherit the hidden GPUs.)
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if BACKEND == "gloo" else {}
    method = "forkserver" if BACKEND == "gloo" else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", "lowprec"])
    for attempt in range(3):
        try:
            with mock.patch.dict(os.environ, hidden):
                mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world,
                                   join=True, start_method=method)
            return
        except mp.ProcessRaisedException as exc:
            # free_port's port was free when asked for, but another test's process group
            # may bind it before rank 0 does: a new port, rather than a flaky failure
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
