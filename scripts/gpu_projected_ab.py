"""The projected EvoFlash path against the packed one it replaced, in one process.

    python scripts/gpu_host_ab.py --prepare 68892ec   # here: the packed kit, carried
    python scripts/gpu_projected_ab.py OUT.txt [--sizes 384 512 768 1024]

Triangle attention's core with its projection (bf16, c 128, 4 heads x 32, gated,
OF3's permuted pair bias and an all-zero mask): ``old`` is commit 68892ec's path
(one projection GEMM, its output saved, ``evoflash_attention_packed``), ``new`` is
:func:`evoflash_attention_projected` (the projection per chunk of rows, recomputed
in backward). Per size and variant: the wall time of forward + backward over
pipelined calls (host work the GPU does not hide counts), the CUDA time of the
same calls from CUDA events around a synchronised call, and the peak memory above
the inputs. Interleaved over three rounds; medians.

Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / ".host-ab-old")]

ROUNDS, CALLS = 3, 20


def _inputs(n: int):
    gen = torch.Generator(device="cuda").manual_seed(n)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(
            torch.bfloat16)

    x = randn(1, n, n, 128).requires_grad_()
    w = randn(512, 128, scale=128 ** -0.5).requires_grad_()
    z = randn(1, n, n, 4).requires_grad_()  # the triangle bias before OF3's permute
    mask = torch.zeros(1, n, 1, 1, n, device="cuda", dtype=torch.bfloat16)
    do = randn(1, n, n, 4, 32)
    return x, w, z, mask, do


def _variants():
    from of3mf_old.kernels.evoflash import evoflash_attention_packed

    from of3_megafold.kernels.evoflash import evoflash_attention_projected

    def old(x, w, z, mask):
        qkv = torch.nn.functional.linear(x, w).view(*x.shape[:3], 4, 4, 32)
        return evoflash_attention_packed(qkv, mask, z.permute(0, 3, 1, 2)[:, None])

    def new(x, w, z, mask):
        return evoflash_attention_projected(x, w.view(4, 4, 32, 128), None, mask,
                                            z.permute(0, 3, 1, 2)[:, None])

    return {"old": old, "new": new}


def _measure(fn, inputs) -> tuple[float, float, float]:
    """(wall ms per pipelined call, CUDA ms of one call, peak MiB above inputs)."""
    from of3_megafold.bench.common import peak_mib_of_call, wall_ms_per_call

    x, w, z, mask, do = inputs

    def call():
        fn(x, w, z, mask).backward(do)
        x.grad = w.grad = z.grad = None

    wall = wall_ms_per_call(call, CALLS, warmup=3)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(5):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return wall, statistics.median(gpu), peak_mib_of_call(call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sizes", type=int, nargs="*", default=[384, 512, 768, 1024])
    args = parser.parse_args()
    variants = _variants()
    lines = [f"{'N':>5} {'variant':8} {'wall ms':>9} {'cuda ms':>9} {'peak MiB':>9}"]
    for n in args.sizes:
        inputs = _inputs(n)
        results = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, fn in variants.items():
                results[name].append(_measure(fn, inputs))
        for name, rows in results.items():
            wall, gpu, peak = (statistics.median(r[i] for r in rows) for i in range(3))
            lines.append(f"{n:>5} {name:8} {wall:9.3f} {gpu:9.3f} {peak:9.0f}")
            print(lines[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
