"""Compile an EvoFlash kernel for the H200 (sm_90a) without a GPU and count what
the compiler made of it.

    python scripts/offline_sass.py fwd --block 128 64 --s-group 1 --warps 4 --stages 3
    python scripts/offline_sass.py dkdv --block 64 64 --s-group 2 --head-dim 48 --json

For a kernel change, before spending device time on it: the layout conversions of
the Triton GPU IR (``ttg.convert_layout``, each a round trip through shared memory
unless trivial), the registers and spills that ptxas reports, and a histogram of
the SASS instructions. Triangle-attention flags by default (bf16, key mask, pair
bias shared over S, N a multiple of the tiles).

This host's Triton and its bundled ptxas compile; the GPU machine's (Triton 3.6 in
these sessions) may schedule and allocate differently. So the counts compare two
versions of a kernel under one compiler; they do not predict the GPU's timing
(docs/benchmarks.md, session 14: a change with 5% more float instructions here ran
20-38% slower on the H200).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Compiling needs the kernels as Triton JIT functions, not the interpreter's.
os.environ["TRITON_INTERPRET"] = "0"

KERNELS = {  # name -> (module, function)
    "fwd": ("_fwd", "_evoflash_fwd_kernel"),
    "dq": ("_bwd", "_evoflash_bwd_dq_kernel"),
    "dkdv": ("_bwd", "_evoflash_bwd_dkdv_kernel"),
    "dbias": ("_bwd", "_evoflash_bwd_dbias_kernel"),
}
FP32_POINTERS = {"LSE", "RSCALE", "DELTA", "DQ_ACC", "DBIAS_PART"}
INT_POINTERS = {"RFLAG"}
FLAGS = {  # constexpr flags of a triangle-attention call (OF3's training path)
    "HAS_MASK": True, "HAS_BIAS": True, "BIAS_PER_S": False, "GATED": False,
    "PRECISION": 0, "COMPUTE_DQ": True, "STORE_DS": False, "FUSE_DQ": False,
    "EVEN_N": True, "COL_MASK": True,
}
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9]*)")


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton's signature: uppercase arguments are pointers (statistics fp32, flags
    int32, the rest ``dtype``) unless they are sizes; ``sm_scale`` fp32; every
    other scalar int32."""
    sizes = {"B", "S", "N", "H", "D", "S_CHUNK", "N_BUCKET", "S_BUCKET"}
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            if name not in constexprs:
                raise SystemExit(f"no value for constexpr {name}")
        elif name == "sm_scale":
            signature[name] = "fp32"
        elif name.isupper() and name not in sizes:
            signature[name] = ("*fp32" if name in FP32_POINTERS
                               else "*i32" if name in INT_POINTERS else f"*{dtype}")
        else:
            signature[name] = "i32"
    return signature


def compile_kernel(name: str, block: tuple[int, int], s_group: int, warps: int,
                   stages: int, head_dim: int, dtype: str) -> dict:
    """Compile ``name`` for sm_90a; the report's fields (see the module doc)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from of3_megafold.kernels.evoflash.configs import d_block

    module, function = KERNELS[name]
    kernel = getattr(
        importlib.import_module(f"of3_megafold.kernels.evoflash.{module}"), function)
    names = [p.name for p in kernel.params]
    constexprs = {key: value for key, value in FLAGS.items() if key in names}
    block_d = d_block(head_dim)  # as the launcher pads it
    constexprs.update(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_D=block_d,
                      PAD_D=block_d != head_dim)
    if "S_GROUP" in names:
        constexprs["S_GROUP"] = s_group
    source = ASTSource(kernel, _signature(kernel, dtype, constexprs),
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    report = {
        "kernel": name, "block": list(block), "s_group": s_group, "warps": warps,
        "stages": stages, "head_dim": head_dim, "dtype": dtype,
        "triton": triton.__version__,
        "convert_layout": [
            line.strip().split(" loc(")[0]
            for line in ttgir.splitlines()
            if "ttg.convert_layout" in line
        ],
    }
    report.update(_ptxas_and_sass(ptx))
    return report


def _tool(name: str) -> Path:
    """A CUDA tool bundled with Triton's NVIDIA backend (the newest ptxas: the PTX
    Triton writes may need a newer one than ``ptxas``)."""
    import triton

    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for candidate in (f"{name}-blackwell", name):
        if (folder / candidate).exists():
            return folder / candidate
    raise SystemExit(f"{name} not found in {folder}")


def _ptxas_and_sass(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        source.write_text(ptx)
        info = subprocess.run([str(_tool("ptxas")), "-arch=sm_90a", "-v", str(source),
                               "-o", str(cubin)], capture_output=True, text=True,
                              check=True).stderr
        sass = subprocess.run([str(_tool("cuobjdump")), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    ops = collections.Counter(
        match.group(1)
        for line in sass.splitlines()
        if (match := SASS_LINE.match(line))
    )
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "sass_instructions": sum(ops.values()),
        "sass_ops": dict(ops.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--block", type=int, nargs=2, default=(64, 64),
                        metavar=("M", "N"), help="BLOCK_M BLOCK_N")
    parser.add_argument("--s-group", type=int, default=1)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--json", action="store_true", help="the whole report as JSON")
    args = parser.parse_args(argv)
    report = compile_kernel(args.kernel, tuple(args.block), args.s_group, args.warps,
                            args.stages, args.head_dim, args.dtype)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['kernel']} {report['block']} S_GROUP {report['s_group']}, "
          f"{report['warps']} warps, {report['stages']} stages, "
          f"D {report['head_dim']}, {report['dtype']} "
          f"(Triton {report['triton']}, sm_90a)")
    print(f"registers {report['registers']}, spills {report['spill_store_bytes']} B, "
          f"{report['sass_instructions']} SASS instructions")
    print("layout conversions:")
    for line in report["convert_layout"]:
        print(f"  {line[:150]}")
    top = list(report["sass_ops"].items())[:20]
    print("SASS ops: " + ", ".join(f"{op} {count}" for op, count in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
