"""Render ``docs/benchmarks/<what>.json`` into ``docs/benchmarks/<what>.png``.

Usage::

    python -m tools.plot_benchmarks                 # every known JSON present
    python -m tools.plot_benchmarks step smooth_lddt --dir docs/benchmarks
    python -m tools.plot_benchmarks --x n_atom smooth_lddt

One generic plotter for every benchmark, keyed on the row fields:

- x: a size field. ``--x`` names it; otherwise the first of :data:`SIZE_FIELDS`
  with at least two numeric values among the rows, else any integer field whose
  name starts with ``n`` and that varies.
- y: ``ms`` (left panel, log scale) and peak memory in MiB (right panel; from
  ``peak_mib``, or ``peak_gib`` converted).
- one line per provider / dtype / precision / variant / recycle count (the fields
  that are present);
- one row of panels per combination of the other text fields that vary (a case
  name, ``mode``, ``config``, the GPU when rows come from several).

Rows without a time (out-of-memory rows, search summaries) are left out, and so are
rows with a ``superseded_by`` field: measurements of a defect that a later commit
fixed (the field names it and says why), kept in the JSON as the record of what was
measured. When a point was measured several times, the newest row (by ``date``)
wins. Missing or empty files are reported and skipped, never an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

KNOWN_BENCHMARKS = (
    "step",
    "attention_core",
    "attention_module",
    "smooth_lddt",
    "transition",
    "triangle_multiplication",
)
SIZE_FIELDS = ("n_token", "n_atom", "n", "N", "seq_len", "n_res", "size")
# The recycle count is a series of its own: a step with 3 trunk recycles is not
# comparable with one with 1 (OF3's seeded draw or ``--num-recycles``).
SERIES_FIELDS = frozenset({"provider", "dtype", "precision", "variant", "recycles"})
SERIES_ORDER = ("provider", "dtype", "precision", "variant", "recycles")
# Text fields that never split rows into panels: they identify the run, not the case.
IDENTITY_FIELDS = frozenset(
    {
        "torch",
        "triton",
        "openfold3",
        "of3_megafold",
        "commit",
        "commit_source",
        "alloc_conf",
        "date",
        "cuda",
        "python",
        "bench",
        "matmul_precision",
        "permutation_alignment",
        "note",
        "superseded_by",
        "probe_process",
    }
)
# Measured or derived values: never a reason to split rows into panels.
RESULT_FIELDS = frozenset(
    {
        "ms",
        "peak_mib",
        "peak_gib",
        "start_gib",
        "step_ms",
        "first_step_ms",
        "launches",
        "loss",
        "oom",
        "warmup",
        "repeats",
        "params_m",
        "no_samples",
        "n_atom",
        "max_crop",
        "decided",
        "ladder",
    }
)
# Case fields that always get their own panels when they vary.
ALWAYS_FACET = ("case", "mode", "config", "gpu")
MAX_FACETS = 8

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a benchmark JSON file; ``[]`` (with a message) if missing or bad."""
    if not path.exists():
        print(f"skip {path}: no such file", file=sys.stderr)
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        print(f"skip {path}: not valid JSON ({error})", file=sys.stderr)
        return []
    if not isinstance(rows, list):
        print(f"skip {path}: expected a JSON list of rows", file=sys.stderr)
        return []
    return [row for row in rows if isinstance(row, dict)]


def memory_mib(row: dict[str, Any]) -> float | None:
    """Peak memory of a row in MiB (``peak_mib`` or ``peak_gib``), if any."""
    if _is_number(row.get("peak_mib")):
        return float(row["peak_mib"])
    if _is_number(row.get("peak_gib")):
        return float(row["peak_gib"]) * 1024
    return None


