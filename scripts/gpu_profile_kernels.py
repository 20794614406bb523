"""Where the kit's kernels spend their time, per CUDA kernel, on one GPU.

    python scripts/gpu_profile_kernels.py [OUT.txt]

Profiles forward + backward of the EvoFlash core (triangle N=256 and N=1024,
diffusion S=48 N=768), the fused pair transition (N=768) and the smooth lDDT
ball_query backend (7680 atoms) with ``torch.profiler``, after warm-up (so
autotuning is done), and prints for each the CUDA time per kernel and the wall
time per call. Wall time well above the summed kernel time means host overhead
(launches, Python), not the kernels, bounds that shape. Diagnostic only: no JSON
rows; the benchmark figures come from ``of3-megafold bench``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPEATS = 5


def _attention_case(s: int, n: int, h: int, d: int):
    from of3_megafold.kernels.evoflash import evoflash_attention

    dev = "cuda"
    q, k, v = (
        torch.randn(1, s, n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    mask = torch.zeros(1, s, 1, 1, n, device=dev)
    bias = torch.randn(
        1, 1, h, n, n, device=dev, dtype=torch.bfloat16, requires_grad=True
    )
    do = torch.randn_like(q)

    def step():
        o = evoflash_attention(q, k, v, mask, bias)
        o.backward(do)

    return step


def _transition_case(n: int):
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


def _smooth_lddt_case(n_atom: int, provider: str):
    """``provider`` as in ``bench smooth-lddt`` (its inputs: a sphere at protein
    density, 2 samples)."""
    from of3_megafold.bench.smooth_lddt import _loss_fn, make_inputs

    inputs = make_inputs(n_atom, torch.float32, torch.device("cuda"))
    x = inputs["x"].clone().requires_grad_()
    loss_fn = _loss_fn(provider, inputs)

    def step():
        loss_fn(x).sum().backward()

    return step


def _profile(name: str, step, lines: list[str]) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(REPEATS):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3 / REPEATS
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
    print("\n".join(lines[-min(len(lines), 13) :]), flush=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    lines: list[str] = []
    cases = [
        ("attention triangle N=256", lambda: _attention_case(256, 256, 4, 32)),
        ("attention triangle N=384", lambda: _attention_case(384, 384, 4, 32)),
        ("attention triangle N=1024", lambda: _attention_case(1024, 1024, 4, 32)),
        ("attention diffusion S=48 N=768", lambda: _attention_case(48, 768, 16, 48)),
        ("pair transition N=768", lambda: _transition_case(768)),
        (
            "smooth lDDT ball_query 7680",
            lambda: _smooth_lddt_case(7680, "kit-ball-query-256"),
        ),
        ("smooth lDDT fused 7680", lambda: _smooth_lddt_case(7680, "kit-fused")),
    ]
    for name, make in cases:
        try:
            _profile(name, make(), lines)
        except Exception as exc:  # keep profiling the other cases
            lines.append(f"== {name}: failed: {type(exc).__name__}: {exc}")
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
