"""Process groups for sequence parallelism (SP) on top of data parallelism (DP).

The world of ``W`` ranks is laid out as ``DP x SP`` with ``W = dp_size * sp_size``:

- an SP group is ``sp_size`` consecutive ranks (ranks ``r`` with the same
  ``r // sp_size``); its members work on the same sample, each holding a shard of
  the pair representation. Consecutive ranks share a node first, so the SP
  collectives (one ``all_to_all`` per axis swap) stay on NVLink where they can;
- the data-parallel replicas are the SP groups: the data sampler gives each SP group
  its own sample (``dp_rank = r // sp_size``, ``dp_size = W // sp_size``, what the
  ``sequence_parallel`` extension makes OF3's data module report).

Gradients are still averaged over the whole world (as DDP and DeepSpeed do); see
:mod:`of3_megafold.parallel.comm` for why that gives the right gradients.

``sp_size == 1`` (or no initialised ``torch.distributed``) is stock behaviour: every
SP query answers "one rank", :func:`sp_group` is ``None`` and the collectives are
identities.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass

import torch.distributed as dist

from of3_megafold.errors import KitConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's SP group.

    Attributes:
        sp_size: ranks per SP group.
        sp_group: this rank's SP group (``None`` when ``sp_size == 1``).
    """

    sp_size: int = 1
    sp_group: dist.ProcessGroup | None = None


_LAYOUT = ParallelLayout()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def check_world_size(sp_size: int, world_size: int) -> None:
    """Raise KitConfigError unless ``world_size`` is a positive multiple of
    ``sp_size``."""
    if sp_size < 1:
        raise KitConfigError(f"sequence parallel size must be >= 1, got {sp_size}")
    if world_size % sp_size:
        raise KitConfigError(
            f"sequence parallel size {sp_size} does not divide the world size "
            f"{world_size} (nodes x devices); choose a size that divides it, or "
            f"launch a multiple of {sp_size} ranks"
        )


def init_sequence_parallel(sp_size: int) -> ParallelLayout:
    """Create the SP groups (collective: every rank calls it, same size).

    No DP groups are made: gradients are averaged over the whole world, and the
    data module derives the DP rank and size itself (``rank // sp_size``,
    ``world // sp_size``).

    Args:
        sp_size: ranks per SP group; 1 leaves everything stock.

    Returns:
        This rank's layout (also kept for :func:`sp_group` and :func:`sp_size`).

    Raises:
        KitConfigError: ``sp_size > 1`` without an initialised torch.distributed,
            or a world size that is not a multiple of ``sp_size``.
    """
    global _LAYOUT
    if not _distributed():
        if sp_size != 1:
            raise KitConfigError(
                f"sequence parallel size {sp_size} needs torch.distributed; launch "
                "with several devices (pl_trainer_args.devices / num_nodes) or set "
                "the size to 1"
            )
        _LAYOUT = ParallelLayout()
        return _LAYOUT
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world_size(sp_size, world)
    if sp_size == 1:
        _LAYOUT = ParallelLayout()
        return _LAYOUT
    mine = None
    # new_group is collective over the world: every rank creates every group, in
    # the same order, and keeps its own.
    for first in range(0, world, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = group
    _LAYOUT = ParallelLayout(sp_size, mine)
    return _LAYOUT


def reset_sequence_parallel() -> None:
    """Forget the groups (back to stock).

    The kit's reference is the only one it holds, so after
    ``torch.distributed.destroy_process_group()`` this lets the groups be freed at
    once. Call it before or after that; it also runs at interpreter exit. A group
    that outlives the interpreter's shutdown is freed during finalisation, where a
    ``gloo`` worker thread still releasing a finished collective's tensors aborts
    the process ("terminate called without an active exception").
    """
    global _LAYOUT
    _LAYOUT = ParallelLayout()


atexit.register(reset_sequence_parallel)


def sp_group() -> dist.ProcessGroup | None:
    """This rank's SP group, ``None`` when sequence parallelism is off."""
    return _LAYOUT.sp_group


def sp_size() -> int:
    return _LAYOUT.sp_size
