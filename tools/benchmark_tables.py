"""Render the tables of ``docs/benchmarks.md`` from the rows of record in
``docs/benchmarks/<source>.json``.

    python -m tools.benchmark_tables          # rewrite the generated blocks
    python -m tools.benchmark_tables --check  # exit 1 when a block is stale

Each :class:`Table` pivots one JSON file: a table row per shape, a column per
provider, and in each cell the provider's latest row of record for that shape
(rows are appended, so the last one in the file wins; rows marked
``superseded_by`` or ``skipped`` and rows outside the table's filter are left out).
Under the table a conditions block lists, from the rows shown, the GPU, the
library versions, the dates and the commits. A block sits between
``<!-- table:<name>:start -->`` and ``<!-- table:<name>:end -->``; the text around
the blocks is written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
JSON_DIR = ROOT / "docs" / "benchmarks"

Row = dict


def _num(value: float) -> str:
    """Three significant figures, without exponent notation."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _mib(value: float) -> str:
    return f"{value:,.0f} MiB" if value < 1024 else f"{value / 1024:.1f} GiB"


def _failure(row: Row) -> str | None:
    """What a row that measured nothing says: out of memory, or the error."""
    if row.get("oom") or row.get("error") == "out of memory":
        return "OOM"
    if row.get("error"):
        return "fails"
    return None


def kernel_cell(row: Row) -> str:
    """``ms / peak`` of a kernel or module row (milliseconds, peak memory)."""
    return _failure(row) or f"{_num(row['ms'])} / {_mib(row['peak_mib'])}"


def step_cell(row: Row) -> str:
    """``s / GiB`` of a training-step or prediction row (time, peak memory)."""
    failure = _failure(row)
    if failure:
        return failure
    return f"{row['ms'] / 1000:.2f} s / {row['peak_gib']:.1f} GiB"


def window_cell(row: Row) -> str:
    """A collective's GEMM window: its milliseconds and the share of the
    collective's transfer it can hide."""
    hidden = min(1.0, row["ms"] / row["transfer_ms"])
    return f"{row['ms']:.2f} ms ({hidden:.0%})"


def ms_value(row: Row) -> float | None:
    return None if _failure(row) else row.get("ms")


@dataclass(frozen=True)
class Table:
    """One generated table.

    Attributes:
        name: the marker name in ``docs/benchmarks.md``.
        source: the JSON file's stem under ``docs/benchmarks/``.
        shape: fields naming a table row (the cells' common shape).
        providers: the provider columns, in order; providers without a row for
            any shape are dropped.
        include: which rows of record the table draws on.
        cell: a row's cell text.
        ratio: ``(baseline, kit)``: adds a column ``baseline ms / kit ms``.
        labels: column headers for ``shape`` fields (the field name otherwise).
        needs: the field a row must carry to be shown (or a failure: out of
            memory, an error).
    """

    name: str
    source: str
    shape: tuple[str, ...]
    providers: tuple[str, ...]
    include: Callable[[Row], bool] = lambda row: True
    cell: Callable[[Row], str] = kernel_cell
    ratio: tuple[str, str] | None = None
    labels: tuple[str, ...] = ()
    needs: str = "ms"


def _fwd_bwd(row: Row) -> bool:
    return row.get("mode") == "fwd+bwd"


def _predict_of_record(row: Row) -> bool:
    """A prediction row of the table: OF3's zero output layers drawn at bench
    predict's gain, and all 48 of the pairformer stack's blocks run (a walk with
    ``--ladder-pairformer-blocks`` is for its peak; its times are not the model's)."""
    return "output_gain" in row and row.get("pairformer_blocks", 48) == 48


def _step_of_record(row: Row) -> bool:
    """Training steps at OF3's recycle draw (3), in OF3's fp32 matmul precision,
    or in TF32 where the provider says so (``kit-tf32``, ``stock-cueq-tf32``)."""
    precision = "high" if row.get("provider", "").endswith("-tf32") else "highest"
    return (
        row.get("mode") == "step"
        and row.get("recycles") == 3
        and not row.get("variant")
        and row.get("matmul_precision") == precision
    )