def choose_x_field(rows: Sequence[dict[str, Any]], requested: str | None = None) -> str:
    """The size field to put on the x axis (see the module docstring)."""
    if requested is not None:
        if not any(_is_number(row.get(requested)) for row in rows):
            raise ValueError(f"no row has a numeric {requested!r} field")
        return requested

    def distinct(field: str) -> int:
        return len({row[field] for row in rows if _is_number(row.get(field))})

    for field in SIZE_FIELDS:
        if distinct(field) >= 2:
            return field
    candidates = sorted(
        {
            key
            for row in rows
            for key, value in row.items()
            if key.lower().startswith("n")
            and isinstance(value, int)
            and not isinstance(value, bool)
        },
        key=lambda field: -distinct(field),
    )
    if candidates and distinct(candidates[0]) >= 2:
        return candidates[0]
    for field in SIZE_FIELDS:
        if distinct(field) == 1:
            return field
    raise ValueError("no size field found to use as x axis")


def series_label(row: dict[str, Any]) -> str:
    parts = [
        f"{row[field]} recycle{'s' * (row[field] != 1)}"
        if field == "recycles"
        else str(row[field])
        for field in SERIES_ORDER
        if row.get(field) is not None
    ]
    return " / ".join(parts) or "rows"


def facet_fields(rows: Sequence[dict[str, Any]], x_field: str) -> list[str]:
    """Fields that split rows into panels.

    Candidates are text or integer case fields (not series, identity or result
    fields, not the x field) with more than one value. Those in
    :data:`ALWAYS_FACET` are kept; any other only if it tells apart rows that the
    kept fields, the series and x do not. So a ``shape`` string spelling out the
    size, a head count fixed by the case or a dtype fixed by the provider does not
    split the plot into panels of one point.
    """
    candidates = []
    for key in sorted({key for row in rows for key in row}):
        if key in IDENTITY_FIELDS | SERIES_FIELDS | RESULT_FIELDS or key == x_field:
            continue
        values = [row.get(key) for row in rows]
        case_like = all(
            value is None
            or isinstance(value, str)
            or (isinstance(value, int) and not isinstance(value, bool))
            for value in values
        )
        if case_like and len(set(values)) > 1:
            candidates.append(key)

    def distinct(fields: list[str]) -> int:
        key = [*fields, *SERIES_ORDER, x_field]
        return len({tuple(row.get(f) for f in key) for row in rows})

    kept = [field for field in candidates if field in ALWAYS_FACET]
    for field in candidates:
        if field not in kept and distinct([*kept, field]) > distinct(kept):
            kept.append(field)
    return kept


