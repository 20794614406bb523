"""Where the host time of a small kernel call goes, on one GPU.

    python scripts/gpu_host_overhead.py [OUT.txt]

For the shapes where the kit is host-bound (the kernel profile shows wall time well
above the summed kernel time: EvoFlash triangle N=256/384, smooth lDDT at 7680
atoms), and OF3's Triton kernel at the same shapes for comparison, prints per call
of forward + backward:

- ``wall``: a pipelined loop of calls, synchronised once at the end;
- ``issue``: the host time to issue the calls (the same loop without the final
  synchronisation; the GPU queue absorbs the work while it is shorter than the
  host's);
- the top functions of a ``cProfile`` of the loop, by own time, per call.

Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS = 40
TOP = 22


def _attention_case(provider: str, n: int):
    from of3_megafold.bench.attention_core import _forward_fn, _inputs, _step

    q, k, v, mask_bias, pair_bias, do = _inputs(
        (1, n, n, 4, 32), torch.device("cuda"), torch.bfloat16, torch.bfloat16
    )
    return _step(_forward_fn(provider), q, k, v, mask_bias, pair_bias, do)


def _smooth_lddt_case(provider: str, n_atom: int):
    from of3_megafold.bench.smooth_lddt import _loss_fn, make_inputs

    inputs = make_inputs(n_atom, torch.float32, torch.device("cuda"))
    x = inputs["x"].clone().requires_grad_()
    loss_fn = _loss_fn(provider, inputs)

    def step():
        loss_fn(x).sum().backward()
        x.grad = None

    return step


def _measure(name: str, step, lines: list[str]) -> None:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(CALLS):
        step()
    issue_ms = (time.perf_counter() - started) * 1e3 / CALLS
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3 / CALLS
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(TOP)
    lines.append(f"== {name}: wall {wall_ms:.3f} ms/call, issue {issue_ms:.3f} ms/call "
                 f"({CALLS} calls; cProfile below: totals over {CALLS} calls)")
    lines.extend(text.getvalue().splitlines()[4:])
    print("\n".join(lines[-(TOP + 12):]), flush=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    lines: list[str] = []
    cases = [
        ("kit triangle N=256", lambda: _attention_case("kit", 256)),
        ("of3-triton triangle N=256", lambda: _attention_case("of3-triton", 256)),
        ("kit triangle N=384", lambda: _attention_case("kit", 384)),
        ("of3-triton triangle N=384", lambda: _attention_case("of3-triton", 384)),
        ("kit ball_query K=256, 7680 atoms",
         lambda: _smooth_lddt_case("kit-ball-query-256", 7680)),
        ("kit fused, 7680 atoms", lambda: _smooth_lddt_case("kit-fused", 7680)),
    ]
    for name, make in cases:
        try:
            _measure(name, make(), lines)
        except Exception as exc:  # keep measuring the other cases
            lines.append(f"== {name}: failed: {type(exc).__name__}: {exc}")
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
