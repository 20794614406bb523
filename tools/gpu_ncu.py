"""Hardware counters of the kit's kernels, under Nsight Compute (``ncu``).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python -m tools.gpu_ncu CASE [CASE ...]

Each case warms up (compiles; the shipped tuning table picks the configs) outside
the profiled range, then runs one forward + backward between
``cudaProfilerStart``/``cudaProfilerStop``, so ``--profile-from-start off`` profiles
exactly that call's kernels. ``tools/gpu_session.sh ncu CASE...`` runs it with the
sections that say what bounds a kernel: throughput against the L2, DRAM and SM
peaks, issue slots, warp stalls, pipes, occupancy, registers.

Cases (``--list``): the EvoFlash core at triangle ``[1, 1024, 1024, 4, 32]`` (the
bench's inputs: bf16, the last 5% of keys masked) as is, without the key mask, with
an fp32 pair bias and with the atomic backward; the diffusion core ``[1, 48, 768, 16,
48]``; the pair transition at N=768.

Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tools.gpu_profile_kernels import transition_case

TRIANGLE = (1, 1024, 1024, 4, 32)
DIFFUSION = (1, 48, 768, 16, 48)


def _attention(shape, mask: bool = True, bias_dtype=torch.bfloat16,
               deterministic: bool = True):
    from of3_megafold.bench.attention_core import _inputs, _step
    from of3_megafold.kernels.evoflash import evoflash_attention

    q, k, v, mask_bias, pair_bias, do = _inputs(
        shape, torch.device("cuda"), torch.bfloat16, bias_dtype)

    def forward(q, k, v, mask_bias, pair_bias):
        return evoflash_attention(q, k, v, mask_bias if mask else None, pair_bias,
                                  deterministic=deterministic)

    return _step(forward, q, k, v, mask_bias, pair_bias, do)


CASES = {
    "tri1024": lambda: _attention(TRIANGLE),
    "tri1024-nomask": lambda: _attention(TRIANGLE, mask=False),
    "tri1024-f32bias": lambda: _attention(TRIANGLE, bias_dtype=torch.float32),
    "tri1024-atomic": lambda: _attention(TRIANGLE, deterministic=False),
    "dif768": lambda: _attention(DIFFUSION),
    "transition768": lambda: transition_case(768),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the cases")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = args.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    for name in names:
        step = CASES[name]()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {name}", flush=True)
        del step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
