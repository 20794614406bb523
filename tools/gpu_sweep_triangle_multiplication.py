"""Block sizes of the triangle-multiplication kernels, timed on the GPU.

    python -m tools.gpu_sweep_triangle_multiplication [--sizes 768 1024]

For each kernel (``_out_fwd``, ``_out_bwd``, ``_gate_fwd``, ``_gate_bwd``) and each
candidate (gates: ``BLOCK_R``/``num_warps``; the persistent output kernels:
``BLOCK_R``/``NUM_STAGES``/``PROGRAMS_PER_SM``), the kernel alone on the pairformer's
shape (``[1, N, N, 128]``, ``c_hidden = 128``, bf16), ``triton.testing.do_bench``
median in ms, and the launcher's current choice marked. Diagnostic only: the chosen
sizes live in ``of3_megafold/kernels/triangle_multiplication/function.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing

from of3_megafold.kernels.triangle_multiplication import function as fn

GATE_CANDIDATES = [
    {"BLOCK_R": r, "num_warps": w} for r in (32, 64, 128) for w in (4, 8)
]
OUT_CANDIDATES = [
    {"BLOCK_R": r, "NUM_STAGES": s, "PROGRAMS_PER_SM": p}
    for r in (32, 64)
    for s in (1, 2, 3)
    for p in (1, 2, 4, 8)
]


def _time(call) -> float:
    return triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")


def sweep(n: int) -> dict[str, list[tuple[dict, float]]]:
    """Time every candidate of every kernel at ``N = n``: ``{kernel: [(candidate,
    ms)]}``."""
    c = 128
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    r = n * n
    proj = torch.randn(r, 5 * c, device=dev, dtype=bf16)
    mask = (torch.rand(r, device=dev) > 0.1).float()
    p = torch.randn(1, c, n, n, device=dev, dtype=bf16)
    w_z = torch.randn(c, c, device=dev, dtype=bf16) * c**-0.5
    ln_w, ln_b = torch.ones(c, device=dev), torch.zeros(c, device=dev)
    dout = torch.randn(r, c, device=dev, dtype=bf16)
    da, db = torch.randn_like(p), torch.randn_like(p)
    calls = {
        "out_fwd": (fn._out_blocks, lambda: fn.out_fwd(p, proj, ln_w, ln_b, w_z, 1e-5)),
        "out_bwd": (
            fn._out_blocks,
            lambda: fn.out_bwd(dout, p, proj, ln_w, ln_b, w_z, 1e-5),
        ),
        "gate_fwd": (fn._gate_blocks, lambda: fn.gate_fwd(proj, mask, 1, (n, n), c)),
        "gate_bwd": (fn._gate_blocks, lambda: fn.gate_bwd(proj, mask, da, db, c)),
    }
    timings = {}
    for name, (blocks_fn, call) in calls.items():
        attr = blocks_fn.__name__
        out = attr == "_out_blocks"
        current = blocks_fn(c, c, name == "out_bwd") if out else blocks_fn(c)
        results = []
        for cand in OUT_CANDIDATES if out else GATE_CANDIDATES:

            def forced(*args, _cand=cand, _f=blocks_fn, **kwargs):
                return {**_f(*args, **kwargs), **_cand}

            setattr(fn, attr, forced)
            try:
                ms = _time(call)
            except Exception as error:  # out of resources: too large a tile
                ms = float("nan")
                print(f"  {name} {cand}: {type(error).__name__}", flush=True)
            finally:
                setattr(fn, attr, blocks_fn)
            label = "/".join(str(v) for v in cand.values())
            mark = "*" if all(current[k] == v for k, v in cand.items()) else ""
            results.append((label + mark, ms))
            timings.setdefault(name, []).append((cand, ms))
        best = min((x for x in results if x[1] == x[1]), key=lambda x: x[1])
        keys = "/".join(OUT_CANDIDATES[0] if out else GATE_CANDIDATES[0])
        line = " ".join(f"{label}:{ms:.3f}" for label, ms in results)
        print(
            f"N={n} {name} ({keys}): best {best[0]} {best[1]:.3f} ms | {line}",
            flush=True,
        )
    return timings


def _best_total(runs: list[dict], name: str) -> dict:
    """The candidate of kernel ``name`` with the least time summed over sizes."""
    totals = [
        (cand, sum(run[name][i][1] for run in runs))
        for i, (cand, _) in enumerate(runs[0][name])
    ]
    return min((t for t in totals if t[1] == t[1]), key=lambda t: t[1])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[768, 1024])
    parser.add_argument(
        "--bench",
        type=Path,
        help="then run `bench triangle-multiplication` (of3-compile, kit) with the "
        "output kernels' best candidates over all sizes, rows to this JSON",
    )
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    runs = [sweep(n) for n in args.sizes]
    if args.bench:
        from of3_megafold.bench import triangle_multiplication

        best = {name: _best_total(runs, name) for name in ("out_fwd", "out_bwd")}
        print("bench with", best, flush=True)
        default = fn._out_blocks

        def chosen(ch, cz, backward):
            return {
                **default(ch, cz, backward),
                **best[f"out_{'bwd' if backward else 'fwd'}"],
            }

        fn._out_blocks = chosen
        triangle_multiplication.run(args.bench, providers=("of3-compile", "kit"))


if __name__ == "__main__":
    main()
