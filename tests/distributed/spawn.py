"""Run a function on N gloo ranks on 127.0.0.1 (CPU), bounded in time, for the
distributed tests."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: seconds a collective may wait before the process group fails (never a hang in CI)
PG_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def run(fn, world: int, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; raises if any fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
