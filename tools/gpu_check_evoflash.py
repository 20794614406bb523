"""Quick GPU check of EvoFlash-3D (attention with pair bias): correctness, then timing.

Usage (on the GPU machine, from the repository root)::

    python -m tools.gpu_check_evoflash              # checks + timings (~2 min)
    python -m tools.gpu_check_evoflash --no-check   # timings only
    python -m tools.gpu_check_evoflash --sizes 1024 # triangle sizes to time
    python -m tools.gpu_check_evoflash --no-check --wide --sizes --providers kit
                                                      # tune over a wider config list
    python -m tools.gpu_check_evoflash --no-check --wide --sizes --providers kit \
        --no-diffusion --no-trunk --diffusion-hp      # the same for the fp32 tiles
    python -m tools.gpu_check_evoflash --no-check --sizes 1024 --no-diffusion \
        --no-trunk --providers kit --maxnreg 128 168  # register-capped configs too
    python -m tools.gpu_check_evoflash --every-config --no-check --sizes \
        --no-diffusion --no-trunk                     # every listed config, checked

Correctness: the key cases of the ``gpu`` tests (N = 129 and 300, S = 4 and 48, the
three OF3 call-site shapes, fp32/tf32, bf16, fp16, high precision, the atomic dQ
variant, bitwise reproducibility), with the tests' rule: error <= 2 x plain torch's
error in the same precision + a small floor.

Timing (``triton.testing.do_bench`` median, forward + backward, bf16): the kit
(deterministic and atomic), SDPA memory-efficient with the bias expanded over S,
OF3's Triton kernel; then each kit kernel's autotuning table (ms per config) at the
shapes timed, which is what the config lists are tuned from. ``--wide`` tunes
every kernel afresh over a wider grid of tile shapes, S pairing, warps and stages
than ``configs`` lists (no shipped choices, no on-disk cache), to find out whether
the short lists miss a faster configuration; ``--diffusion-hp`` does the same for
the fp32-tile grid at the diffusion site as OF3 trains it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import triton.testing

from of3_megafold.bench.attention_core import (
    HIGH_PRECISION_PROVIDERS,
    _forward_fn,
    _inputs,
)
from of3_megafold.kernels.evoflash import configs as evoflash_configs
from of3_megafold.kernels.evoflash import function as evoflash_function
from tests.kernels.test_evoflash import GPU_CASES, Case, check_case

TUNED = {name: getattr(evoflash_function, f"_{name}").autotuner
         for name in ("fwd", "dq", "dkdv", "dbias")}


def run_checks() -> bool:
    cases = [(c, True) for c in GPU_CASES] + [
        (Case(1, 64, 256, 4, 32, torch.bfloat16), False),
        (Case(1, 48, 384, 16, 48, torch.bfloat16), False),
    ]
    ok = True
    print(f"{'case':58} {'det':>3}  " + "  ".join(f"{n:>17}" for n in
                                                  ("o", "dq", "dk", "dv", "dbias")))
    print(f"{'':58} {'':>3}  " + "  ".join(f"{'err/allowed':>17}" for _ in range(5)))
    for case, det in cases:
        try:
            rows = check_case(case, "cuda", seed=0, deterministic=det)
            status = "ok"
        except AssertionError as err:
            rows, status, ok = None, f"FAIL {err}", False
        except Exception:  # noqa: BLE001 - report and go on with the other cases
            rows, status, ok = None, "ERROR " + traceback.format_exc(limit=3), False
        cells = ("  ".join(f"{e:8.2g}/{a:<8.2g}" for _, e, _, a in rows)
                 if rows else status)
        print(f"{str(case):58} {'yes' if det else 'no':>3}  {cells}", flush=True)
    # bitwise reproducibility of the deterministic backward
    case = Case(1, 64, 256, 4, 32, torch.bfloat16)
    from tests.kernels.test_evoflash import make_inputs
    q, k, v, m, b, do = make_inputs(case, "cuda", seed=7)
    runs = []
    for _ in range(2):
        o = _forward_fn("kit")(q, k, v, m, b)
        runs.append(torch.autograd.grad(o, (q, k, v, b), do))
    same = all(torch.equal(x, y) for x, y in zip(*runs, strict=True))
    ok &= same
    print(f"deterministic backward bitwise reproducible: {same}")
    return ok


# (cases, which list): the i-th configuration of every kernel's list is forced
# at once; odd S (a paired-slice tail), padded masks, N not a multiple of any tile.
EVERY_CONFIG_CASES = (
    ([Case(1, 3, 300, 4, 32, torch.bfloat16), Case(1, 3, 200, 16, 48, torch.bfloat16)],
     "half"),
    ([Case(1, 3, 300, 2, 48, torch.float32),
      Case(1, 3, 129, 2, 32, torch.float32, high_precision=True)], "fp32"),
)  # fmt: skip


def every_config_checks() -> bool:
    """Each configuration of every kernel's list checked against the fp64 reference
    (the autotuner picks one per shape, so the tuned-shape checks meet only a few
    of them). Call before the first launch: switches the shipped choices off."""
    os.environ["OF3_MEGAFOLD_TUNED_CONFIGS"] = "0"
    lists = {name: list(t.configs) for name, t in TUNED.items()}
    ok = True
    for cases, which in EVERY_CONFIG_CASES:
        pick = {name: [c for c in full if (id(c) in evoflash_configs.FP32_CONFIGS)
                       == (which == "fp32")] for name, full in lists.items()}
        for i in range(max(len(v) for v in pick.values())):
            forced = {name: v[i % len(v)] for name, v in pick.items()}
            _set_configs({name: [cfg] for name, cfg in forced.items()})
            label = " ".join(f"{n}={_short(c)}" for n, c in forced.items())
            for case in cases:
                for det in (True, False):
                    try:
                        check_case(case, "cuda", seed=i, deterministic=det)
                        status = "ok"
                    except AssertionError as err:
                        status, ok = f"FAIL {str(err).splitlines()[0][:120]}", False
                    except Exception as err:  # noqa: BLE001 - report, go on
                        status, ok = f"ERROR {str(err).splitlines()[0][:120]}", False
                    print(f"{which} #{i} {label} | {case} det={det}: {status}",
                          flush=True)
    _set_configs(lists)  # the lists as they were
    return ok


def _set_configs(configs_by_kernel: dict) -> None:
    """Give each kernel's autotuner these configs and forget every choice made."""
    for name, tuner in TUNED.items():
        tuner.configs = configs_by_kernel[name]
        tuner.cache.clear()
        getattr(evoflash_function, f"_{name}").forget()


