"""Summaries of ``train_run.json``: steady-state step times and their shares, the
loss and gradient-norm gaps between providers, and ``train_run.png``.

Rows are those :mod:`of3_megafold.bench.train` appends (one per optimizer step,
with ``run``, ``provider``, ``label``, ``n_token``, ``step``, ``wall_ms``,
``data_wait_ms``, ``<phase>_ms`` for each of :data:`PHASES`, ``peak_gib``, ``loss``
and ``grad_norm``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STEADY_FROM = 6
"""First step counted as steady state (compilation, autotuning and the loader's
warm-up are over by then)."""

SMOOTHING = 10
"""Steps in the moving average the loss and gradient-norm curves are compared on."""

PHASES = ("forward", "backward", "clip", "optimizer", "ema")
"""The GPU-timeline phases of a step, in order; a row has ``<phase>_ms`` for each."""


def latest_runs(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, list[dict]]:
    """The newest run of each ``(provider, label, n_token)``, its rows by step."""
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(dict(row))
    newest: dict[tuple, list[dict]] = {}
    for run_rows in runs.values():
        first = run_rows[0]
        key = (first["provider"], first.get("label"), first["n_token"])
        if key not in newest or first["date"] > newest[key][0]["date"]:
            newest[key] = sorted(run_rows, key=lambda row: row["step"])
    return newest


def moving_average(values: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """Trailing mean over up to ``window`` values: ``out[i] = mean(v[i-w+1..i])``."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def max_relative_gap(
    a: Sequence[Mapping], b: Sequence[Mapping], field: str, after: int = SMOOTHING
) -> float | None:
    """Largest ``|A - B| / |B|`` of the two runs' smoothed ``field`` over the steps
    both have, counting steps after ``after``; None when they share none."""
    by_step_a = {row["step"]: row[field] for row in a if row.get(field) is not None}
    by_step_b = {row["step"]: row[field] for row in b if row.get(field) is not None}
    steps = sorted(set(by_step_a) & set(by_step_b))
    if not steps:
        return None
    smooth_a = moving_average([by_step_a[s] for s in steps])
    smooth_b = moving_average([by_step_b[s] for s in steps])
    gaps = [
        abs(x - y) / abs(y)
        for step, x, y in zip(steps, smooth_a, smooth_b, strict=True)
        if step > after and y != 0
    ]
    return max(gaps) if gaps else None


def same_inputs(a: Sequence[Mapping], b: Sequence[Mapping]) -> tuple[int, int]:
    """``(equal, shared)``: of the steps both runs digested their inputs at
    (``input_digest``), how many saw the same inputs."""
    digests_b = {row["step"]: row.get("input_digest") for row in b}
    shared = [
        (row["input_digest"], digests_b[row["step"]])
        for row in a
        if row.get("input_digest") and digests_b.get(row["step"])
    ]
    return sum(x == y for x, y in shared), len(shared)


def speedup(run: Sequence[Mapping], reference: Sequence[Mapping]) -> float | None:
    """``reference``'s median step time over ``run``'s, both over the steady steps
    (from :data:`STEADY_FROM`) the two runs share; None when they share none."""
    walls = {row["step"]: row["wall_ms"] for row in run if row["step"] >= STEADY_FROM}
    ref = {
        row["step"]: row["wall_ms"] for row in reference if row["step"] >= STEADY_FROM
    }
    shared = sorted(set(walls) & set(ref))
    if not shared:
        return None
    return statistics.median(ref[s] for s in shared) / statistics.median(
        walls[s] for s in shared
    )


