"""The fused pair transition: this checkout's kernels against an older commit's, in
one process, piece by piece.

    python scripts/gpu_host_ab.py --prepare COMMIT      # here: writes .host-ab-old/
    python scripts/gpu_transition_ab.py [OUT.txt] [--n 768 1024]   # on the GPU

``SwiGLUTransition(c=128, n=4)`` inputs as in ``scripts/gpu_check_transition.py``
(bf16 rows, fp32 parameters, a row mask with zeros). For each N, both kits ("old":
``.host-ab-old/of3mf_old``, "kit": this checkout) are timed interleaved over five
rounds (``triton.testing.do_bench``, median per round) on:

* the forward kernel;
* the input-gradient backward alone (no weight gradients);
* the whole backward (the default weight-gradient path);
* the module call, forward + backward, as ``bench transition`` times it.

The table gives the median and range over the rounds. Then, per kit:

* the host time to issue one module forward + backward while the GPU is held busy
  (``torch.cuda._sleep`` queued first), median of 20. A hidden synchronisation
  would show up as the sleep's length. Each call starts cold, after a
  synchronisation, so this is an upper bound on the host cost inside a loop: in
  session 19 it exceeded the steady-state time of the whole call (3.37 against
  3.01 ms at N=768), whose CUDA kernels alone took 2.94 ms;
* the CUDA time of each kernel in one forward + backward (``torch.profiler``; the
  input-gradient kernel runs once per chunk of rows).

``--host-pieces`` instead times, in the same way (cold host time behind a GPU
sleep), the pieces of one chunk of this kit's "gemm" backward at N=768: the
weight-gradient GEMMs as the kit calls them and alternatives, slicing, the whole
backward and the forward launch.

Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import triton.testing
from gpu_check_transition import make  # this folder's check script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".host-ab-old"))
ROUNDS = 5
C, N_MULT = 128, 4


def kits() -> dict:
    """name -> the kit's ``kernels.swiglu_transition.function`` module."""
    new = importlib.import_module("of3_megafold.kernels.swiglu_transition.function")
    old = importlib.import_module("of3mf_old.kernels.swiglu_transition.function")
    return {"old": old, "kit": new}


def weights(fn, w_a, w_b, dtype):
    """The kit's stacked (or, before session 19, interleaved) SwiGLU weights."""
    pack = getattr(fn, "stack_ab", None) or fn.interleave_ab
    return pack(w_a, w_b, dtype)


def inputs(n_res: int):
    """``gpu_check_transition.make``'s bf16 inputs for ``[1, n_res, n_res, C]``."""
    x, params, mask, dy = make(n_res * n_res, C, N_MULT, torch.bfloat16, seed=1)
    return x, params, mask, dy.bfloat16()


def pieces(fn, x, params, mask, dy, n_res: int) -> dict:
    """name -> a no-argument callable timing that piece of ``fn``'s kit."""
    w_ab = weights(fn, params[2], params[3], torch.bfloat16)
    w_out = params[4].bfloat16()
    y, mean, rstd = fn.swiglu_transition_fwd(x, *params[:2], w_ab, w_out, mask, 1e-5)

    def bwd(**need):
        return fn.swiglu_transition_bwd(
            dy, x, *params[:2], w_ab, w_out, mask, mean, rstd, **need
        )

    xs = x.view(1, n_res, n_res, C).detach().requires_grad_()
    leaves = [p.detach().clone().requires_grad_() for p in params]
    ms = mask.view(1, n_res, n_res).bfloat16()
    dys = dy.view(1, n_res, n_res, C)

    def module():
        fn.swiglu_transition(xs, *leaves, mask=ms).backward(dys)
        for t in (xs, *leaves):
            t.grad = None

    return {
        "forward kernel": lambda: fn.swiglu_transition_fwd(
            x, *params[:2], w_ab, w_out, mask, 1e-5
        ),
        "backward, input only": lambda: bwd(need_dw_ab=False, need_dw_out=False),
        "backward, all": lambda: bwd(),
        "module fwd+bwd": module,
    }


