"""Run a test body on several CPU processes joined by a ``gloo`` process group."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from of3_megafold.parallel import groups

_CALLS = itertools.count()


def _worker(rank: int, world_size: int, store: str, body: Callable, args: tuple):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    try:
        body(rank, world_size, *args)
    finally:
        groups.reset_sequence_parallel()
        if dist.is_initialized():  # a body may end the world itself
            dist.destroy_process_group()


def run_on_ranks(body: Callable, world_size: int, tmp_path: Path, *args) -> None:
    """Call ``body(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``body`` must be a module-level function (it is pickled by reference). An
    exception on any rank fails the caller with that rank's traceback.
    """
    store = tmp_path / f"rendezvous-{os.getpid()}-{next(_CALLS)}"
    mp.spawn(
        _worker, args=(world_size, str(store), body, args), nprocs=world_size, join=True
    )
