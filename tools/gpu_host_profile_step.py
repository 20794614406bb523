"""Where the host time of one training step goes (cProfile), one GPU.

    python -m tools.gpu_host_profile_step [TOKENS] [OUT_DIR]

Builds the full model with every single-process kit extension on (the step harness's
``kit`` provider), runs two steps at ``TOKENS`` tokens (384 by default; the first
compiles and tunes), then profiles a third with cProfile and writes its tables,
sorted by cumulative and by own time, to ``host_<TOKENS>_<order>.txt`` and the raw
profile to ``host_<TOKENS>.prof`` in OUT_DIR ($OUT by default). cProfile's cost per
Python call inflates Python-heavy parts: rank with it, time with the step harness.
"""

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path


def main() -> int:
    import torch

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    n_token = int(sys.argv[1]) if len(sys.argv) > 1 else 384
    out = Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "."))
    harness = TrainingStepHarness("full", "kit", "cuda")
    batch = random_training_batch(n_token, 1024, 4, "cuda")
    for _ in range(2):
        print(f"step {harness.step(batch).ms / 1e3:.2f} s", flush=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    harness.step(batch)
    profiler.disable()
    print(f"profiled step {time.perf_counter() - started:.2f} s", flush=True)
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(70)
        (out / f"host_{n_token}_{order}.txt").write_text(text.getvalue())
    profiler.dump_stats(str(out / f"host_{n_token}.prof"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
