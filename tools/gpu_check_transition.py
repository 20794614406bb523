"""Quick GPU check of the fused SwiGLU transition: correctness, then timing.

Usage (on the GPU machine, from the repository root)::

    python -m tools.gpu_check_transition                # checks + pair N=768 timing
    python -m tools.gpu_check_transition --n 384 1024   # other pair sizes

Correctness: forward and every gradient against an fp64 reference, for bf16, fp16
and fp32 at c in {64, 128}, with the tests' rule (error <= 2 x plain torch's error
in the same dtype + a floor), with each way of reducing the weight gradients
(``WEIGHT_GRAD_PATH``; 40000 rows: several row chunks of the "gemm" path). Timing:
each kernel alone (with the autotuned config and its useful TFLOP/s), the backward
with either weight-gradient path, the kit's forward + backward, OF3's eager module,
and the peak memory of one forward + backward.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys

import torch
import triton
import triton.testing

from of3_megafold.bench.common import peak_mib_of_call
from of3_megafold.kernels.swiglu_transition import (
    function as transition_function,
)
from of3_megafold.kernels.swiglu_transition import (
    stack_ab,
    swiglu_transition,
    swiglu_transition_bwd,
    swiglu_transition_fwd,
    swiglu_transition_reference,
)
from of3_megafold.kernels.swiglu_transition._bwd import (
    _swiglu_transition_bwd_input_kernel,
    _swiglu_transition_bwd_weight_kernel,
)
from of3_megafold.kernels.swiglu_transition._fwd import (
    _swiglu_transition_fwd_kernel,
)

FLOORS = {
    torch.float32: (2e-6, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (2e-3, 5e-3),
}
DEVICE = "cuda"
WEIGHT_GRAD_PATHS = ("kernel", "gemm")
NAMES = ("y", "dx", "dln_w", "dln_b", "dw_a", "dw_b", "dw_out")


@contextlib.contextmanager
def weight_grad_path(path: str | None):
    """The transition backward forced onto ``path`` (``None``: as configured)."""
    default = transition_function.WEIGHT_GRAD_PATH
    transition_function.WEIGHT_GRAD_PATH = path or default
    try:
        yield
    finally:
        transition_function.WEIGHT_GRAD_PATH = default


def make(m, c, n, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h = n * c

    def randn(*s):
        return torch.randn(*s, generator=gen, device=DEVICE, dtype=torch.float64)

    x = (randn(m, c) * 2 + 0.5).to(dtype)
    params = [
        1 + 0.2 * randn(c),
        0.2 * randn(c),
        randn(h, c) * (2 / c) ** 0.5,
        randn(h, c) * (2 / c) ** 0.5,
        randn(c, h) * (1 / h) ** 0.5,
    ]
    params = [p.float() for p in params]
    mask = (torch.rand(m, generator=gen, device=DEVICE) > 0.2).float()
    dy = randn(m, c)
    return x, params, mask, dy


def outputs(fn, x, params, mask, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
    y = fn(*leaves, mask=mask)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def check(m, c, n, dtype) -> bool:
    x, params, mask, dy = make(m, c, n, dtype)
    got = outputs(swiglu_transition, x, params, mask, dy)
    plain = outputs(swiglu_transition_reference, x, params, mask, dy)
    exact = outputs(
        swiglu_transition_reference,
        x.double(),
        [p.double() for p in params],
        mask.double(),
        dy,
    )
    ok = True
    cells = []
    for i, (name, g, t, r) in enumerate(zip(NAMES, got, plain, exact, strict=True)):
        scale = r.abs().max().item()
        err = (g.double() - r).abs().max().item()
        terr = (t.double() - r).abs().max().item()
        tol = 2 * terr + FLOORS[dtype][min(i, 1)] * scale
        ok &= err <= tol
        cells.append(f"{name} {err / scale:.1e}/{terr / scale:.1e}")
    dt = str(dtype).removeprefix("torch.")
    print(f"{'PASS' if ok else 'FAIL'} M={m} c={c} n={n} {dt:8} | " + " ".join(cells))
    return ok


def bench(fn, grad_to_none=None):
    return triton.testing.do_bench(
        fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"
    )


def timing(n_res: int) -> None:
    from openfold3.core.model.layers.transition import SwiGLUTransition

    c, n = 128, 4
    h = n * c
    shape = (1, n_res, n_res, c)
    m = n_res * n_res
    x, params, mask, dy = make(m, c, n, torch.bfloat16, seed=1)
    dy = dy.bfloat16()
    w16 = [stack_ab(*params[2:4], torch.bfloat16), params[4].bfloat16()]
    gemm = 2 * m * c * h  # flops of one [M, c] x [c, H] GEMM

    y, mean, rstd = swiglu_transition_fwd(x, *params[:2], *w16, mask, 1e-5)
    rows = []
    t = bench(lambda: swiglu_transition_fwd(x, *params[:2], *w16, mask, 1e-5))
    rows.append(("fwd kernel", t, 3 * gemm, _swiglu_transition_fwd_kernel))

    def bwd(**need):
        return swiglu_transition_bwd(dy, x, *params[:2], *w16, mask, mean, rstd, **need)

    t = bench(lambda: bwd(need_dw_ab=False, need_dw_out=False))
    rows.append(("bwd input kernel", t, 5 * gemm, _swiglu_transition_bwd_input_kernel))
    for path in WEIGHT_GRAD_PATHS:
        # weights alone: 3 GEMMs recomputing [a | b] and dh, then 3 reducing over
        # the rows (either path); everything: "kernel" adds the input kernel's 5,
        # "gemm" recomputes only once (input kernel 5 + cuBLAS 3)
        with weight_grad_path(path):
            t_weights = bench(lambda: bwd(need_dx=False, need_dln=False))
            t_all = bench(lambda: bwd())
        rows.append((f"bwd weights [{path}]", t_weights, 6 * gemm, None))
        work = (11 if path == "kernel" else 8) * gemm
        rows.append((f"bwd all [{path}]", t_all, work, None))
    print(f"\npair transition x {list(shape)} bf16; TFLOP/s = matmul flops executed")
    for name, t, flops, kernel in rows:
        cfg = getattr(kernel, "best_config", "")
        print(f"  {name:22} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s  {cfg}")

    module = SwiGLUTransition(c_in=c, n=n).cuda()
    with torch.no_grad():
        for p, q in zip(module.parameters(), params, strict=True):
            p.copy_(q)
    xs = x.view(shape).detach().requires_grad_()
    ms = mask.view(shape[:-1]).bfloat16()
    dys = dy.view(shape)
    leaves = [xs, *module.parameters()]

    def clear():
        for t_ in leaves:
            t_.grad = None

    def kit_step():
        swiglu_transition(xs, *module.parameters(), mask=ms).backward(dys)
        clear()

    def eager_step():
        module(xs, mask=ms).backward(dys)
        clear()

    print("  fwd+bwd (9 GEMMs of useful work):")
    steps = [(f"kit [{path}]", path, kit_step) for path in WEIGHT_GRAD_PATHS]
    steps.append(("of3-eager", None, eager_step))
    for name, path, step in steps:
        with weight_grad_path(path):
            t = bench(step)
            mib = peak_mib_of_call(step)
        print(
            f"  {name:18} {t:7.3f} ms {9 * gemm / t / 1e9:6.0f} TFLOP/s {mib:7.0f} MiB"
        )
    _bench_harness(n_res, 9 * gemm)


def _bench_harness(n_res: int, flops: float) -> None:
    """The kit and OF3's eager module timed by ``of3-megafold bench transition``'s
    own code (its module, inputs and ``timed_peak``) in this process, so a gap
    between that benchmark and the timings above can be told apart from a
    difference between processes or runs."""
    from of3_megafold.bench import transition as bench_transition
    from of3_megafold.bench.common import timed_peak

    device = torch.device(DEVICE)
    shape = (1, n_res, n_res, 128)
    x, dy, mask = bench_transition.inputs(shape, device, torch.bfloat16)
    module = bench_transition._module(128, 4, device)
    print("  bench harness (of3_megafold.bench.transition, same process):")
    for provider in ("kit", "of3-eager", "kit"):
        timing_ = timed_peak(bench_transition._step_fn(provider, module, x, mask, dy))
        print(
            f"  {provider:18} {timing_.ms:7.3f} ms {flops / timing_.ms / 1e9:6.0f}"
            f" TFLOP/s {timing_.peak_mib:7.0f} MiB"
        )


def order_probe() -> None:
    """The benchmark's kit call at N=768 timed call by call (CUDA events, medians of
    blocks of 10 calls) in this order: alone; after the kit at N=384 (whose
    backward takes the "kernel" weight path); after OF3's eager module at N=768.
    Tells a transient (the first blocks slow) from a state that persists."""
    from of3_megafold.bench import transition as bench_transition

    device = torch.device(DEVICE)

    def case(n):
        x, dy, mask = bench_transition.inputs((1, n, n, 128), device, torch.bfloat16)
        return bench_transition._module(128, 4, device), x, mask, dy

    def blocks(step, calls=60):
        times = []
        for _ in range(calls):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return [sorted(times[i : i + 10])[5] for i in range(0, calls, 10)]

    kit768 = bench_transition._step_fn("kit", *case(768))
    kit384 = bench_transition._step_fn("kit", *case(384))
    eager768 = bench_transition._step_fn("of3-eager", *case(768))
    for label, before in (
        ("alone", None),
        ("after kit N=384", kit384),
        ("after eager N=768", eager768),
        ("alone again", None),
    ):
        if before is not None:
            blocks(before, 30)
        medians = " ".join(f"{t:6.3f}" for t in blocks(kit768))
        print(f"  kit N=768 {label:18} block medians (ms): {medians}", flush=True)


def widen_tuning() -> None:
    """Add a wider grid of 16-bit configs to the forward and input-gradient kernels'
    autotuners (call before their first launch): BLOCK_M 64/128 x BLOCK_H 32/64
    x 4/8 warps x 2/3/4 stages. Not shipped: a sweep, to find better lists."""
    grid = list(itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4)))
    for kernel in (_swiglu_transition_fwd_kernel, _swiglu_transition_bwd_input_kernel):
        have = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_H"], c.num_warps, c.num_stages)
                for c in kernel.configs}  # fmt: skip
        kernel.configs += [
            triton.Config({"BLOCK_M": bm, "BLOCK_H": bh}, num_warps=w, num_stages=st)
            for bm, bh, w, st in grid
            if (bm, bh, w, st) not in have
        ]
        print(f"{kernel.fn.fn.__name__}: {len(kernel.configs)} configs")


def one_config() -> None:
    """Each kernel keeps the first 16-bit and the first fp32 configuration of its
    list (call before the first launch): checks the launch path and the math
    without tuning every key (a correctness run, not a timing one)."""
    for kernel in (_swiglu_transition_fwd_kernel, _swiglu_transition_bwd_input_kernel,
                   _swiglu_transition_bwd_weight_kernel):  # fmt: skip
        prune = kernel.early_config_prune
        kernel.configs = [
            prune(kernel.configs, {"W_AB": torch.empty(0, dtype=dtype)})[0]
            for dtype in (torch.bfloat16, torch.float32)
        ]


def chunk_sweep(n_res: int, chunk_mib: list[int]) -> None:
    """The kit's forward + backward ("gemm" path) at pair size ``n_res`` for each
    ``HIDDEN_CHUNK_BYTES`` in ``chunk_mib``: launches per call against buffer size."""
    c, n = 128, 4
    m = n_res * n_res
    x, params, mask, dy = make(m, c, n, torch.bfloat16, seed=1)
    xs = x.view(1, n_res, n_res, c).requires_grad_()
    leaves = [xs] + [p.requires_grad_() for p in params]
    dys = dy.bfloat16().view(xs.shape)
    ms = mask.view(xs.shape[:-1]).bfloat16()

    def step():
        swiglu_transition(xs, *params, mask=ms).backward(dys)
        for t in leaves:
            t.grad = None

    default = transition_function.HIDDEN_CHUNK_BYTES
    print(f"  chunk sweep, N={n_res} (gemm path):")
    try:
        for mib in chunk_mib:
            transition_function.HIDDEN_CHUNK_BYTES = mib * 2**20
            with weight_grad_path("gemm"):
                t = bench(step)
                peak = peak_mib_of_call(step)
            print(f"  chunk {mib:5d} MiB {t:7.3f} ms {peak:7.0f} MiB", flush=True)
    finally:
        transition_function.HIDDEN_CHUNK_BYTES = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[768], help="pair sizes N")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument(
        "--order-probe",
        action="store_true",
        help="only the call-by-call order probe (order_probe)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="tune over a wider grid (widen_tuning)"
    )
    parser.add_argument(
        "--chunk-mib",
        type=int,
        nargs="*",
        default=[],
        help="also time the gemm path at these chunk sizes (chunk_sweep)",
    )
    parser.add_argument(
        "--one-config",
        action="store_true",
        help="check with one configuration per kernel and precision (one_config)",
    )
    args = parser.parse_args()
    if args.one_config:
        one_config()
    if args.wide:
        widen_tuning()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton",
          triton.__version__)  # fmt: skip
    if args.order_probe:
        order_probe()
        return
    ok = True
    if not args.no_check:
        shapes = ((4099, 128, 4), (3001, 64, 2), (1000, 64, 4), (40000, 128, 4))
        for path in WEIGHT_GRAD_PATHS:
            print(f"weight gradients: {path}")
            with weight_grad_path(path):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    for m, c, n in shapes:
                        ok &= check(m, c, n, dtype)
    for n_res in args.n:
        timing(n_res)
        if args.chunk_mib:
            chunk_sweep(n_res, args.chunk_mib)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
