"""Where the kit's kernel calls spend their time, on one GPU.

    python -m tools.gpu_profile_kernels [OUT.txt]          # per CUDA kernel
    python -m tools.gpu_profile_kernels [OUT.txt] --host   # per host function

Default: forward + backward of the EvoFlash core (triangle N=256, 384, 1024,
diffusion S=48 N=768), the fused pair transition (N=768) and the smooth lDDT
``ball_query`` and ``fused`` backends (7680 atoms), profiled with
``torch.profiler`` after warm-up (autotuning done): the CUDA time per kernel and the
wall time per call. Wall time well above the summed kernel time means the host
(launches, Python), not the kernels, bounds that shape.

``--host``: for the host-bound shapes (triangle N=256/384, kit and OF3's Triton
kernel; the smooth lDDT backends), per call of forward + backward: ``wall`` (a
pipelined loop, synchronised once at the end), ``issue`` (the host time to issue
those calls, before the synchronisation) and the top functions of a ``cProfile``
of the loop by own time.

Diagnostic only: no JSON rows; the benchmark figures come from ``of3-megafold bench``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPEATS = 5  # kernel profile: calls per measurement
CALLS = 40  # host profile: calls per measurement
TOP = 22  # host profile: functions listed


def _attention_case(provider: str, shape: tuple[int, ...]):
    """One forward + backward of ``bench attention-core``'s ``provider`` on its bf16
    inputs of ``shape`` ``(B, S, N, H, D)``."""
    from of3_megafold.bench.attention_core import _forward_fn, _inputs, _step

    inputs = _inputs(shape, torch.device("cuda"), torch.bfloat16, torch.bfloat16)
    return _step(_forward_fn(provider), *inputs)


def transition_case(n: int):
    from of3_megafold.kernels.swiglu_transition import swiglu_transition

    dev, c, hid = "cuda", 128, 512
    x = torch.randn(1, n, n, c, device=dev, dtype=torch.bfloat16, requires_grad=True)
    params = [
        torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for shape in ((c,), (c,), (hid, c), (hid, c), (c, hid))
    ]
    for p in params[2:]:
        p.data *= c**-0.5
    dy = torch.randn_like(x)

    def step():
        y = swiglu_transition(x, *params)
        y.backward(dy)

    return step


def _smooth_lddt_case(provider: str, n_atom: int):
    """``provider`` as in ``bench smooth-lddt`` (its inputs: a sphere at protein
    density, 2 samples)."""
    from of3_megafold.bench.smooth_lddt import _loss_fn, make_inputs

    inputs = make_inputs(n_atom, torch.float32, torch.device("cuda"))
    x = inputs["x"].clone().requires_grad_()
    loss_fn = _loss_fn(provider, inputs)

    def step():
        loss_fn(x).sum().backward()
        x.grad = None

    return step


def _triangle(n: int) -> tuple[int, ...]:
    return (1, n, n, 4, 32)


KERNEL_CASES = [
    ("attention triangle N=256", lambda: _attention_case("kit", _triangle(256))),
    ("attention triangle N=384", lambda: _attention_case("kit", _triangle(384))),
    ("attention triangle N=1024", lambda: _attention_case("kit", _triangle(1024))),
    ("attention diffusion S=48 N=768",
     lambda: _attention_case("kit", (1, 48, 768, 16, 48))),
    ("pair transition N=768", lambda: transition_case(768)),
    ("smooth lDDT ball_query 7680",
     lambda: _smooth_lddt_case("kit-ball-query-256", 7680)),
    ("smooth lDDT fused 7680", lambda: _smooth_lddt_case("kit-fused", 7680)),
]
HOST_CASES = [
    (f"{provider} triangle N={n}",
     lambda p=provider, n=n: _attention_case(p, _triangle(n)))
    for n in (256, 384)
    for provider in ("kit", "of3-triton")
] + KERNEL_CASES[-2:]  # the smooth lDDT backends


def _warm_up(step) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()


def _kernel_profile(name: str, step, lines: list[str]) -> None:
    from of3_megafold.bench.common import wall_ms_per_call

    wall_ms = wall_ms_per_call(step, REPEATS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    kernel_ms = sum(e.device_time_total for e in events) / 1e3 / REPEATS
    lines.append(
        f"== {name}: wall {wall_ms:.3f} ms/call, kernels {kernel_ms:.3f} ms/call"
    )
    for e in events[:12]:
        lines.append(
            f"   {e.device_time_total / 1e3 / REPEATS:8.3f} ms  "
            f"x{e.count // REPEATS:<3d} {e.key[:90]}"
        )


def _host_profile(name: str, step, lines: list[str]) -> None:
    _warm_up(step)
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
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(TOP)
    lines.append(f"== {name}: wall {wall_ms:.3f} ms/call, issue {issue_ms:.3f} ms/call "
                 f"({CALLS} calls; cProfile below: totals over {CALLS} calls)")
    lines.extend(text.getvalue().splitlines()[4:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="text file for the report")
    parser.add_argument("--host", action="store_true", help="profile the host side")
    args = parser.parse_args(argv)
    cases, measure = (
        (HOST_CASES, _host_profile) if args.host else (KERNEL_CASES, _kernel_profile)
    )
    lines: list[str] = []
    for name, make in cases:
        start = len(lines)
        try:
            measure(name, make(), lines)
        except Exception as exc:  # keep profiling the other cases
            lines.append(f"== {name}: failed: {type(exc).__name__}: {exc}")
        print("\n".join(lines[start:]), flush=True)
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