TABLES: tuple[Table, ...] = (
    Table(
        "attention_core",
        "attention_core",
        ("case", "shape", "dtype"),
        ("kit", "of3-triton", "sdpa", "torch", "cueq", "deepspeed"),
        include=_fwd_bwd,
        ratio=("of3-triton", "kit"),
        labels=("case", "shape [B,S,N,H,D]", "dtype"),
    ),
    Table(
        "attention_module",
        "attention_module",
        ("case", "n"),
        ("kit", "of3-triton", "stock", "of3-cueq", "of3-deepspeed"),
        include=lambda row: not row.get("variant"),
        ratio=("of3-triton", "kit"),
        labels=("module", "N"),
    ),
    Table(
        "transition",
        "transition",
        ("case", "shape", "dtype"),
        ("kit", "of3-compile", "of3-eager", "liger"),
        include=_fwd_bwd,
        ratio=("of3-compile", "kit"),
        labels=("transition", "shape", "dtype"),
    ),
    Table(
        "triangle_multiplication",
        "triangle_multiplication",
        ("case", "shape", "dtype"),
        ("kit", "of3-cueq", "of3-compile", "of3-eager"),
        include=_fwd_bwd,
        ratio=("of3-eager", "kit"),
        labels=("direction", "shape", "dtype"),
    ),
    Table(
        "smooth_lddt",
        "smooth_lddt",
        ("dtype", "n_atom", "samples"),
        (
            "kit-fused",
            "kit-ball-query-128",
            "kit-ball-query-256",
            "kit-ball-query-512",
            "kit-ball-query-256-det",
            "of3-compile",
            "of3-dense",
        ),
        include=_fwd_bwd,
        ratio=("of3-dense", "kit-fused"),
        labels=("dtype", "atoms", "samples"),
    ),
    Table(
        "step",
        "step",
        ("gpu", "n_token"),
        (
            "kit",
            "kit-without-checkpoint_offload",
            "stock-triton",
            "stock",
            "stock-cueq-tf32",
            "kit-tf32",
        ),
        include=_step_of_record,
        cell=step_cell,
        ratio=("stock-triton", "kit"),
        labels=("GPU", "tokens"),
    ),
    Table(
        "max_crop",
        "step",
        ("config",),
        ("kit", "stock-triton", "stock"),
        include=lambda row: row.get("mode") == "max_crop",
        cell=lambda row: f"{row['max_crop']} tokens",
        labels=("model",),
        needs="max_crop",
    ),
    Table(
        "step_sp",
        "step_sp",
        ("n_token", "sp_size", "recycles"),
        ("kit+sp2",),
        include=lambda row: row.get("mode") == "step_sp",
        cell=step_cell,
        labels=("tokens", "GPUs", "recycles"),
    ),
    Table(
        "sp_trimul_compute",
        "sp_trimul_schedule",
        ("n_token", "sp_size"),
        ("shard", "whole/P"),
        cell=lambda row: f"{_num(row['ms'])} ms",
        ratio=("whole/P", "shard"),
        labels=("tokens", "SP"),
    ),
    Table(
        "sp_trimul_windows",
        "sp_trimul_schedule",
        ("n_token", "sp_size", "transfer_ms"),
        ("forward gather", "backward gather", "reduce-scatter"),
        include=lambda row: row["provider"] not in ("shard", "whole/P"),
        cell=window_cell,
        labels=("tokens", "SP", "transfer (ms)"),
    ),
    Table(
        "predict",
        "predict",
        ("n_token", "rollout_steps", "recycles"),
        ("kit", "stock-triton", "stock"),
        include=_predict_of_record,
        cell=step_cell,
        ratio=("stock-triton", "kit"),
        labels=("tokens", "rollout steps", "recycles"),
    ),
    Table(
        "features",
        "features",
        ("dataset", "token_budget", "cpus"),
        ("kit-store-pool8", "kit-store", "of3"),
        cell=lambda row: f"{_num(row['ms'])} ms",
        ratio=("of3", "kit-store-pool8"),
        labels=("data set", "crop (tokens)", "CPU cores"),
    ),
)


