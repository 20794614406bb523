"""Where a full-model training step spends its time, per kit extension, on one GPU.

    python -m tools.gpu_profile_step OUT.txt [--tokens 384,768] [--repeats 2]
        [--provider kit] [--variants kit,kit-smooth_lddt,stock,...]
        [--num-recycles 1] [--no-profile]

Builds the full OF3 model once (the step harness of :mod:`of3_megafold.bench.step`,
provider ``--provider``), and at each token count runs one warm-up step per variant
(compilation, autotuning), then ``--repeats`` rounds of one step per variant,
interleaved, toggling the runner-YAML flags on the live config between steps (OF3
and the kit read them at call time):

- ``kit``: every extension on; ``<extension>``: that one alone;
- ``kit - <extension>`` (or ``kit-<extension>``): one extension switched back to stock;
- ``stock``: every extension off; ``stock-triton``: OF3's own Triton kernels on.

Then (unless ``--no-profile``) profiles one step of every variant and prints the
GPU time per kernel (top 25) and the total, so wall time above kernel time (host
overhead) shows. ``--sync-debug`` runs one more step per variant under
``torch.cuda.set_sync_debug_mode("warn")`` and counts the host-device
synchronisations by the innermost kit or OF3 source line that caused them: a sync
stops the host from running ahead of the GPU, so a step that is launch-bound pays
host time and GPU time one after the other. Diagnostic only; the benchmark rows come
from ``bench step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

FLAGS = {
    "evoflash_attention": ("memory", "use_evoflash_attention"),
    "evofusion_transitions": ("memory", "use_evofusion_transitions"),
    "evofusion_triangle_multiplication": (
        "memory", "use_evofusion_triangle_multiplication"
    ),
    "smooth_lddt": ("loss", "smooth_lddt_backend"),
    "rollout_graphs": ("memory", "use_rollout_cuda_graphs"),
    "trunk_graphs": ("memory", "use_trunk_cuda_graphs"),
    "sync_free_indexing": ("memory", "use_sync_free_indexing"),
}


def _set(config, extension: str, on: bool) -> None:
    kind, key = FLAGS[extension]
    if kind == "memory":
        for mode in ("train", "eval"):
            config.settings.memory[mode][key] = on
    else:
        config.architecture.loss_module.diffusion[key] = "fused" if on else "dense"


def _set_triton(config, on: bool) -> None:
    for mode in ("train", "eval"):
        config.settings.memory[mode]["use_triton_triangle_kernels"] = on


VARIANTS = ("kit", *(f"kit - {ext}" for ext in FLAGS), *FLAGS, "stock", "stock-triton")


def _variant(config, name: str) -> None:
    """Set the flags of variant ``name``: ``kit`` (all on), ``kit - <ext>``,
    ``<ext>`` alone, ``stock`` (all off) or ``stock-triton``."""
    on = {
        ext: name in ("kit", ext) or (name.startswith("kit - ") and ext != name[6:])
        for ext in FLAGS
    }
    for ext, value in on.items():
        _set(config, ext, value)
    _set_triton(config, name == "stock-triton")


def _kernel_table(prof, lines: list[str], title: str) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 1e3
    lines.append(
        f"== {title}: GPU kernel time {total:.0f} ms, "
        f"{sum(e.count for e in events)} kernels"
    )
    for e in events[:25]:
        lines.append(
            f"   {e.device_time_total / 1e3:9.1f} ms  x{e.count:<6d} {e.key[:100]}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", default="384", help="comma-separated sizes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--provider",
        default="kit",
        help="provider the model is built with (step harness name)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from: {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--num-recycles",
        type=int,
        default=None,
        help="fixed recycle count (default: OF3's seeded draw, 3 at 384 and 768)",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="count host-device synchronisations per variant, by source line",
    )
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the kernel tables and autotuning choices",
    )
    args = parser.parse_args()
    # "kit-<extension>" is accepted for "kit - <extension>" (no spaces: shell-friendly).
    variants = [
        f"kit - {v.strip()[4:]}" if v.strip()[4:] in FLAGS else v.strip()
        for v in args.variants.split(",")
        if v.strip()
    ]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)
        args.out.write_text("\n".join(lines) + "\n")

    started = time.perf_counter()
    harness = TrainingStepHarness(
        "full", args.provider, "cuda", num_recycles=args.num_recycles
    )
    say(f"model built for {args.provider} in {time.perf_counter() - started:.0f} s")
    for n_token in (int(t) for t in args.tokens.split(",")):
        batch = random_training_batch(n_token, 1024, 4, "cuda")
        # One warm-up step per variant (a new kernel path may compile or tune),
        # then the variants interleaved, so drift of a shared machine hits all.
        for name in variants:
            _variant(harness.config, name)
            started = time.perf_counter()
            harness.step(batch)
            took = time.perf_counter() - started
            say(f"{n_token} tokens, {name}: warm-up {took:.0f} s")
        ms = {name: [] for name in variants}
        peak = {}
        for _ in range(args.repeats):
            for name in variants:
                _variant(harness.config, name)
                result = harness.step(batch)
                ms[name].append(result.ms)
                peak[name] = max(peak.get(name, 0.0), result.peak_gib or 0.0)
        for name in variants:
            say(
                f"{n_token} tokens, {name:30} {statistics.median(ms[name]) / 1e3:7.2f} "
                f"s/step ({', '.join(f'{m / 1e3:.2f}' for m in ms[name])}), "
                f"peak {peak[name]:.1f} GiB"
            )
        if args.sync_debug:
            for name in variants:
                _variant(harness.config, name)
                _sync_sites(harness, batch, f"{n_token} tokens, {name}", say)
        if args.no_profile:
            continue
        for name in variants:
            _variant(harness.config, name)
            harness.step(batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall = harness.step(batch).ms
            _kernel_table(prof, lines, f"{n_token} tokens, {name}, wall {wall:.0f} ms")
            say(f"(profiled {name})")
        del batch
    if not args.no_profile:
        _autotune_choices(say)
    return 0


def _sync_sites(harness, batch, title: str, say) -> None:
    """One step under CUDA sync debug mode; print its synchronisations per site."""
    import collections
    import traceback
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [
            f
            for f in traceback.extract_stack()[:-1]
            if ("of3_megafold" in f.filename or "openfold3" in f.filename)
            and "bench/step.py" not in f.filename
        ]
        if ours:
            f = ours[-1]
            path = f.filename.split("site-packages/")[-1].split("/work/")[-1]
            sites[f"{path}:{f.lineno} ({f.name})"] += 1
        else:
            sites[f"{filename}:{lineno}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            harness.step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    say(f"== {title}: {sum(sites.values())} synchronisations")
    for site, count in sites.most_common(20):
        say(f"   {count:6d}  {site}")


def _autotune_choices(say) -> None:
    """The configs the autotuners picked, per key (to prune the tuning lists)."""
    from of3_megafold.kernels.evoflash import function as evoflash
    from of3_megafold.kernels.swiglu_transition import _bwd, _fwd

    tuners = {
        "evoflash fwd": evoflash._fwd,
        "evoflash dq": evoflash._dq,
        "evoflash dkdv": evoflash._dkdv,
        "evoflash dbias": evoflash._dbias,
        "swiglu fwd": _fwd._swiglu_transition_fwd_kernel,
        "swiglu bwd input": _bwd._swiglu_transition_bwd_input_kernel,
        "swiglu bwd weight": _bwd._swiglu_transition_bwd_weight_kernel,
    }
    for name, tuner in tuners.items():
        tuner = getattr(tuner, "autotuner", tuner)  # EvoFlash's TunedKernel
        for key, cfg in getattr(tuner, "cache", {}).items():
            say(f"{name:18} {key} -> {cfg}")


if __name__ == "__main__":
    sys.exit(main())
