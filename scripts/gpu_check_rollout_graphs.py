"""Rollout graphs on the full model: a training step with the key on and off, one GPU.

    python scripts/gpu_check_rollout_graphs.py OUT.json [--tokens 384,768] [--repeats 2]

Builds the full OF3 model once with every single-process kit extension on (the step
harness's ``kit`` provider) and, per token count, runs one warm-up step with
``use_rollout_cuda_graphs`` off and one with it on, then ``--repeats`` rounds of one
step each, interleaved (toggling the key on the live config, which the extension
reads at call time). Prints and writes per variant the step times, peak memory,
losses and gradient norm, and how far the key-on losses are from the key-off ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FLAG = "use_rollout_cuda_graphs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", default="384,768")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    started = time.perf_counter()
    harness = TrainingStepHarness("full", "kit", "cuda")
    print(f"model built in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for n_token in (int(t) for t in args.tokens.split(",")):
        batch = random_training_batch(n_token, 1024, 4, "cuda")
        results = {False: [], True: []}
        for on in (False, True):  # warm-up: compiles, tunes
            harness.config.settings.memory.train[FLAG] = on
            took = harness.step(batch).ms / 1e3
            print(f"{n_token} tokens, graphs {on}: warm-up {took:.1f} s", flush=True)
        for _ in range(args.repeats):
            for on in (False, True):
                harness.config.settings.memory.train[FLAG] = on
                results[on].append(harness.step(batch))
        off, on = results[False], results[True]
        loss_diff = max(
            abs(r.loss[k] - o.loss[k]) / max(abs(o.loss[k]), 1e-12)
            for r, o in zip(on, off, strict=True) for k in o.loss
        )
        row = {
            "tokens": n_token,
            "off_s": [r.ms / 1e3 for r in off],
            "on_s": [r.ms / 1e3 for r in on],
            "off_peak_gib": max(r.peak_gib for r in off),
            "on_peak_gib": max(r.peak_gib for r in on),
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
            f"{n_token} tokens: off {med_off:.2f} s ({row['off_s']}), on {med_on:.2f} s "
            f"({row['on_s']}), {med_off / med_on:.2f}x; peak {row['off_peak_gib']:.1f} "
            f"-> {row['on_peak_gib']:.1f} GiB; loss {row['off_loss']:.6f} / "
            f"{row['on_loss']:.6f} (max rel diff {loss_diff:.2e}); grad norm "
            f"{row['off_grad_norm']:.6f} / {row['on_grad_norm']:.6f}",
            flush=True,
        )
        args.out.write_text(json.dumps(rows, indent=1))
        del batch
    return 0


if __name__ == "__main__":
    sys.exit(main())