def kernel_times(call) -> dict[str, tuple[float, int]]:
    """CUDA kernel name -> (total us, launches) in one ``call()``."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        call()
        torch.cuda.synchronize()
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:60]]
            entry[0] += event.device_time
            entry[1] += 1
    return {name: (t, n) for name, (t, n) in totals.items()}


def issue_ms(call, calls: int = 20) -> float:
    """Median host milliseconds to issue ``call()`` behind a ~100 ms GPU sleep."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # cycles: ~0.1 s at the H200's clock
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_pieces(say) -> None:
    """Host microseconds per call of each piece of one "gemm" backward chunk."""
    fn = kits()["kit"]
    x, params, mask, dy = inputs(768)
    w_ab = weights(fn, params[2], params[3], torch.bfloat16)
    w_out = params[4].bfloat16()
    rows, c, h = 67584, C, N_MULT * C
    dab = torch.randn(rows, 2 * h, device="cuda").bfloat16()
    xn = torch.randn(rows, c, device="cuda").bfloat16()
    acc = torch.zeros(2 * h, c, device="cuda")
    out = torch.empty_like(acc)
    dab_t = dab.t()
    pieces = {
        "mm(out_dtype=fp32)": lambda: torch.mm(dab_t, xn, out_dtype=torch.float32),
        "mm(out_dtype=fp32) + add_": lambda: acc.add_(
            torch.mm(dab_t, xn, out_dtype=torch.float32)
        ),
        "mm(out_dtype=fp32, out=)": lambda: torch.mm(
            dab_t, xn, out_dtype=torch.float32, out=out
        ),
        "addmm(out_dtype=fp32)": lambda: torch.addmm(
            acc, dab_t, xn, out_dtype=torch.float32
        ),
        "mm bf16": lambda: torch.mm(dab_t, xn),
        "slice x4": lambda: [t[:rows] for t in (dab, xn, dab, xn)],
        "whole bwd, 9 chunks": lambda: fn.swiglu_transition_bwd(
            dy,
            x,
            *params[:2],
            w_ab,
            w_out,
            mask,
            *fn.swiglu_transition_fwd(x, *params[:2], w_ab, w_out, mask, 1e-5)[1:],
        ),
        "fwd launch": lambda: fn.swiglu_transition_fwd(
            x, *params[:2], w_ab, w_out, mask, 1e-5
        ),
    }
    for name, call in pieces.items():
        try:
            call()
            say(f"  {name:28} {issue_ms(call) * 1e3:9.1f} us host per call")
        except Exception as error:  # noqa: BLE001 (report and go on)
            say(f"  {name:28} failed: {type(error).__name__}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="also write the report here")
    parser.add_argument("--n", type=int, nargs="+", default=[768, 1024])
    parser.add_argument("--host-pieces", action="store_true")
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    if args.host_pieces:
        host_pieces(say)
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return
    modules = kits()
    say(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{triton.__version__}; old = {(ROOT / '.host-ab-old/COMMIT').read_text()}"
    )
    for n_res in args.n:
        data = inputs(n_res)
        calls = {name: pieces(fn, *data, n_res) for name, fn in modules.items()}
        times = {(kit, piece): [] for kit in calls for piece in calls[kit]}
        for kit in calls:  # compile / tune outside the timed rounds
            for call in calls[kit].values():
                call()
        for _ in range(ROUNDS):
            for kit, by_piece in calls.items():
                for piece, call in by_piece.items():
                    times[kit, piece].append(
                        triton.testing.do_bench(
                            call, warmup=10, rep=50, return_mode="median"
                        )
                    )
        say(
            f"\npair transition [1, {n_res}, {n_res}, {C}] bf16, n={N_MULT}: ms, "
            f"median (range) of {ROUNDS} rounds"
        )
        say(f"  {'piece':24} {'old':>22} {'kit':>22} {'kit/old':>8}")
        for piece in calls["kit"]:
            cells = []
            for kit in ("old", "kit"):
                t = times[kit, piece]
                cells.append(f"{statistics.median(t):7.3f} ({min(t):.3f}-{max(t):.3f})")
            ratio = statistics.median(times["kit", piece]) / statistics.median(
                times["old", piece]
            )
            say(f"  {piece:24} {cells[0]:>22} {cells[1]:>22} {ratio:8.3f}")
        for kit, by_piece in calls.items():
            issue = issue_ms(by_piece["module fwd+bwd"])
            say(f"  host time to issue one module fwd+bwd, {kit}: {issue:.3f} ms")
        for kit, by_piece in calls.items():
            say(f"  CUDA kernels of one module fwd+bwd, {kit}:")
            for name, (t, count) in sorted(
                kernel_times(by_piece["module fwd+bwd"]).items(),
                key=lambda kv: -kv[1][0],
            ):
                say(f"    {t / 1000:7.3f} ms  x{count:<3d} {name}")
        del calls, data
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
