"""Compile an EvoFlash or fused-transition kernel for the H200 (sm_90a) without a
GPU and count what the compiler made of it.

    python scripts/offline_sass.py fwd --block 128 64 --s-group 1 --warps 4 --stages 3
    python scripts/offline_sass.py dkdv --block 64 64 --shape 1,48,768,16,48 --json
    python scripts/offline_sass.py transition-bwd --block 64 32 --warps 4 --stages 3

The transition kernels (``transition-fwd``, ``transition-bwd``: the forward and the
input-gradient kernel of the "gemm" backward, with its stores) take ``--block
BLOCK_M BLOCK_H`` and ``--channels`` (c; n*c = 4c), with OF3's pair-transition flags
(LayerNorm, a row mask, 16-bit weights; ``--dtype``); a tile element there is one
(row, hidden unit) pair.

For a kernel change, before spending device time on it: the layout conversions of
the Triton GPU IR (``ttg.convert_layout``, each a round trip through shared memory
unless trivial), the registers and spills that ptxas reports, and a histogram of
the SASS instructions. Triangle-attention flags by default (bf16, key mask, pair
bias shared over S, N a multiple of the tiles).

This host's Triton and its bundled ptxas compile; the GPU machine's (Triton 3.6 in
these sessions) may schedule and allocate differently. To compile with that version,
install it beside this one and put it first on the path:

    pip install --no-deps --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6 python scripts/offline_sass.py fwd --block 128 64

Either way the counts compare two versions of a kernel under one compiler; they do
not predict the GPU's timing (docs/benchmarks.md, session 14: a change with 5% more
float instructions here ran 20-38% slower on the H200; session 20: one with 7-8% fewer
loop instructions, the logit dots started from the bias tile, ran 20-30% slower there
too, because the bias tile left the software pipeline: look for ``LDG``, ``STS`` and
``BAR`` appearing in the loop where ``LDGSTS`` was).

The kernel is specialised as a launch at ``--shape`` would specialise it (Triton's
rules: an integer argument equal to 1 becomes a constant, one divisible by 16 and
every pointer get a divisibility-16 hint): without the hints the compiler cannot
vectorise the tile loads (session 14's scan lacked them: its bias tiles loaded one
element per instruction). ``loop`` counts the instructions of the kernel's main loop
(the longest backward branch of the SASS), per iteration and per tile element a
thread handles there: the dynamic cost the static histogram hides.
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
INT_POINTERS = {"RFLAG", "KRANGE"}
FLAGS = {  # constexpr flags of a triangle-attention call (OF3's training path)
    "HAS_MASK": True, "HAS_BIAS": True, "BIAS_PER_S": False, "GATED": False,
    "PRECISION": 0, "COMPUTE_DQ": True, "STORE_DS": False, "FUSE_DQ": False,
    "EVEN_N": True, "COL_MASK": True,
    "MASK_RANGES": os.environ.get("OFFLINE_SASS_MASK_RANGES", "1") == "1",
}
SHAPE = (1, 1024, 1024, 4, 32)  # triangle attention at N = 1024: B, S, N, H, D
TRANSITION_KERNELS = {  # name -> (module, function, extra constexpr flags)
    "transition-fwd": ("_fwd", "_swiglu_transition_fwd_kernel", {}),
    "transition-bwd": ("_bwd", "_swiglu_transition_bwd_input_kernel",
                       {"STORE_DX": True, "LN_GRAD": True, "NEED_DXN": True,
                        "STORE_HIDDEN": True}),
}
TRANSITION_FP32_POINTERS = {"LN_W", "LN_B", "MEAN", "RSTD", "DLN_W_PART",
                            "DLN_B_PART"}
SASS_LINE = re.compile(
    r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9]*)\S*([^;]*)")


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


def _argument_values(shape: tuple[int, ...], s_chunk: int) -> dict[str, int]:
    """The integer arguments of a launch at ``shape``: contiguous ``[B, S, N, H, D]``
    q, k, v, o, dO and gradients, a ``[B, S, 1, 1, N]`` key mask, a pair bias
    ``[B, 1, H, N, N]`` shared over S and the fp32 bias-gradient parts."""
    from of3_megafold.kernels.evoflash.configs import n_bucket, s_bucket

    B, S, N, H, D = shape
    values = {"B": B, "S": S, "N": N, "H": H, "D": D, "S_CHUNK": s_chunk,
              "N_BUCKET": n_bucket(N), "S_BUCKET": s_bucket(S),
              "stride_mb": S * N, "stride_ms": N, "stride_mn": 1,
              "stride_rb": S * 2, "stride_rs": 2,
              "stride_bb": H * N * N, "stride_bs": 0, "stride_bh": N * N,
              "stride_bi": N, "stride_dbp": B * H * N * N, "stride_dbb": H * N * N,
              "stride_dbs": 0, "stride_dbh": N * N, "stride_dbi": N}
    for prefix in ("q", "k", "v", "o", "do", "g", "gt"):
        values.update({f"stride_{prefix}b": S * N * H * D,
                       f"stride_{prefix}s": N * H * D,
                       f"stride_{prefix}n": H * D, f"stride_{prefix}h": D})
    return values


def _specialize(signature: dict, constexprs: dict, values: dict) -> dict:
    """Triton's specialisation of a launch: integers equal to 1 into ``constexprs``;
    the divisibility-16 hints of the others and of the pointers, returned."""
    attrs = {}
    for index, (name, kind) in enumerate(list(signature.items())):
        if kind.startswith("*"):
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif kind == "i32":
            if name not in values:
                raise SystemExit(f"no value for argument {name}")
            if values[name] == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            elif values[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def _compile(kernel, signature: dict, attrs: dict, constexprs: dict, warps: int,
             stages: int, elements: int, report: dict) -> dict:
    """Compile ``kernel`` for sm_90a and add to ``report`` what the compiler made of
    it (see the module doc); ``elements``: tile elements a program handles per
    iteration of its main loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in kernel.params]
    source = ASTSource(kernel, signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    report["triton"] = triton.__version__
    report["convert_layout"] = [
        line.strip().split(" loc(")[0]
        for line in compiled.asm["ttgir"].splitlines()
        if "ttg.convert_layout" in line
    ]
    report.update(_ptxas_and_sass(compiled.asm["ptx"]))
    loop = report["loop"]
    loop["elements_per_thread"] = elements // (32 * warps)
    loop["per_element"] = round(loop["instructions"] / loop["elements_per_thread"], 2)
    return report


def compile_kernel(name: str, block: tuple[int, int], s_group: int, warps: int,
                   stages: int, shape: tuple[int, ...], dtype: str) -> dict:
    """Compile EvoFlash's ``name`` for sm_90a; the report's fields (see the module
    doc)."""
    import importlib

    from of3_megafold.kernels.evoflash.configs import d_block

    module, function = KERNELS[name]
    kernel = getattr(
        importlib.import_module(f"of3_megafold.kernels.evoflash.{module}"), function)
    names = [p.name for p in kernel.params]
    constexprs = {key: value for key, value in FLAGS.items() if key in names}
    head_dim = shape[4]
    block_d = d_block(head_dim)  # as the launcher pads it
    constexprs.update(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_D=block_d,
                      PAD_D=block_d != head_dim,
                      EVEN_N=shape[2] % block[0] == 0 and shape[2] % block[1] == 0)
    if "S_GROUP" in names:
        constexprs["S_GROUP"] = s_group
    signature = _signature(kernel, dtype, constexprs)
    attrs = _specialize(signature, constexprs, _argument_values(shape, shape[1]))
    report = {
        "kernel": name, "block": list(block), "s_group": s_group, "warps": warps,
        "stages": stages, "shape": list(shape), "head_dim": head_dim, "dtype": dtype,
    }
    elements = block[0] * block[1] * (s_group if "S_GROUP" in names else 1)
    return _compile(kernel, signature, attrs, constexprs, warps, stages, elements,
                    report)


def compile_transition(name: str, block: tuple[int, int], warps: int, stages: int,
                       channels: int, dtype: str) -> dict:
    """Compile a fused-transition kernel for sm_90a as a pair transition over
    ``N = 768`` (589,824 rows) would launch it; the report's fields as for EvoFlash
    (a tile element: one row and hidden unit)."""
    import importlib

    import triton

    module, function, flags = TRANSITION_KERNELS[name]
    kernel = getattr(importlib.import_module(
        f"of3_megafold.kernels.swiglu_transition.{module}"), function)
    while not hasattr(kernel, "params"):  # autotune / heuristics wrappers
        kernel = kernel.fn
    c, h = channels, 4 * channels
    constexprs = {"NORMALIZE": True, "HAS_MASK": True, "FAST_SIGMOID": dtype != "fp32",
                  "INPUT_PRECISION": "ieee", "INTERPRETER": False,
                  "BLOCK_C": max(16, triton.next_power_of_2(c)), "BLOCK_M": block[0],
                  "BLOCK_H": block[1], "EVEN_WEIGHTS": h % block[1] == 0, **flags}
    values = {"M": 768 * 768, "C": c, "H": h, "ROW0": 0, "P0": 0}
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        arg = param.name
        if param.is_constexpr:
            signature[arg] = "constexpr"
        elif arg == "eps":
            signature[arg] = "fp32"
        elif arg in values or arg.startswith("stride_"):
            signature[arg] = "i32"
            if values.get(arg, c) % 16 == 0:  # strides: c
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "*fp32" if arg in TRANSITION_FP32_POINTERS else f"*{dtype}"
            attrs[(index,)] = [["tt.divisibility", 16]]
    report = {
        "kernel": name, "block": list(block), "s_group": 1, "warps": warps,
        "stages": stages, "shape": [768 * 768, c, h], "dtype": dtype,
    }
    return _compile(kernel, signature, attrs, constexprs, warps, stages,
                    block[0] * block[1], report)


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
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for line in sass.splitlines()
            if (m := SASS_LINE.match(line))]
    ops = collections.Counter(op for _, op, _ in code)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "sass_instructions": sum(ops.values()),
        "sass_ops": dict(ops.most_common()),
        "loop": _main_loop(code),
    }


