"""Where OF3's TriangleAttention module spends its time with the kit's core, on one GPU.

    python -m tools.gpu_profile_module [OUT.txt] [--sizes 768 1024]
        [--providers kit kit-core of3-triton]
    python -m tools.gpu_profile_module [OUT.txt] --module triangle-multiplication
        [--providers kit of3-eager]

``bench attention``'s triangle case (``TriangleAttention(c_in=128, c_hidden=32,
no_heads=4)``, bf16, input ``[1, N, N, 128]``) for each provider (``kit``: the
bench's kit; ``kit-core``: EvoFlash alone, OF3's LayerNorm; ``of3-triton``),
forward + backward after warm-up, under ``torch.profiler``: the CUDA time per call
split by operator (``aten::`` ops and Triton kernels, self time), and the same split
by CUDA kernel. The module's time outside the attention core (LayerNorm, projections,
gating, copies: 7.8 ms of 22.1 at N=1024 on the H200) is what this breaks down.

``--module triangle-multiplication`` profiles ``bench triangle-multiplication``'s
outgoing case (``[1, N, N, 128]``, ``c_hidden = 128``) with that bench's providers.

Diagnostic only: no JSON rows; the benchmark figures come from ``of3-megafold bench``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPEATS = 5  # profiled calls per size and provider
TOP = 25  # rows per table


def _table(events, per_call: int, key: str) -> str:
    """The ``TOP`` rows of ``events`` by self CUDA time, in ms per call."""
    rows = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / 1e3 / per_call
    lines = [f"  {'self CUDA ms/call':>17} {'calls/call':>10}  {key}"]
    for e in rows[:TOP]:
        if e.self_device_time_total <= 0:
            break
        lines.append(f"  {e.self_device_time_total / 1e3 / per_call:17.3f} "
                     f"{e.count / per_call:10.1f}  {e.key[:110]}")
    lines.append(f"  {total:17.3f} {'':10}  (sum of self CUDA time)")
    return "\n".join(lines)


def _attention_call(n: int, provider: str):
    from of3_megafold import activate
    from of3_megafold.bench.attention_module import KIT, _step, _triangle

    module, inputs, flags = _triangle(n, torch.device("cuda"))
    with torch.no_grad():
        grad_out = torch.randn_like(module(**inputs, **flags("stock")))
    forced = {"kit": KIT, "kit-core": ("evoflash_attention",)}
    activate(force=forced.get(provider, ()))
    step, leaves = _step(module, inputs, flags(provider), grad_out)

    def call():
        step()
        for t in [*leaves, *module.parameters()]:
            t.grad = None

    return call


def _multiplication_call(n: int, provider: str):
    from of3_megafold.bench import triangle_multiplication as bench

    device = torch.device("cuda")
    z, dz, mask = bench.inputs(n, 128, device)
    return bench._step_fn(provider, bench._module("outgoing", 128, device), z, mask, dz)


def profile_case(n: int, provider: str, module: str) -> str:
    from of3_megafold import activate
    from of3_megafold.bench.common import wall_ms_per_call

    try:
        if module == "triangle-attention":
            call = _attention_call(n, provider)
        else:
            call = _multiplication_call(n, provider)
        # warm-up: autotuning, compilation, allocator
        wall = wall_ms_per_call(call, REPEATS, warmup=3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                call()
            torch.cuda.synchronize()
    finally:
        activate()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    cuda = torch.autograd.DeviceType.CUDA
    ops = [e for e in events if e.device_type != cuda]
    kernels = [e for e in events if e.device_type == cuda]
    return (f"=== {module} N={n} {provider}: {wall:.3f} ms per forward + backward "
            f"(unprofiled wall time)\n"
            f"-- by operator\n{_table(ops, REPEATS, 'operator')}\n"
            f"-- by CUDA kernel\n{_table(kernels, REPEATS, 'kernel')}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="text file for the report")
    parser.add_argument("--sizes", type=int, nargs="*", default=[768, 1024])
    parser.add_argument("--providers", nargs="*")
    parser.add_argument("--module", default="triangle-attention",
                        choices=("triangle-attention", "triangle-multiplication"))
    args = parser.parse_args()
    if not args.providers:
        args.providers = (["kit", "kit-core", "of3-triton"]
                          if args.module == "triangle-attention" else
                          ["kit", "of3-eager"])
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    report = []
    for n in args.sizes:
        for provider in args.providers:
            text = profile_case(n, provider, args.module)
            print(text, flush=True)
            report.append(text)
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
