"""A CUDA-graph key on the full model: training steps with it on and off, one GPU.

    python -m tools.gpu_check_cuda_graphs OUT.json [--key rollout|trunk]
        [--tokens 384,768] [--repeats 2] [--full-rollout STEPS] [--provider kit]

Builds the full OF3 model once with every single-process kit extension on (the step
harness's ``kit`` provider; ``--provider kit-without-<extension>`` leaves one out)
and, per token count, runs one warm-up step with the key (``rollout``:
``use_rollout_cuda_graphs``; ``trunk``: ``use_trunk_cuda_graphs``) off and two with
it on, then ``--repeats`` rounds of one step each, interleaved
(toggling the key on the live config, which the extensions read at call time).
Prints and writes per variant the step times, the graphed part's own time between
two synchronisations inside the step (OF3's ``SampleDiffusion.forward`` for the
rollout, ``OpenFold3.run_trunk`` for the trunk), peak memory allocated and the
memory the allocator holds at the end (graph pools included), losses and gradient
norm, and how far the key-on losses are from the key-off ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

# --key -> (the key, "module:Class.method" timed between synchronisations)
KEYS = {
    "rollout": (
        "use_rollout_cuda_graphs",
        "openfold3.core.model.structure.diffusion_module:SampleDiffusion.forward",
    ),
    "trunk": (
        "use_trunk_cuda_graphs",
        "openfold3.projects.of3_all_atom.model:OpenFold3.run_trunk",
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--key", choices=sorted(KEYS), default="rollout")
    parser.add_argument("--tokens", default="384,768")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--full-rollout", type=int, default=0, metavar="STEPS",
                        help="also time a rollout of STEPS steps and 5 samples (as "
                        "validation and inference run it) on the step's trunk "
                        "outputs, key off and on, twice each (--key rollout)")
    parser.add_argument("--provider", default="kit",
                        help="the step harness's provider (kit-without-<extension>: "
                        "the kit less one extension)")
    args = parser.parse_args()

    import importlib

    import torch

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    flag, target = KEYS[args.key]
    module_name, qualname = target.split(":")
    owner_name, method = qualname.split(".")
    owner = getattr(importlib.import_module(module_name), owner_name)
    timer = _Timer(getattr(owner, method))
    setattr(owner, method, timer)

    started = time.perf_counter()
    harness = TrainingStepHarness("full", args.provider, "cuda")
    print(f"model built in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for n_token in (int(t) for t in args.tokens.split(",")):
        batch = random_training_batch(n_token, 1024, 4, "cuda")
        results = {False: [], True: []}
        parts = {False: [], True: []}
        # warm-up: compiles, tunes; on, the trunk's cycles without autograd are
        # captured in the first step, its cycle with autograd in the second
        for on in (False, True, True):
            _set_key(harness, flag, on)
            took = harness.step(batch).ms / 1e3
            print(f"{n_token} tokens, graphs {on}: warm-up {took:.1f} s", flush=True)
        for _ in range(args.repeats):
            for on in (False, True):
                _set_key(harness, flag, on)
                results[on].append(harness.step(batch))
                parts[on].append(timer.seconds[-1])
        off, on = results[False], results[True]
        loss_diff = max(
            abs(r.loss[k] - o.loss[k]) / max(abs(o.loss[k]), 1e-12)
            for r, o in zip(on, off, strict=True) for k in o.loss
        )
        row = {
            "tokens": n_token,
            "off_s": [r.ms / 1e3 for r in off],
            "on_s": [r.ms / 1e3 for r in on],
            "key": flag,
            "part": qualname,
            "off_part_s": parts[False],
            "on_part_s": parts[True],
            "off_peak_gib": max(r.peak_gib for r in off),
            "on_peak_gib": max(r.peak_gib for r in on),
            "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "off_loss": off[0].loss["loss"],
            "on_loss": on[0].loss["loss"],
            "max_rel_loss_diff": loss_diff,
            "off_grad_norm": off[0].grad_norm,
            "on_grad_norm": on[0].grad_norm,
            "recycles": off[0].recycles,
        }
        rows.append(row)
        med_off = statistics.median(row["off_s"])
        med_on = statistics.median(row["on_s"])
        print(
            f"{n_token} tokens: off {med_off:.2f} s ({row['off_s']}), "
            f"on {med_on:.2f} s ({row['on_s']}), {med_off / med_on:.2f}x; {method} "
            f"{statistics.median(row['off_part_s']):.3f} -> "
            f"{statistics.median(row['on_part_s']):.3f} s; peak "
            f"{row['off_peak_gib']:.1f} -> {row['on_peak_gib']:.1f} GiB "
            f"(held {row['reserved_gib']:.1f} GiB); "
            f"loss {row['off_loss']:.6f} / "
            f"{row['on_loss']:.6f} (max rel diff {loss_diff:.2e}); grad norm "
            f"{row['off_grad_norm']:.6f} / {row['on_grad_norm']:.6f}",
            flush=True,
        )
        if args.full_rollout and args.key == "rollout":
            row["full_rollout_s"] = _full_rollout(harness, timer, args.full_rollout)
            print(f"{n_token} tokens, {args.full_rollout} steps x 5 samples: "
                  f"{row['full_rollout_s']}", flush=True)
        args.out.write_text(json.dumps(rows, indent=1))
        del batch
    return 0


class _Timer:
    """Stands in for a module's method: runs it between two synchronisations,
    keeping its seconds and its last call's arguments."""

    def __init__(self, forward):
        self.forward = forward
        self.seconds: list[float] = []
        self.last_call: tuple = ()

    def __get__(self, module, owner=None):  # a method of the module it replaces in
        return self if module is None else functools.partial(self, module)

    def __call__(self, module, *args, **kwargs):
        import torch

        self.last_call = (module, args, kwargs)
        torch.cuda.synchronize()
        began = time.perf_counter()
        out = self.forward(module, *args, **kwargs)
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - began)
        return out


def _set_key(harness, flag: str, on: bool) -> None:
    harness.config.settings.memory.train[flag] = on


def _full_rollout(harness, rollout: _Timer, steps: int) -> dict:
    """Seconds per rollout of ``steps`` steps and 5 samples, key off and on, on the
    last timed rollout's inputs."""
    import torch
    from openfold3.core.model.structure.diffusion_module import create_noise_schedule

    module, a, k = rollout.last_call
    schedule = create_noise_schedule(
        no_rollout_steps=steps, **harness.config.architecture.noise_schedule,
        dtype=torch.float32, device="cuda",
    )
    k = {**k, "noise_schedule": schedule, "no_rollout_samples": 5}
    times = {"off": [], "on": []}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float32):
        for _ in range(2):
            for on in (False, True):
                _set_key(harness, KEYS["rollout"][0], on)
                rollout(module, *a, **k)
                times["on" if on else "off"].append(rollout.seconds[-1])
    return times


if __name__ == "__main__":
    sys.exit(main())
