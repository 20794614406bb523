"""The largest trainable crop of a provider: a walk along a ladder of crop sizes,
one probe step per size, each probe in a fresh process by default (its own CUDA
context and caching allocator, as a training run at that crop starts)."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from of3_megafold.bench.step.harness import TrainingStepHarness
from of3_megafold.bench.step.measure import log_row, measure_step, step_row

logger = logging.getLogger(__name__)

# Crop sizes tried by the largest-crop search.
MAX_CROP_LADDER = (384, 512, 768, 1024, 1280, 1536, 1792, 2048)


def search_max_crop(
    probe: Callable[[int], bool],
    ladder: Sequence[int],
    start: int,
    fits: Collection[int],
    too_big: Collection[int],
) -> tuple[int | None, dict[int, bool]]:
    """Largest rung of ``ladder`` for which ``probe`` succeeds.

    Starts at rung ``start`` and walks up while steps fit, or down while they do
    not, assuming memory grows with the crop: sizes up to the largest in ``fits``
    fit and sizes from the smallest in ``too_big`` do not, without probing.
    Returns the largest fitting size (``None`` if none) and ``{size: fitted}`` for
    every size decided (probed or inferred).
    """
    ladder = sorted(ladder)
    known: dict[int, bool] = {}

    def fitted(size: int) -> bool:
        if size not in known:
            if fits and size <= max(fits):
                known[size] = True
            elif too_big and size >= min(too_big):
                known[size] = False
            else:
                known[size] = probe(size)
        return known[size]

    index = min(range(len(ladder)), key=lambda i: abs(ladder[i] - start))
    if fitted(ladder[index]):
        while index + 1 < len(ladder) and fitted(ladder[index + 1]):
            index += 1
        return ladder[index], known
    while index > 0:
        index -= 1
        if fitted(ladder[index]):
            return ladder[index], known
    return None, known


@dataclass(frozen=True)
class ProbeSpec:
    """What a max-crop probe in a fresh process builds (:func:`fresh_probe`)."""

    config: str
    provider: str
    device: str
    num_recycles: int | None
    n_msa: int
    n_templ: int
    log_level: int


def probe_step(
    harness: TrainingStepHarness, n_token: int, n_msa: int, n_templ: int
) -> tuple[dict, dict]:
    """One max-crop probe: one step (no warm-up) at ``n_token`` tokens;
    the harness's identity and the row fields (:func:`measure_step`)."""
    fields = measure_step(harness, n_token, n_msa, n_templ, 0, 1, count_launches=False)
    return harness.identity(), fields


def fresh_probe(spec: ProbeSpec, n_token: int) -> tuple[dict, dict]:
    """In a spawned process: build the provider's harness and run
    :func:`probe_step`."""
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    harness = TrainingStepHarness(
        spec.config, spec.provider, spec.device, num_recycles=spec.num_recycles
    )
    try:
        return probe_step(harness, n_token, spec.n_msa, spec.n_templ)
    finally:
        harness.close()


class ProbeProcessDied(RuntimeError):
    """A max-crop probe's process ended without a result (killed by a signal, e.g.
    by the host's out-of-memory killer when pinned host memory runs out)."""


def probe_in_fresh_process(
    spec: ProbeSpec, n_token: int, target: Callable = fresh_probe
) -> tuple[dict, dict]:
    """``target(spec, n_token)`` (:func:`fresh_probe`) in a new Python process
    (``spawn``: its own CUDA context and caching allocator, as a training run at one
    crop size has), waited for.

    Raises:
        ProbeProcessDied: the process died without a result; a CUDA out-of-memory
            error is a result.
    """
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(target, spec, n_token).result()
        except concurrent.futures.BrokenExecutor as error:
            raise ProbeProcessDied(
                f"the {spec.provider} probe at {n_token} tokens died in its process "
                "without a result (killed, e.g. by the host's out-of-memory killer)"
            ) from error


def _unnamed(provider: str) -> dict[str, Any]:
    """A row identity for a provider whose model never reported one (its only probe
    died before it could)."""
    return {"provider": provider, "config": None, "no_samples": None,
            "precision": None, "params_m": None}


def run_max_crop(
    provider: str,
    measure: Callable[[int], tuple[Mapping[str, Any], dict]],
    known: Mapping[str, Any] | None,
    process: str,
    n_msa: int,
    n_templ: int,
    ladder: Sequence[int],
    start: int | None,
    fits: Collection[int],
    too_big: Collection[int],
    metadata: dict,
    emit: Callable[[dict], None],
) -> None:
    """Search ``provider``'s largest crop (:func:`search_max_crop`), one
    ``max_crop_probe`` row per probe and a ``max_crop`` summary row.

    ``measure(n_token)`` runs one probe step: (identity, row fields). ``known``:
    the identity from the timed sizes, which name the summary row when no probe ran
    (only the timed sizes can decide the whole ladder). ``process``: ``same`` or
    ``fresh``, written into each row as ``probe_process``. A probe whose process
    died (:class:`ProbeProcessDied`) does not fit: its row has ``oom`` false and the
    death as ``error``."""
    seen: list[Mapping[str, Any]] = []

    def probe(n_token: int) -> bool:
        logger.info(
            "%s: max-crop probe at %d tokens (%s process)", provider, n_token, process
        )
        try:
            who, fields = measure(n_token)
            seen.append(who)
        except ProbeProcessDied as died:
            who = seen[-1] if seen else known or _unnamed(provider)
            fields = {"oom": False, "error": str(died)}
        fields["probe_process"] = process
        emit(
            step_row(who, "max_crop_probe", n_token, n_msa, n_templ, metadata, **fields)
        )
        log_row(fields | {"provider": provider, "n_token": n_token})
        return not fields["oom"] and "error" not in fields

    if start is None:
        above = [size for size in sorted(ladder) if not fits or size > max(fits)]
        start = above[0] if above else max(ladder)
    largest, searched = search_max_crop(probe, ladder, start, fits, too_big)
    decided = {size: True for size in fits} | {size: False for size in too_big}
    decided |= searched
    summary = {
        "max_crop": largest,
        "decided": {str(size): ok for size, ok in sorted(decided.items())},
        "ladder": list(ladder),
        "probe_process": process,
    }
    who = seen[-1] if seen else known
    emit(step_row(who, "max_crop", largest, n_msa, n_templ, metadata, **summary))
    logger.info("%s: largest trainable crop %s", provider, largest)
