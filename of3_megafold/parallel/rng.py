"""One random stream for an SP group: its first rank's.

The ranks of a sequence-parallel group compute one sample together, so every
random draw of that sample (dropout masks, diffusion noise, augmentation, OF3's
coin flips) must be the same draw on every rank. The group therefore uses the
generators of its first rank: that rank draws exactly what one process training
alone would draw, and the other ranks copy its generator states (one broadcast).
A run with SP therefore reproduces the one-process run's random draws.

:func:`seed_model_init` gives every rank, and every run, the same initial weights.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
import torch.distributed as dist

from of3_megafold.parallel.comm import Group, group_rank, group_size

_States = tuple[torch.Tensor, torch.Tensor | None, object]


def _states(device: torch.device, python: bool) -> _States:
    return (
        torch.get_rng_state(),
        torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        random.getstate() if python else None,
    )


def _set_states(states: _States, device: torch.device) -> None:
    cpu, accelerator, python = states
    torch.set_rng_state(cpu)
    if accelerator is not None:
        torch.cuda.set_rng_state(accelerator, device)
    if python is not None:
        random.setstate(python)


def _first_rank_states(group: Group, device: torch.device, python: bool) -> _States:
    """The group's first rank's generator states, on every rank (collective)."""
    box = [_states(device, python) if group_rank(group) == 0 else None]
    dist.broadcast_object_list(
        box,
        src=dist.get_global_rank(group, 0),
        group=group,
        device=device if device.type == "cuda" else None,
    )
    return box[0]


def adopt_first_rank_generators(group: Group, device: torch.device) -> None:
    """Set torch's CPU and ``device`` generators of every rank to the first rank's
    (collective; nothing to do when they are already equal, but a broadcast)."""
    if group_size(group) == 1:
        return
    states = _first_rank_states(group, device, python=False)
    if group_rank(group) != 0:
        _set_states(states, device)


@contextlib.contextmanager
def first_rank_generators(group: Group, device: torch.device) -> Iterator[None]:
    """Inside, every rank of ``group`` draws from its first rank's torch (CPU and
    ``device``) and Python generators (collective on entry).

    The first rank's generators simply run on, as in a one-process run; each
    other rank gets its own states back on exit.
    """
    if group_size(group) == 1:
        yield
        return
    shared = _first_rank_states(group, device, python=True)
    if group_rank(group) == 0:
        yield
        return
    own = _states(device, python=True)
    _set_states(shared, device)
    try:
        yield
    finally:
        _set_states(own, device)


def seed_model_init(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators before OF3 builds the model.

    OF3's runner seeds them (``RankSpecificSeedCallback``) only once the Trainer
    starts, after the model's weights were drawn, so two runs with the same seed
    began from different weights. The output layers OF3 initialises to zero hid
    it for the first steps: the losses agreed until the first update with a
    non-zero learning rate had reached the hidden layers, then drifted. Every
    rank takes the same seed, so the ranks of a parallel run build the same
    weights as one process does.
    """
    from openfold3.core.utils.callbacks import set_seed_for_rank

    set_seed_for_rank(seed, rank=0)
