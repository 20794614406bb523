"""Wall time of the kit's attention call: this checkout against an older commit's,
in one process.

    python scripts/gpu_host_ab.py --prepare COMMIT   # here: writes .host-ab-old/
    python scripts/gpu_host_ab.py [OUT.txt]          # on the GPU (carry .host-ab-old)
    python scripts/gpu_host_ab.py OUT.txt --shapes 1,1024,1024,4,32 1,48,768,16,48 \
        --variants old,kit,of3-triton --calls 20 --kernels   # a kernel change

At small triangle shapes (N = 256, 384) a forward + backward is bound by the host:
launch and Python work, not the GPU. Host time varies by 10-20 % from one machine to
the next, so a change is only measured against its predecessor in the same process:
``--prepare`` copies ``of3_megafold`` at ``COMMIT`` into ``.host-ab-old/of3mf_old``
(the package renamed, so both import side by side). The run then times forward +
backward of both kits, their atomic variants, the new kit without
:class:`~of3_megafold.kernels._launch.DirectLaunch`, SDPA and OF3's Triton kernel,
interleaved over five rounds of 200 pipelined calls (``--calls``): the median and
range of the wall time per call (``bench attention-core`` times the same calls with
``triton.testing.do_bench``, which clears L2 before each; its host-bound figures
differ from these).

``--kernels`` adds, per shape and variant, the CUDA time of each kernel
(``gpu_profile_kernels.py``'s profile), to tell which kernel a change moved.

Diagnostic only: no JSON rows.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / ".host-ab-old"
ROUNDS, CALLS, WARMUP = 5, 200, 10
VARIANTS = ("old", "kit", "kit-nodirect", "old-atomic", "kit-atomic", "sdpa",
            "of3-triton")


def prepare(commit: str) -> None:
    """``of3_megafold`` at ``commit`` as the package ``of3mf_old`` in ``OLD``."""
    archive = subprocess.run(["git", "archive", commit, "of3_megafold"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    target = OLD / "of3mf_old"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = target / Path(member.name).relative_to("of3_megafold")
            path.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            if path.suffix == ".py":
                data = data.replace(b"of3_megafold", b"of3mf_old")
            path.write_bytes(data)
    (OLD / "COMMIT").write_text(commit + "\n")
    print(f"wrote {target} ({commit})")


def _set_direct(on: bool) -> None:
    """Turn :class:`DirectLaunch` off (or back on) for every EvoFlash kernel."""
    from of3_megafold.kernels._launch import TunedKernel
    from of3_megafold.kernels.evoflash import function

    for kernel in vars(function).values():
        if isinstance(kernel, TunedKernel):
            if not hasattr(kernel, "_ab_direct"):
                kernel._ab_direct = kernel._direct
            kernel._direct = kernel._ab_direct if on else None


def _wall_ms(forward, inputs, calls: int) -> float:
    from of3_megafold.bench.attention_core import _step
    from of3_megafold.bench.common import wall_ms_per_call

    return wall_ms_per_call(_step(forward, *inputs), calls, warmup=WARMUP)


def run(out: Path | None, shapes: list[tuple[int, ...]], names: list[str],
        calls: int, kernels: bool) -> None:
    import torch

    sys.path.insert(0, str(OLD))
    from of3mf_old.bench.attention_core import _forward_fn as old_forward_fn

    from of3_megafold.bench.attention_core import _forward_fn, _inputs

    old = (OLD / "COMMIT").read_text().strip()
    every = {  # name -> (label, forward, DirectLaunch on/off for the new kit, or None)
        "old": (f"kit at {old}", lambda: old_forward_fn("kit"), None),
        "kit": ("kit", lambda: _forward_fn("kit"), True),
        "kit-nodirect": ("kit without DirectLaunch", lambda: _forward_fn("kit"), False),
        "old-atomic": (f"kit-atomic at {old}", lambda: old_forward_fn("kit-atomic"),
                       None),
        "kit-atomic": ("kit-atomic", lambda: _forward_fn("kit-atomic"), True),
        "sdpa": ("sdpa", lambda: _forward_fn("sdpa"), None),
        "of3-triton": ("of3-triton", lambda: _forward_fn("of3-triton"), None),
    }
    # only the variants asked for are built (of3-triton needs openfold3)
    variants = {every[name][0]: (every[name][1](), every[name][2]) for name in names}
    lines = []
    for shape in shapes:
        inputs = _inputs(shape, torch.device("cuda"), torch.bfloat16, torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, (forward, direct) in variants.items():
                if direct is not None:
                    _set_direct(direct)
                times[name].append(_wall_ms(forward, inputs, calls))
        _set_direct(True)
        lines.append(f"== {shape}: wall ms per forward + backward, median of "
                     f"{ROUNDS} interleaved rounds of {calls} calls (min-max)")
        lines += [
            f"   {name:36s} {statistics.median(t):6.3f}  ({min(t):.3f}-{max(t):.3f})"
            for name, t in times.items()
        ]
        print("\n".join(lines[-len(variants) - 1:]), flush=True)
        if kernels:
            from gpu_profile_kernels import _kernel_profile

            from of3_megafold.bench.attention_core import _step

            for name, (forward, direct) in variants.items():
                if direct is not None:
                    _set_direct(direct)
                start = len(lines)
                _kernel_profile(f"{shape} {name}", _step(forward, *inputs), lines)
                print("\n".join(lines[start:]), flush=True)
            _set_direct(True)
    if out is not None:
        out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="text file for the report")
    parser.add_argument("--prepare", metavar="COMMIT",
                        help="copy the kit at COMMIT into .host-ab-old/ and stop")
    parser.add_argument("--shapes", nargs="+", default=["1,256,256,4,32",
                                                         "1,384,384,4,32"],
                        help="B,S,N,H,D of each shape (default: triangle N=256, 384)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--calls", type=int, default=CALLS,
                        help="pipelined calls per round")
    parser.add_argument("--kernels", action="store_true",
                        help="also the CUDA time per kernel of each variant")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.prepare:
        prepare(args.prepare)
    else:
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes]
        run(args.out, shapes, names, args.calls, args.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