def _short(cfg) -> str:
    kw = cfg.kwargs
    group = f"x{kw['S_GROUP']}" if "S_GROUP" in kw else ""
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}{group}"
            f"/w{cfg.num_warps}s{cfg.num_stages}")


def _grid(tiles, s_groups, stages):
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n} | ({} if g is None else {"S_GROUP": g}),
            num_warps=4 if m * n <= 64 * 64 else 8,
            num_stages=st,
        )
        for m, n in tiles
        for g in (s_groups or [None])
        for st in stages
    ]


def widen_tuning() -> None:
    """Every kernel tuned afresh over wider grids (see the module docstring): one for
    16-bit tiles, a smaller one for fp32 tiles (fp32 inputs, high precision). Call
    before the first launch: the shipped choices are switched off then."""
    rows = [(64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]
    cols = [(32, 64), (64, 64), (128, 64), (32, 128), (64, 128), (128, 128)]
    rows32 = [(32, 32), (64, 32), (32, 64), (64, 64), (128, 32)]
    cols32 = [(32, 32), (32, 64), (64, 32), (32, 128), (64, 64)]
    tiles = [(32, 64), (64, 32), (64, 64), (128, 64), (64, 128)]
    tiles32 = [(32, 32), (32, 64), (64, 32), (64, 64)]
    wide = {
        "fwd": (_grid(rows, [1, 2], [2, 3]), _grid(rows32, [1], [2, 3])),
        "dq": (_grid(rows, [1, 2], [2, 3]), _grid(rows32, [1], [2, 3])),
        "dkdv": (_grid(cols, [1, 2], [2, 3]), _grid(cols32, [1], [2, 3])),
        "dbias": (_grid(tiles, None, [2, 3]), _grid(tiles32, None, [2, 3])),
    }
    os.environ["OF3_MEGAFOLD_TUNED_CONFIGS"] = "0"  # read at the first launch
    for name, tuner in TUNED.items():
        half, single = wide[name]
        evoflash_configs.FP32_CONFIGS.update(id(c) for c in single)
        tuner.configs = half + single
        tuner.cache_results = False


def cap_registers(caps: list[int]) -> None:
    """Add to each kernel's 16-bit list a copy of every 4-warp config per register
    cap in ``caps`` (Triton's ``maxnreg``): the compiler then fits the kernel in that
    many registers, so more programs share an SM (Nsight Compute counted 8-16 of 64
    warps resident and 33-50% of issue slots idle without a cap). Tuned afresh, as
    ``--wide``."""
    os.environ["OF3_MEGAFOLD_TUNED_CONFIGS"] = "0"  # read at the first launch
    for tuner in TUNED.values():
        capped = [
            triton.Config(dict(c.kwargs), num_warps=c.num_warps,
                          num_stages=c.num_stages, maxnreg=cap)
            for c in tuner.configs
            if id(c) not in evoflash_configs.FP32_CONFIGS and c.num_warps == 4
            for cap in caps
        ]
        tuner.configs = tuner.configs + capped
        tuner.cache_results = False


def time_shape(name: str, shape, providers, high_precision: bool = False) -> None:
    B, S, N, H, D = shape
    flops = 3.5 * 4 * B * S * H * N * N * D
    if high_precision:  # OF3's use_high_precision sites: fp32 attention
        providers = [p for p in providers if p in HIGH_PRECISION_PROVIDERS]
    for provider in providers:
        try:
            q, k, v, m, b, do = _inputs(shape, "cuda", torch.bfloat16, torch.bfloat16)
            fwd = _forward_fn(provider, high_precision)
            leaves = (q, k, v, b)

            def step(fwd=fwd, q=q, k=k, v=v, m=m, b=b, do=do, leaves=leaves):
                fwd(q, k, v, m, b).backward(do)
                for t in leaves:
                    t.grad = None

            def forward_only(fwd=fwd, q=q, k=k, v=v, m=m, b=b):
                with torch.no_grad():
                    fwd(q, k, v, m, b)

            for kernel in TUNED.values():
                kernel.configs_timings = None
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            if provider.startswith("kit"):
                print_tuning_tables()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
            ms = triton.testing.do_bench(step, return_mode="median")
            ms_f = triton.testing.do_bench(forward_only, return_mode="median")
            print(f"{name:10} {'x'.join(map(str, shape)):>16} {provider:14} "
                  f"fwd {ms_f:8.3f} ms  fwd+bwd {ms:8.3f} ms  "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s  peak {peak:8.0f} MiB  "
                  f"(first call {first:5.1f} s)", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"{name:10} {'x'.join(map(str, shape)):>16} {provider:14} OOM")
        except Exception as err:  # noqa: BLE001
            print(f"{name:10} {'x'.join(map(str, shape)):>16} {provider:14} "
                  f"ERROR {str(err).splitlines()[0][:150]}")
        torch.cuda.empty_cache()


def print_tuning_tables() -> None:
    """The autotuning timings of the kernels tuned by the last call."""
    for name, kernel in TUNED.items():
        timings = getattr(kernel, "configs_timings", None)
        if not timings:
            continue
        print(f"    tuned {name}: best {kernel.best_config}")
        for cfg, t in sorted(timings.items(), key=lambda kv: kv[1][0]):
            print(f"        {t[0]:8.3f} ms  {cfg}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="*", default=[512, 1024])
    parser.add_argument("--providers", nargs="*",
                        default=["kit", "kit-atomic", "sdpa", "of3-triton"])
    parser.add_argument("--wide", action="store_true",
                        help="tune over a wider config grid first")
    parser.add_argument("--maxnreg", type=int, nargs="+", metavar="REGS",
                        help="also tune register-capped copies of the 4-warp "
                             "configs (cap_registers)")
    parser.add_argument("--diffusion", action=argparse.BooleanOptionalAction,
                        default=True, help="time the diffusion shape")
    parser.add_argument("--trunk", action=argparse.BooleanOptionalAction,
                        default=True, help="time the trunk single-attention shape")
    parser.add_argument("--diffusion-hp", action="store_true",
                        help="also time the diffusion shape at high precision "
                             "(fp32 tiles, as OF3 trains that site)")
    parser.add_argument("--every-config", action="store_true",
                        help="check every configuration of the lists first "
                             "(every_config_checks)")
    args = parser.parse_args()
    ok = True
    if args.every_config:
        ok = every_config_checks()
    if args.wide:
        widen_tuning()
    if args.maxnreg:
        cap_registers(args.maxnreg)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton",
          triton.__version__)
    if not args.no_check:
        ok &= run_checks()
    for n in args.sizes:
        time_shape("triangle", (1, n, n, 4, 32), args.providers)
    shapes = [(1, 48, 768, 16, 48)] * args.diffusion
    shapes += [(1, 1, 768, 16, 24)] * args.trunk
    for shape in shapes:
        time_shape("diffusion" if shape[1] > 1 else "trunk", shape, args.providers)
    if args.diffusion_hp:
        time_shape("diff-hp", (1, 48, 768, 16, 48), args.providers, high_precision=True)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