def steady_summary(run_rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median step time from step :data:`STEADY_FROM` on, and each part's share.

    ``other`` is the wall time outside the marked phases and the data wait:
    Lightning's loop, host work the GPU did not wait for.
    """
    steady = [row for row in run_rows if row["step"] >= STEADY_FROM]
    if not steady:
        return {"steps": 0}
    wall = statistics.median(row["wall_ms"] for row in steady)
    total = sum(row["wall_ms"] for row in steady)

    def share(fields: Sequence[str]) -> float:
        return sum(row.get(f) or 0.0 for row in steady for f in fields) / total

    parts = {
        "data_wait": share(["data_wait_ms"]),
        "forward_backward": share(["forward_ms", "backward_ms"]),
        "clip": share(["clip_ms"]),
        "optimizer_ema": share(["optimizer_ms", "ema_ms"]),
    }
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    peaks = [row["peak_gib"] for row in steady if row.get("peak_gib") is not None]
    return {
        "steps": len(steady),
        "median_ms": wall,
        "shares": parts,
        "peak_gib": max(peaks) if peaks else None,
    }


def format_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """A text table: per newest run its steady step time and shares, and for each
    provider against ``stock-triton`` at the same crop: the speed-up over the steps
    both ran (``vs ref``, :func:`speedup`), the loss and gradient-norm gaps, and
    the number of steps on which both saw the same inputs (``inputs``)."""
    runs = latest_runs(rows)
    lines = [
        f"{'provider':<22}{'tokens':>7}{'steps':>6}{'median s':>10}{'vs ref':>8}"
        f"{'data':>7}"
        f"{'fwd+bwd':>9}{'clip':>7}{'opt+ema':>9}{'other':>7}{'peak GiB':>10}"
        f"{'loss gap':>10}{'gnorm gap':>11}{'inputs':>9}"
    ]
    for (provider, label, n_token), run_rows in sorted(
        runs.items(), key=lambda item: (item[0][2], item[0][0], item[0][1] or "")
    ):
        summary = steady_summary(run_rows)
        name = provider + (f" ({label})" if label else "")
        reference = runs.get(("stock-triton", None, n_token))
        gaps = ["", "", ""]
        ratio = ""
        if reference is not None and reference is not run_rows:
            equal, shared = same_inputs(run_rows, reference)
            faster = speedup(run_rows, reference)
            ratio = "" if faster is None else f"{faster:.2f}x"
            gaps = [
                *(
                    _percent(max_relative_gap(run_rows, reference, field))
                    for field in ("loss", "grad_norm")
                ),
                f"{equal}/{shared}" if shared else "",
            ]
        if not summary["steps"]:
            lines.append(f"{name:<22}{n_token:>7}{len(run_rows):>6}  (no steady steps)")
            continue
        shares = summary["shares"]
        peak = summary["peak_gib"]
        lines.append(
            f"{name:<22}{n_token:>7}{len(run_rows):>6}"
            f"{summary['median_ms'] / 1e3:>10.2f}{ratio:>8}"
            + "".join(
                f"{shares[part]:>{width}.0%}"
                for part, width in (
                    ("data_wait", 7),
                    ("forward_backward", 9),
                    ("clip", 7),
                    ("optimizer_ema", 9),
                    ("other", 7),
                )
            )
            + (f"{peak:>10.1f}" if peak is not None else f"{'':>10}")
            + f"{gaps[0]:>10}{gaps[1]:>11}{gaps[2]:>9}"
        )
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def plot_runs(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``train_run.png``: per crop, the loss, gradient norm (both smoothed over
    :data:`SMOOTHING` steps, raw values faint) and step time of each newest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = latest_runs(rows)
    crops = sorted({key[2] for key in runs})
    fields = (("loss", "loss"), ("grad_norm", "gradient norm"), ("wall_ms", "step s"))
    fig, axes = plt.subplots(
        len(crops), 3, figsize=(13, 3.2 * len(crops)), squeeze=False
    )
    for row_axes, n_token in zip(axes, crops, strict=True):
        for (provider, label, crop), run_rows in sorted(
            runs.items(), key=lambda item: (item[0][0], item[0][1] or "")
        ):
            if crop != n_token:
                continue
            name = provider + (f" ({label})" if label else "")
            for ax, (field, title) in zip(row_axes, fields, strict=True):
                points = [
                    (row["step"], row[field])
                    for row in run_rows
                    if row.get(field) is not None
                ]
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                if field == "wall_ms":
                    ax.plot(steps, [v / 1e3 for v in values], label=name, lw=1)
                else:
                    line = ax.plot(steps, moving_average(values), label=name, lw=1.5)
                    ax.plot(
                        steps, values, color=line[0].get_color(), alpha=0.25, lw=0.8
                    )
                ax.set_title(f"{title}, {n_token} tokens", fontsize=9)
                ax.set_xlabel("optimizer step", fontsize=8)
                ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7)
    gpus = sorted({row.get("gpu") or "?" for rs in runs.values() for row in rs})
    fig.suptitle(f"OF3 training loop, {', '.join(gpus)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "PHASES",
    "SMOOTHING",
    "STEADY_FROM",
    "format_summary",
    "latest_runs",
    "max_relative_gap",
    "moving_average",
    "plot_runs",
    "steady_summary",
]
