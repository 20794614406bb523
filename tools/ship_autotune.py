"""Turn Triton's on-disk autotuning results into the kit's shipped choices.

    python -m tools.ship_autotune DIR [--gpu "NVIDIA H200"] [--merge]

``DIR`` holds ``*.autotune.json`` files from Triton's cache (``cache_results``), e.g.
the ``triton-autotune.tgz`` that ``tools/gpu_session.sh`` sends back, unpacked. For
every EvoFlash kernel and tuning key it keeps the configuration with the lowest median
time in the tuning run that compared the most configurations (see :func:`collect`)
and writes
``of3_megafold/kernels/evoflash/tuned/<gpu>.json``, which
:class:`of3_megafold.kernels._launch.TunedKernel` uses instead of tuning that key again
on a GPU of that name. The table records, per kernel, the fingerprint of its current
config list (``configs.lists_fingerprint``): run this on tuning results made with those
lists. If a kernel's list changes, the kit ignores that kernel's entries until it is
rebuilt.

``--merge`` keeps the shipped table's other keys and replaces or adds only the keys
tuned in ``DIR`` (a session that tuned a few new shapes or a new kernel); a kernel
whose list changed since the table was built keeps none of its old entries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from of3_megafold.kernels.evoflash.configs import lists_fingerprint
from of3_megafold.kernels.evoflash.tuned import (
    KERNELS,
    current_entries,
    tuned_path,
)


def collect(directory: Path) -> dict[str, dict[tuple, tuple[float, dict]]]:
    """kernel -> tuning key -> (best median ms, config).

    Timings are compared only within one tuning run (one file): a key buckets the
    sequence length, so runs at different lengths (N = 768 and 1024 share a key)
    or on different machines are not comparable. Per key the run that compared
    the most configurations wins (a run over the current candidate lists beats a
    run over an older, shorter list), the newest file among equals."""
    runs: dict[str, dict[tuple, tuple[tuple[int, float], float, dict]]] = {
        name: {} for name in KERNELS
    }
    for path in sorted(directory.rglob("*.autotune.json")):
        kernel = path.name.removesuffix(".autotune.json")
        if kernel not in runs:
            continue
        data = json.loads(path.read_text())
        key = tuple(data["key"])
        timed = []
        for config, timings in data["configs_timings"]:
            median = timings[0] if isinstance(timings, list) else timings
            entry = {
                "kwargs": config["kwargs"],
                "num_warps": config["num_warps"],
                "num_stages": config["num_stages"],
            }
            timed.append((median, entry))
        if not timed:
            continue
        rank = (len(timed), path.stat().st_mtime)
        median, entry = min(timed, key=lambda t: t[0])
        if key not in runs[kernel] or rank > runs[kernel][key][0]:
            runs[kernel][key] = (rank, median, entry)
    return {
        kernel: {key: (median, entry) for key, (_, median, entry) in keys.items()}
        for kernel, keys in runs.items()
    }


def merged(shipped: dict, best: dict) -> dict[str, dict[tuple, tuple[float, dict]]]:
    """``best`` over the ``shipped`` table's entries: the new keys win. The shipped
    entries of a kernel whose candidate list changed since are dropped."""
    current, stale = current_entries(shipped)
    for kernel in stale:
        print(f"{kernel}: the shipped entries were tuned over another config list; "
              "dropped")
    result = {}
    for kernel in KERNELS:
        keys = {
            tuple(entry["key"]): (entry["ms"], {
                name: entry[name] for name in ("kwargs", "num_warps", "num_stages")
            })
            for entry in current.get(kernel, [])
        }
        keys.update(best.get(kernel, {}))
        result[kernel] = keys
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--gpu", default="NVIDIA H200")
    parser.add_argument("--source", default="", help="where the timings came from")
    parser.add_argument("--merge", action="store_true",
                        help="keep the shipped table's keys that DIR did not tune")
    args = parser.parse_args()
    best = collect(args.directory)
    out = tuned_path(args.gpu)
    if args.merge:
        best = merged(json.loads(out.read_text()), best)
    table = {
        "gpu": args.gpu,
        "source": args.source,
        "lists": {kernel: lists_fingerprint(kernel) for kernel in KERNELS},
        "kernels": {
            kernel: [
                {"key": list(key), "ms": round(ms, 4), **entry}
                for key, (ms, entry) in sorted(keys.items(), key=lambda kv: str(kv[0]))
            ]
            for kernel, keys in best.items()
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    counts = ", ".join(f"{k} {len(v)}" for k, v in best.items())
    print(f"wrote {out} ({counts} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
