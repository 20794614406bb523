"""The full-model training-step evidence on one GPU, in one run.

    python -m tools.gpu_step OUT.json [--providers stock,stock-triton,kit]
        [--tokens 384,768] [--repeats 2] [--ladder 768,1024,1280,1536] [--no-max-crop]

For each provider (default: ``stock``, ``stock-triton`` and, when the kit's registry
offers it, ``kit`` = every available extension on): the full OF3 model (train
preset, 368 M parameters, 48 diffusion samples, bf16 autocast) on a random batch
with 1024 MSA rows and 4 templates, at 384 and 768 tokens (two warm-up steps, then
``--repeats`` timed steps; kernel launches counted in one profiled step at 384).
Then, once every provider is timed, the largest trainable crop of each: one step
per size on ``--ladder``, starting near the known limits (baseline table D in
docs/benchmarks.md: 768 stock, 1280 OF3 Triton) and walking up until out of memory
(or down until a size fits). Each probe runs in a new process, as a training run at
that crop would (``--same-process-probes``: one model per search; on the H200 a
probe after another then ran out of memory at a size a fresh process fitted).

Time on an H200, from table D: timing ~1.5 min per provider (384: 4 x ~7.5 s, 768:
3 x ~20 s), then the searches: stock ~20 s (1024 runs out of memory), stock-triton
~2 min (1280 at ~70 s, 1536 out of memory), kit up to ~2.5 min. So about 5.5 min
for stock and stock-triton and 9 min with kit: split long runs with
``--providers`` (or ``--repeats 1``, ``--no-max-crop``). Rows are appended to
OUT.json as they are measured, so a run cut short keeps what it measured; a
compact table is printed at the end. The logic lives in
:mod:`of3_megafold.bench.step`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from of3_megafold.bench.common import parse_ints

# Start near the limits of baseline table D (docs/benchmarks.md); skips ~1 min of
# probing.
MAX_CROP_START = {"stock": 1024, "stock-triton": 1280, "kit": 1280}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_json", type=Path, help="JSON file to append rows to")
    parser.add_argument(
        "--providers",
        default=None,
        help="comma-separated providers (default: stock,stock-triton[,kit]; "
        "kit-without-<extension> is the kit less one extension)",
    )
    parser.add_argument("--tokens", type=parse_ints, default=[384, 768])
    parser.add_argument("--launch-tokens", type=parse_ints, default=[384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ladder", type=parse_ints, default=[768, 1024, 1280, 1536])
    parser.add_argument("--no-max-crop", action="store_true")
    parser.add_argument(
        "--same-process-probes",
        action="store_true",
        help="run a provider's max-crop probes on one model in this process (each "
        "probe then inherits the allocator's state from the one before) instead of "
        "one new process per probe",
    )
    parser.add_argument(
        "--num-recycles",
        type=int,
        default=None,
        help="fixed recycle count per step (OF3 draws 0-3 in training; default: "
        "OF3's first draw, 3 with the default sync seed)",
    )
    parser.add_argument("--n-msa", type=int, default=1024)
    parser.add_argument("--n-templ", type=int, default=4)
    parser.add_argument(
        "--config",
        default="full",
        help="model config; 'tiny' (with small --tokens and --ladder) is a CPU "
        "dry run of this script",
    )
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    import torch

    from of3_megafold.bench.common import environment_metadata
    from of3_megafold.bench.step import (
        available_providers,
        format_table,
        run_step_bench,
    )

    if args.config == "full" and not torch.cuda.is_available():
        print("gpu_step.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.providers:
        providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        offered = available_providers(device)
        providers = [p for p in ("stock", "stock-triton", "kit") if p in offered]
    meta = environment_metadata()
    print(
        f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | "
        f"openfold3 {meta['openfold3']} | commit {meta['commit']}\n"
        f"providers: {', '.join(providers)}",
        flush=True,
    )
    started = time.perf_counter()
    rows = run_step_bench(
        providers=providers,
        tokens=args.tokens,
        n_msa=args.n_msa,
        n_templ=args.n_templ,
        config=args.config,
        repeats=args.repeats,
        warmup=args.warmup,
        out_json=args.out_json,
        max_crop=not args.no_max_crop,
        max_crop_ladder=args.ladder,
        max_crop_start=MAX_CROP_START,
        launch_tokens=args.launch_tokens,
        num_recycles=args.num_recycles,
        fresh_probes=not args.same_process_probes,
    )
    print(format_table(rows))
    print(
        f"{len(rows)} rows appended to {args.out_json} in "
        f"{time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
