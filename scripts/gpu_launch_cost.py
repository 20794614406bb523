"""Host cost of launching a Triton kernel, piece by piece, on one GPU.

    python scripts/gpu_launch_cost.py [OUT.txt]

1. Synthetic kernels with 3 to 51 arguments (mostly integers): microseconds per
   launch through ``kernel[grid](...)`` with keyword and with positional arguments,
   and through the compiled kernel's launcher alone.
2. Each EvoFlash kernel as the kit launches it (triangle N=256, bf16), on a grid of
   one program so that the host alone is timed: :class:`TunedKernel`'s whole launch
   and its pieces (the tuning key; the argument list; :class:`DirectLaunch` with
   Triton's binder, the cache lookup and the compiled kernel's launcher), against
   ``JITFunction.run`` with the same positional arguments.

Tight loops of thousands of launches: the pieces' relative sizes, not the time a
launch takes inside a forward + backward, which runs colder and is about twice as
long (``scripts/gpu_host_ab.py`` measures that). Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _per_call_us(fn, calls: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _synthetic_kernel(n_ints: int):
    """A JIT kernel ``(X, Y, a0 .. a{n-1}, BLOCK)`` (written to a file: Triton reads
    the source)."""
    names = ", ".join(f"a{i}" for i in range(n_ints))
    source = (
        "import triton\nimport triton.language as tl\n\n\n"
        f"def kernel(X, Y, {names}, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    tl.store(Y + offs, tl.load(X + offs) + a0, mask=offs < a1)\n"
    )
    path = Path(tempfile.mkdtemp()) / f"launch_cost_{n_ints}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton.jit(module.kernel)


def _synthetic_row(n: int, x: torch.Tensor, y: torch.Tensor, stream: int) -> str:
    kernel = _synthetic_kernel(n)
    ints = [16 * (i + 2) for i in range(n)]
    ints[min(1, n - 1)] = 1024
    named = {f"a{i}": v for i, v in enumerate(ints)}
    keyword = _per_call_us(lambda: kernel[(1,)](X=x, Y=y, BLOCK=1024, **named))
    positional = _per_call_us(lambda: kernel[(1,)](x, y, *ints, 1024))
    compiled = kernel[(1,)](x, y, *ints, 1024)
    args = (x, y, *ints, 1024)
    raw = _per_call_us(lambda: compiled.run(
        1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None,
        None, *args))
    return (f"{n + 3:3d} arguments: keywords {keyword:6.1f}, positional "
            f"{positional:6.1f}, compiled launcher alone {raw:5.1f} us/launch")


def synthetic(lines: list[str]) -> None:
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    lines += [_synthetic_row(n, x, y, stream) for n in (1, 9, 25, 49)]


def _evoflash_rows(name: str, kernel, kwargs: dict) -> list[str]:
    one = (1,)  # one program: the host's cost alone
    key = kernel._key(kwargs)
    meta, options = kernel._chosen[key]
    values = {**kernel._defaults, **kwargs, **meta}
    for heuristic, rule in kernel._heuristics.items():
        values[heuristic] = rule(values)
    args = [values[n] for n in kernel._arg_names]
    device = torch.cuda.current_device()
    binder = kernel._jit.device_caches[device][4]
    bound, specialization, _ = binder(*args, **options)
    compiled = kernel._direct._kernels[(device, key, *specialization)]
    bound_values = list(bound.values())
    stream = torch._C._cuda_getCurrentRawStream(device)
    tensors = sum(isinstance(a, torch.Tensor) for a in args)
    pieces = {
        "TunedKernel launch": lambda: kernel._launch(one, kwargs),
        "  tuning key": lambda: kernel._key(kwargs),
        "  argument list": lambda: [values[n] for n in kernel._arg_names],
        "  DirectLaunch": lambda: kernel._direct(one, args, options, key),
        "    Triton's binder": lambda: binder(*args, **options),
        "    cache lookup": lambda: kernel._direct._kernels.get(
            (device, key, *specialization)),
        "    compiled launcher": lambda: compiled.run(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
            None, None, *bound_values),
        "JITFunction.run, positional": lambda: kernel._jit.run(
            *args, grid=one, warmup=False, **options),
    }
    return [f"== {name}: {len(args)} arguments, {tensors} tensors"] + [
        f"   {label:30s} {_per_call_us(fn):6.1f} us" for label, fn in pieces.items()
    ]


def evoflash(lines: list[str]) -> None:
    from of3_megafold.bench.attention_core import _inputs
    from of3_megafold.kernels import _launch
    from of3_megafold.kernels.evoflash import evoflash_attention

    q, k, v, mask_bias, pair_bias, do = _inputs(
        (1, 256, 256, 4, 32), torch.device("cuda"), torch.bfloat16, torch.bfloat16)
    captured = {}
    launch = _launch.TunedKernel._launch

    def capture(self, grid, kwargs):
        captured.setdefault(self._jit.fn.__name__, (self, dict(kwargs)))
        launch(self, grid, kwargs)

    _launch.TunedKernel._launch = capture
    try:
        for _ in range(3):
            evoflash_attention(q, k, v, mask_bias, pair_bias).backward(do)
        torch.cuda.synchronize()
    finally:
        _launch.TunedKernel._launch = launch

    for name, (kernel, kwargs) in captured.items():
        lines += _evoflash_rows(name, kernel, kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="text file for the report")
    args = parser.parse_args(argv)
    lines: list[str] = []
    synthetic(lines)
    evoflash(lines)
    print("\n".join(lines), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