def load_rows(path: Path) -> list[Row]:
    """The rows of one JSON file; a missing or broken file is an error naming it."""
    try:
        rows = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"Error: {path}: no such file; run the benchmark first"
        ) from None
    except json.JSONDecodeError as err:
        raise SystemExit(
            f"Error: {path}: not valid JSON ({err}); fix or restore it"
        ) from None
    if not isinstance(rows, list):
        raise SystemExit(f"Error: {path}: expected a JSON list of rows")
    return rows


def current_rows(table: Table, rows: Iterable[Row]) -> dict[tuple, dict[str, Row]]:
    """shape -> provider -> the latest row of record for that pair."""
    latest: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        if row.get("superseded_by") or row.get("skipped") or not table.include(row):
            continue
        if row.get("provider") not in table.providers:
            continue
        if row.get(table.needs) is None and _failure(row) is None:
            continue
        shape = tuple(row.get(field) for field in table.shape)
        latest.setdefault(shape, {})[row["provider"]] = row
    return latest


def _sort_key(shape: tuple) -> list:
    """Natural order: numbers inside strings compare as numbers (``1x384`` first)."""
    parts: list = []
    for value in shape:
        for text, digits in re.findall(r"(\D*)(\d*)", str(value)):
            parts += [text, int(digits) if digits else -1]
    return parts


def _short_commit(commit: str) -> str:
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]*", r"\1", commit)


def conditions(rows: Sequence[Row]) -> str:
    """One line per condition, from the rows a table shows."""

    def values(field: str) -> str:
        found = sorted({str(row.get(field)) for row in rows})
        return ", ".join(found)

    dates = sorted(str(row.get("date", ""))[:10] for row in rows)
    commits = sorted({_short_commit(str(row.get("commit"))) for row in rows})
    date = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return "\n".join(
        [
            f"- GPU: {values('gpu')}"
            + (f"; CUDA {values('cuda')}" if any(r.get("cuda") for r in rows) else ""),
            f"- torch {values('torch')}; triton {values('triton')}; "
            f"openfold3 {values('openfold3')}",
            f"- date: {date}",
            f"- commit: {', '.join(commits)}",
        ]
    )


def render(table: Table, rows: Iterable[Row]) -> str:
    """The Markdown table and its conditions block."""
    latest = current_rows(table, rows)
    if not latest:
        return "(no rows of record)"
    providers = [p for p in table.providers if any(p in c for c in latest.values())]
    labels = table.labels or table.shape
    header = [*labels, *providers]
    if table.ratio:
        header.append(f"{table.ratio[0]} time / {table.ratio[1]} time")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    shown: list[Row] = []
    for shape in sorted(latest, key=_sort_key):
        cells = latest[shape]
        line = [str(v) for v in shape]
        line += [table.cell(cells[p]) if p in cells else "" for p in providers]
        shown += cells.values()
        if table.ratio:
            base, kit = (cells.get(p) for p in table.ratio)
            base_ms = ms_value(base) if base else None
            kit_ms = ms_value(kit) if kit else None
            line.append(f"{base_ms / kit_ms:.2f}x" if base_ms and kit_ms else "")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n\n" + conditions(shown)


def _block(name: str) -> re.Pattern:
    """A table's block: its start marker line, the body, its end marker."""
    start = re.escape(f"<!-- table:{name}:start -->")
    end = re.escape(f"<!-- table:{name}:end -->")
    return re.compile(rf"({start}\n)(.*?)({end})", re.DOTALL)


def rewrite(text: str, tables: Sequence[Table], json_dir: Path) -> str:
    """``text`` with every table's block replaced by its rendering."""
    for table in tables:
        pattern = _block(table.name)
        if not pattern.search(text):
            raise SystemExit(
                f"Error: no block for table {table.name!r}: add "
                f"<!-- table:{table.name}:start --> and "
                f"<!-- table:{table.name}:end --> lines where it belongs"
            )
        body = render(table, load_rows(json_dir / f"{table.source}.json"))
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(3), text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a block is stale"
    )
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--json-dir", type=Path, default=JSON_DIR)
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    updated = rewrite(text, TABLES, args.json_dir)
    if args.check:
        if updated != text:
            print(
                f"Error: {args.doc}: generated tables are stale; "
                "run python -m tools.benchmark_tables",
                file=sys.stderr,
            )
            return 1
        return 0
    if updated != text:
        args.doc.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