def _main_loop(code: list[tuple[int, str, str]]) -> dict:
    """The instructions between the target and the source of the longest backward
    branch: one iteration of the kernel's main loop (software pipelining keeps it
    one body)."""
    spans = [(int(target.group(1), 16), address) for address, op, rest in code
             if op == "BRA" and (target := re.match(r"\s*(0x[0-9a-f]+)", rest))
             and int(target.group(1), 16) < address]
    if not spans:
        return {"instructions": 0, "ops": {}}
    start, end = max(spans, key=lambda span: span[1] - span[0])
    ops = collections.Counter(op for address, op, _ in code if start <= address <= end)
    return {"instructions": sum(ops.values()), "ops": dict(ops.most_common())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(KERNELS) + sorted(TRANSITION_KERNELS))
    parser.add_argument("--block", type=int, nargs=2, default=(64, 64),
                        metavar=("M", "N"), help="BLOCK_M BLOCK_N")
    parser.add_argument("--s-group", type=int, default=1)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--shape", default=",".join(map(str, SHAPE)),
                        help="B,S,N,H,D of the launch to specialise for (default: "
                             "triangle N=1024)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--channels", type=int, default=128,
                        help="transition kernels: c (n*c = 4c)")
    parser.add_argument("--json", action="store_true", help="the whole report as JSON")
    args = parser.parse_args(argv)
    if args.kernel in TRANSITION_KERNELS:
        report = compile_transition(args.kernel, tuple(args.block), args.warps,
                                    args.stages, args.channels, args.dtype)
    else:
        report = compile_kernel(args.kernel, tuple(args.block), args.s_group,
                                args.warps, args.stages,
                                tuple(int(x) for x in args.shape.split(",")),
                                args.dtype)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['kernel']} {report['block']} S_GROUP {report['s_group']}, "
          f"{report['warps']} warps, {report['stages']} stages, "
          f"shape {report['shape']}, {report['dtype']} "
          f"(Triton {report['triton']}, sm_90a)")
    print(f"registers {report['registers']}, spills {report['spill_store_bytes']} B, "
          f"{report['sass_instructions']} SASS instructions")
    loop = report["loop"]
    print(f"main loop: {loop['instructions']} instructions per iteration, "
          f"{loop['per_element']} per tile element of a thread "
          f"({loop['elements_per_thread']} per iteration)")
    print("  " + ", ".join(f"{op} {n}" for op, n in list(loop["ops"].items())[:20]))
    print("layout conversions:")
    for line in report["convert_layout"]:
        print(f"  {line[:150]}")
    top = list(report["sass_ops"].items())[:20]
    print("SASS ops: " + ", ".join(f"{op} {count}" for op, count in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
