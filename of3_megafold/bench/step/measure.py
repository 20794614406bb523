"""Timing one provider at one crop size: the row fields, the JSON row, the log line
and the text table."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from of3_megafold.bench.common import (
    free_device_memory,
    is_out_of_memory,
    matmul_tf32,
    split_tf32,
)
from of3_megafold.bench.step.harness import (
    StepResult,
    TrainingStepHarness,
    random_training_batch,
)
from of3_megafold.bench.step.providers import RIVAL_PROVIDERS

logger = logging.getLogger(__name__)


def step_row(
    identity: Mapping[str, Any],
    mode: str,
    n_token: int,
    n_msa: int,
    n_templ: int,
    metadata: dict,
    **fields: Any,
) -> dict[str, Any]:
    """A JSON row: ``identity`` (:meth:`TrainingStepHarness.identity`), the case,
    the measured ``fields`` and the environment ``metadata``."""
    return {
        "bench": "step",
        "mode": mode,
        "provider": identity["provider"],
        "config": identity["config"],
        "n_token": n_token,
        "n_msa": n_msa,
        "n_templ": n_templ,
        "no_samples": identity["no_samples"],
        "precision": identity["precision"],
        "params_m": identity["params_m"],
        "matmul_precision": torch.get_float32_matmul_precision(),
        **fields,
        **metadata,
    }


def measure_step(
    harness: TrainingStepHarness,
    n_token: int,
    n_msa: int,
    n_templ: int,
    warmup: int,
    repeats: int,
    count_launches: bool,
) -> dict[str, Any]:
    """Warm-up steps, then ``repeats`` timed steps (and one profiled step).

    Returns the row fields; ``oom`` is True (and the timings ``None``) when a step
    does not fit, and a rival provider's failure is an ``error`` field rather than
    an exception. ``matmul_precision`` is read while the steps run (a ``-tf32``
    provider switches TF32 on for them). Memory is freed before returning in any case.
    """
    provider, tf32 = split_tf32(harness.provider)
    rival = RIVAL_PROVIDERS.get(provider)
    batch = random_training_batch(n_token, n_msa, n_templ, harness.device, harness.seed)
    n_atom = int(batch["atom_mask"].shape[-1])
    results: list[StepResult] = []
    launches = None
    first_ms = None
    out_of_memory = False
    failure = None
    try:
        with matmul_tf32(tf32):
            matmul_precision = torch.get_float32_matmul_precision()
            for index in range(warmup + repeats):
                result = harness.step(batch)
                if index == 0:
                    first_ms = result.ms
                if index >= warmup:
                    results.append(result)
    except Exception as error:
        if is_out_of_memory(error):
            out_of_memory = True
        elif rival is not None:
            failure = f"{type(error).__name__}: {str(error).strip()}"[:300]
        else:
            raise
    if count_launches and not (out_of_memory or failure):
        try:
            with matmul_tf32(tf32):
                launches = harness.count_launches(batch)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            logger.warning(
                "%s @ %d tokens: the profiled step ran out of memory; launches "
                "not counted",
                harness.provider,
                n_token,
            )
    # Outside the except block the traceback (and the activations its frames hold)
    # is gone; now the memory can really be handed back.
    del batch
    harness.model.zero_grad(set_to_none=True)
    free_device_memory()
    fields = {"n_atom": n_atom, "matmul_precision": matmul_precision}
    if out_of_memory or failure:
        fields.update(oom=out_of_memory, ms=None, first_step_ms=first_ms)
        if failure:
            fields["error"] = failure
        return fields
    last = results[-1]
    peaks = [r.peak_gib for r in results if r.peak_gib is not None]
    return {
        **fields,
        "oom": False,
        "ms": statistics.median(r.ms for r in results),
        "step_ms": [round(r.ms, 3) for r in results],
        "first_step_ms": first_ms,
        "warmup": warmup,
        "repeats": repeats,
        "peak_gib": max(peaks) if peaks else None,
        "start_gib": last.start_gib,
        "launches": None if launches is None else launches["kernels"],
        "host_launches": None if launches is None else launches["host"],
        "gpu_busy_ms": None if launches is None else launches["gpu_busy_ms"],
        "recycles": last.recycles,
        "permutation_alignment": last.permutation_alignment,
        "loss": last.loss,
        "grad_norm": last.grad_norm,
    }


def log_row(row: Mapping[str, Any]) -> None:
    if row.get("oom") or row.get("error"):
        what = row.get("error") or "out of memory"
        logger.info("%s @ %d tokens: %s", row["provider"], row["n_token"], what)
        return
    logger.info(
        "%s @ %d tokens: %.1f ms/step, peak %s GiB, %s kernels in %s launches, "
        "GPU busy %s ms, loss %.4f",
        row["provider"],
        row["n_token"],
        row["ms"],
        f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "n/a",
        row.get("launches"),
        row.get("host_launches"),
        row.get("gpu_busy_ms"),
        row["loss"]["loss"],
    )


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A compact text table of step rows (timed rows, probes, max-crop results)."""
    lines = [
        f"{'provider':<16} {'mode':<15} {'tokens':>6} {'s/step':>8} "
        f"{'peak GiB':>8} {'kernels':>9} {'launches':>9} {'loss':>9} "
        f"{'grad norm':>10}"
    ]
    for row in rows:
        if row.get("mode") == "max_crop":
            lines.append(
                f"{row['provider']:<16} {'max_crop':<15} {str(row['max_crop']):>6}"
            )
            continue
        ms = row.get("ms")
        peak = row.get("peak_gib")
        loss = (row.get("loss") or {}).get("loss")
        grad = row.get("grad_norm")
        if row.get("oom"):
            seconds = "OOM"
        elif ms is None:
            seconds = "error"  # a rival provider's failure: the row's "error"
        else:
            seconds = f"{ms / 1e3:.2f}"
        lines.append(
            f"{row['provider']:<16} {row['mode']:<15} {row['n_token']:>6} "
            f"{seconds:>8} "
            f"{'' if peak is None else f'{peak:.1f}':>8} "
            f"{'' if row.get('launches') is None else row['launches']:>9} "
            f"{'' if row.get('host_launches') is None else row['host_launches']:>9} "
            f"{'' if loss is None else f'{loss:.4f}':>9} "
            f"{'' if grad is None else f'{grad:.4g}':>10}"
        )
    return "\n".join(lines)