def newest_per_point(
    rows: Iterable[dict[str, Any]], key_fields: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per distinct ``key_fields`` tuple: the one with the latest ``date``."""
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = tuple(json.dumps(row.get(field), sort_keys=True) for field in key_fields)
        if key not in best or str(row.get("date", "")) >= str(
            best[key].get("date", "")
        ):
            best[key] = row
    return list(best.values())


Point = tuple[float, float, "float | None"]


def prepare(
    rows: Sequence[dict[str, Any]], x_field: str | None = None
) -> tuple[str, dict[tuple, dict[str, list[Point]]]]:
    """Group plottable rows into ``{facet: {series: [(x, ms, MiB), ...]}}``.

    Returns the x field and the groups (points sorted by x). Facet keys are tuples
    of ``(field, value)`` pairs. A point measured more than once keeps its newest
    row.
    """
    timed = [
        row
        for row in rows
        if _is_number(row.get("ms")) and not row.get("superseded_by")
    ]
    if not timed:
        return x_field or "", {}
    x_field = choose_x_field(timed, x_field)
    timed = [row for row in timed if _is_number(row.get(x_field))]
    facets = facet_fields(timed, x_field)
    groups: dict[tuple, dict[str, list[Point]]] = defaultdict(lambda: defaultdict(list))
    for row in newest_per_point(timed, [*facets, *SERIES_ORDER, x_field]):
        facet = tuple((field, row.get(field)) for field in facets)
        groups[facet][series_label(row)].append(
            (float(row[x_field]), float(row["ms"]), memory_mib(row))
        )
    for series in groups.values():
        for points in series.values():
            points.sort()
    return x_field, {facet: dict(series) for facet, series in groups.items()}


def facet_title(facet: tuple) -> str:
    return ", ".join(f"{field}={value}" for field, value in facet if value is not None)


def plot(
    rows: Sequence[dict[str, Any]],
    title: str,
    out_png: Path,
    x_field: str | None = None,
) -> bool:
    """Draw ``rows`` into ``out_png``. Returns False (no file) if nothing to plot."""
    x_field, groups = prepare(rows, x_field)
    if not groups:
        print(f"skip {title}: no rows with a time", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facets = sorted(groups, key=lambda f: json.dumps(f, default=str))
    if len(facets) > MAX_FACETS:
        print(
            f"{title}: plotting the first {MAX_FACETS} of {len(facets)} panels",
            file=sys.stderr,
        )
        facets = facets[:MAX_FACETS]
    fig, axes = plt.subplots(
        len(facets), 2, figsize=(13, 3.8 * len(facets)), squeeze=False
    )
    # One colour per provider and one line style per dtype/precision, so more
    # series than a colour cycle holds stay apart.
    labels = sorted({label for series in groups.values() for label in series})
    providers = sorted({label.split(" / ")[0] for label in labels})
    variants = sorted({" / ".join(label.split(" / ")[1:]) for label in labels})
    colours = plt.get_cmap("tab10" if len(providers) <= 10 else "tab20")
    styles = ["-", "--", ":", "-."]

    def style(label: str) -> dict:
        provider, *rest = label.split(" / ")
        return {
            "color": colours(providers.index(provider) % colours.N),
            "linestyle": styles[variants.index(" / ".join(rest)) % len(styles)],
            "marker": "o",
            "label": label,
        }

    for (time_ax, mem_ax), facet in zip(axes, facets, strict=True):
        for label, points in sorted(groups[facet].items()):
            xs = [p[0] for p in points]
            time_ax.plot(xs, [p[1] for p in points], **style(label))
            mem = [(p[0], p[2]) for p in points if p[2] is not None]
            if mem:
                mem_ax.plot(*zip(*mem, strict=True), **style(label))
        subtitle = facet_title(facet)
        time_ax.set_title(
            f"{title}: time" + (f" ({subtitle})" if subtitle else ""), fontsize=9
        )
        mem_ax.set_title(
            f"{title}: peak memory" + (f" ({subtitle})" if subtitle else ""), fontsize=9
        )
        time_ax.set_ylabel("ms (median)")
        time_ax.set_yscale("log")
        mem_ax.set_ylabel("peak MiB")
        if mem_ax.lines:
            mem_ax.set_yscale("log")  # kernels use MiB where dense paths use GiB
        for ax in (time_ax, mem_ax):
            ax.set_xlabel(x_field)
            ax.grid(True, alpha=0.3)
        if mem_ax.lines or time_ax.lines:
            (mem_ax if mem_ax.lines else time_ax).legend(
                fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0)
            )
        for ax in (time_ax, mem_ax):
            if not ax.lines:
                ax.text(
                    0.5,
                    0.5,
                    "no data (e.g. no memory statistics on CPU)",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                )
    gpus = sorted({str(row["gpu"]) for row in rows if row.get("gpu")})
    if gpus:
        fig.suptitle(", ".join(gpus), fontsize=9)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


def render(
    directory: Path, names: Sequence[str] = KNOWN_BENCHMARKS, x_field: str | None = None
) -> list[Path]:
    """Render ``<directory>/<name>.json`` to ``<name>.png`` for each name present.

    Returns the PNG files written.
    """
    written = []
    for name in names:
        json_path = directory / f"{name}.json"
        rows = load_rows(json_path)
        if not rows:
            continue
        png = directory / f"{name}.png"
        if plot(rows, name, png, x_field):
            print(f"wrote {png}")
            written.append(png)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names",
        nargs="*",
        default=list(KNOWN_BENCHMARKS),
        help="benchmarks to render (default: all known)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="directory holding <name>.json (default: %(default)s)",
    )
    parser.add_argument(
        "--x",
        dest="x_field",
        default=None,
        help="row field for the x axis (default: detected)",
    )
    args = parser.parse_args(argv)
    render(args.dir, args.names, args.x_field)
    return 0


if __name__ == "__main__":
    sys.exit(main())
