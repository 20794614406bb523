"""Where a full-model training step spends its time, per kit extension, on one GPU.

    python scripts/gpu_profile_step.py OUT.txt [--tokens 384] [--repeats 2]

Builds the full OF3 model once with every available kit extension on (the step
harness of :mod:`of3_megafold.bench.step`), runs a warm-up step (autotuning), then
times ``--repeats`` steps for each variant, toggling the runner-YAML flags on the
live config between steps (OF3 and the kit read them at call time):

- ``kit``: every extension on;
- ``kit - <extension>``: one extension switched back to stock;
- ``stock``: every extension off; ``stock-triton``: OF3's own Triton kernels on.

Then profiles one step of ``kit`` and one of ``stock-triton`` and prints the GPU
time per kernel (top 25) and the total, so wall time above kernel time (host
overhead) shows. Diagnostic only; the benchmark rows come from ``bench step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FLAGS = {
    "evoflash_attention": ("memory", "use_evoflash_attention"),
    "evofusion_transitions": ("memory", "use_evofusion_transitions"),
    "smooth_lddt": ("loss", "smooth_lddt_backend"),
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


def _variant(config, name: str) -> None:
    on = {ext: name == "kit" or (name.startswith("kit - ") and ext != name[6:])
          for ext in FLAGS}
    for ext, value in on.items():
        _set(config, ext, value)
    _set_triton(config, name == "stock-triton")


def _kernel_table(prof, lines: list[str], title: str) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 1e3
    lines.append(f"== {title}: GPU kernel time {total:.0f} ms, "
                 f"{sum(e.count for e in events)} kernels")
    for e in events[:25]:
        lines.append(f"   {e.device_time_total / 1e3:9.1f} ms  x{e.count:<6d} {e.key[:100]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)
        args.out.write_text("\n".join(lines) + "\n")

    started = time.perf_counter()
    harness = TrainingStepHarness("full", "kit", "cuda")
    say(f"model built in {time.perf_counter() - started:.0f} s")
    batch = random_training_batch(args.tokens, 1024, 4, "cuda")
    started = time.perf_counter()
    harness.step(batch)
    say(f"warm-up step (autotuning) {time.perf_counter() - started:.0f} s")
    variants = ["kit", *(f"kit - {ext}" for ext in FLAGS), "stock", "stock-triton"]
    for name in variants:
        _variant(harness.config, name)
        harness.step(batch)  # a new kernel path may compile or tune once
        ms = [harness.step(batch).ms for _ in range(args.repeats)]
        say(f"{name:32} {statistics.median(ms) / 1e3:7.2f} s/step  "
            f"({', '.join(f'{m / 1e3:.2f}' for m in ms)})")
    for name in ("kit", "stock-triton"):
        _variant(harness.config, name)
        harness.step(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = harness.step(batch).ms
        _kernel_table(prof, lines, f"{name}, wall {wall:.0f} ms")
        say(f"(profiled {name})")
    _autotune_choices(say)
    return 0


def _autotune_choices(say) -> None:
    """The configs the autotuners picked, per key (to prune the tuning lists)."""
    from of3_megafold.kernels.evoflash import function as evoflash
    from of3_megafold.kernels.swiglu_transition import _bwd, _fwd

    tuners = {
        "evoflash fwd": evoflash._fwd, "evoflash dq": evoflash._dq,
        "evoflash dkdv": evoflash._dkdv, "evoflash dbias": evoflash._dbias,
        "swiglu fwd": _fwd._swiglu_transition_fwd_kernel,
        "swiglu bwd input": _bwd._swiglu_transition_bwd_input_kernel,
        "swiglu bwd weight": _bwd._swiglu_transition_bwd_weight_kernel,
    }
    for name, tuner in tuners.items():
        for key, cfg in getattr(tuner, "cache", {}).items():
            say(f"{name:18} {key} -> {cfg}")


if __name__ == "__main__":
    sys.exit(main())
