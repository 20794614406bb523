"""Launch shapes of the LayerNorm kernels, timed on the GPU.

    python -m tools.gpu_sweep_layer_norm [--sizes 768 1024] [--channels 128]

For the pair representation's LayerNorm (``[N^2, C]`` bf16 rows, fp32 affine), each
candidate of the forward (``BLOCK_R``, ``num_warps``) and of the backward
(``BLOCK_R``, ``num_warps``, programs per SM) alone, with
``triton.testing.do_bench`` medians in ms and the bytes moved per ms; the launchers'
current choices are marked ``*``, and ``torch.nn.functional.layer_norm`` (bf16 in,
torch's own kernels) is timed beside them. Diagnostic only: the chosen shapes live in
``of3_megafold/kernels/layer_norm/function.py``. ``num_stages`` is left at Triton's
default: 1 and 3 timed the same to 1 us for each of the fastest backward candidates at
``[768^2, 128]`` on the H200.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from of3_megafold.kernels.backend import cdiv, multiprocessors
from of3_megafold.kernels.layer_norm import function as fn
from of3_megafold.kernels.layer_norm._kernels import (
    _layer_norm_bwd_kernel,
    _layer_norm_fwd_kernel,
)

BLOCK_ROWS = (2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
PROGRAMS_PER_SM = (4, 8, 16, 32, 64)


def _fits(elements: int, warps: int) -> bool:
    """Whether a step of ``elements`` gives each thread 1 to 128 of them."""
    return 32 * warps <= elements <= 128 * 32 * warps


def _time(call) -> float:
    return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")


def _back_to_back(call, calls: int = 100) -> float:
    """ms per call over ``calls`` queued without a flush or sync between them: the
    rate a model sees, host launch cost included where it exceeds the GPU's."""
    call()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _fwd(x, w, b, block_r, warps):
    rows, c = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_c = fn._blocks(c)[0]
    _layer_norm_fwd_kernel[(cdiv(rows, block_r),)](
        x, w, b, y, mean, rstd, rows, c, 1e-5, HAS_W=True, HAS_B=True,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )


def _bwd(dy, x, w, mean, rstd, block_r, warps, per_sm):
    rows, c = x.shape
    dx = torch.empty_like(x)
    sms = multiprocessors(x.device.index)
    programs = max(1, min(per_sm * sms, cdiv(rows, block_r)))
    per_program = cdiv(rows, programs)
    programs = cdiv(rows, per_program)
    part = torch.empty((2, programs, c), dtype=torch.float32, device=x.device)
    _layer_norm_bwd_kernel[(programs,)](
        x, w, dy, mean, rstd, dx, part[0], part[1], rows, c, per_program,
        HAS_W=True, NEED_DWB=True, BLOCK_R=block_r, BLOCK_C=fn._blocks(c)[0],
        num_warps=warps,
    )
    part.sum(dim=1)


def sweep(n: int, c: int) -> None:
    dev = torch.device("cuda")
    rows = n * n
    x = torch.randn(rows, c, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.rand(c, device=dev) + 0.5
    b = torch.randn(c, device=dev)
    _, mean, rstd = fn.layer_norm_fwd(x, w, b, 1e-5)
    mib = rows * c * 2 / 2**20
    print(f"\n== N={n} C={c}: [{rows}, {c}] bf16 ({mib:.0f} MiB a tensor)")

    def report(label, ms, tensors, mark=""):
        gbs = tensors * rows * c * 2 / ms / 1e6
        print(f"{mark:1} {label:44} {ms:7.3f} ms {gbs:6.0f} GB/s", flush=True)

    block_c, block_r0 = fn._blocks(c)
    fwd0 = (block_r0, fn.FWD_WARPS)
    bwd0 = (*fn._bwd_blocks(c)[1:], fn.BWD_PROGRAMS_PER_SM)
    report("current forward", _time(lambda: fn.layer_norm_fwd(x, w, b, 1e-5)), 2, "*")
    bwd = lambda: fn.layer_norm_bwd(dy, x, w, mean, rstd, True)  # noqa: E731
    report("current backward (+ dw/db sum)", _time(bwd), 3, "*")
    report("current forward, back to back",
           _back_to_back(lambda: fn.layer_norm_fwd(x, w, b, 1e-5)), 2, "*")
    report("current backward, back to back", _back_to_back(bwd), 3, "*")
    xt = x.clone().requires_grad_(True)
    wt, bt = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    yt = torch.nn.functional.layer_norm(xt, (c,), wt.bfloat16(), bt.bfloat16())
    report("torch layer_norm forward (bf16 affine)",
           _time(lambda: torch.nn.functional.layer_norm(x, (c,), w.bfloat16(),
                                                        b.bfloat16())), 2)
    grads = (xt, wt, bt)
    report("torch layer_norm backward",
           _time(lambda: torch.autograd.grad(yt, grads, dy, retain_graph=True)), 3)
    results = []
    for block_r, warps in itertools.product(BLOCK_ROWS, WARPS):
        if not _fits(block_r * block_c, warps):
            continue
        ms = _time(lambda: _fwd(x, w, b, block_r, warps))  # noqa: B023
        mark = "*" if (block_r, warps) == fwd0 else ""
        report(f"fwd BLOCK_R={block_r} warps={warps}", ms, 2, mark)
    for block_r, warps, per_sm in itertools.product(BLOCK_ROWS, WARPS, PROGRAMS_PER_SM):
        if not _fits(block_r * block_c, warps):
            continue
        ms = _time(lambda: _bwd(dy, x, w, mean, rstd, block_r, warps, per_sm))  # noqa: B023
        results.append((ms, block_r, warps, per_sm))
    results.sort()
    print("backward candidates, fastest first (BLOCK_R, warps, programs/SM):")
    for ms, block_r, warps, per_sm in results:
        mark = "*" if (block_r, warps, per_sm) == bwd0 else ""
        report(f"bwd {block_r:3} {warps} {per_sm:3}", ms, 3, mark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[768, 1024])
    parser.add_argument("--channels", type=int, nargs="+", default=[128])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for n in args.sizes:
        for c in args.channels:
            sweep(n, c)


if __name__ == "__main__":
    main()
