"""Shipped autotuning choices of the EvoFlash kernels, per GPU model.

``<gpu>.json`` (written by ``python -m tools.ship_autotune`` from a GPU run's Triton
autotuning results) lists, per kernel and tuning key, the configuration that was
fastest on that GPU. On a GPU of that name, :class:`~of3_megafold.kernels._launch.
TunedKernel` launches a listed key with its configuration instead of benchmarking
every candidate (a few minutes on the first training step of a fresh machine). A
listed configuration that is not among the kernel's current candidates is ignored,
and a key that is not listed is tuned as usual. A table records the fingerprint of the
candidate list of each kernel it was built for (:func:`..configs.lists_fingerprint`);
a kernel whose list has changed since has its choices ignored (they never competed
with the configurations added since, and such stale choices ran 25-33% slow),
and its keys are tuned as usual until the table is rebuilt; the other kernels' choices
still apply. ``OF3_MEGAFOLD_TUNED_CONFIGS=0``
turns the table off (tune everything).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ..configs import lists_fingerprint

logger = logging.getLogger(__name__)

KERNELS = (
    "_evoflash_fwd_kernel",
    "_evoflash_bwd_dq_kernel",
    "_evoflash_bwd_dkdv_kernel",
    "_evoflash_bwd_dbias_kernel",
)


def tuned_path(gpu: str) -> Path:
    """Where the table of GPU model ``gpu`` (e.g. ``NVIDIA H200``) lives."""
    return Path(__file__).with_name(re.sub(r"[^A-Za-z0-9]+", "_", gpu) + ".json")


def current_entries(table: dict[str, Any]) -> tuple[dict[str, list], list[str]]:
    """Split a table's entries by whether each kernel's candidate list is the one it
    was built for: ``(entries of the current kernels, names of the stale ones)``. A
    table from before per-kernel fingerprints (one string) is stale as a whole."""
    built_for = table.get("lists")
    if not isinstance(built_for, dict):
        built_for = {}
    current, stale = {}, []
    for kernel, entries in table.get("kernels", {}).items():
        if kernel in KERNELS and built_for.get(kernel) == lists_fingerprint(kernel):
            current[kernel] = entries
        else:
            stale.append(kernel)
    return current, stale


@functools.cache
def _table(gpu: str) -> dict[str, Any]:
    """The table of ``gpu`` with the entries of kernels whose candidate list changed
    since it was built left out."""
    path = tuned_path(gpu)
    if not path.exists():
        return {"kernels": {}}
    table = json.loads(path.read_text())
    kernels, stale = current_entries(table)
    for kernel in stale:
        logger.warning(
            "%s was built for another candidate list of %s; ignoring its choices "
            "for that kernel (its keys are tuned at first use). Rebuild it with "
            "python -m tools.ship_autotune.", path.name, kernel,
        )
    return {**table, "kernels": kernels}


def tuned_configs(kernel: str) -> dict[tuple, dict]:
    """``tuning key -> {"kwargs", "num_warps", "num_stages"}`` for ``kernel`` on the
    current CUDA device; empty without CUDA, without a table for this GPU, or with
    ``OF3_MEGAFOLD_TUNED_CONFIGS=0``. Keys are Triton's: key-argument values, then
    the tensor arguments' dtypes as strings (``"torch.bfloat16"``)."""
    if os.environ.get("OF3_MEGAFOLD_TUNED_CONFIGS", "1") == "0":
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    entries = _table(torch.cuda.get_device_name()).get("kernels", {}).get(kernel, [])
    return {tuple(e["key"]): e for e in entries}
