"""The kit against other projects' kernels, on the GPU, in one process.

Runs three of ``of3-megafold bench``'s modules on a narrower set of shapes than their
full runs, with the rival providers of :mod:`of3_megafold.bench.rivals` next to OF3's
paths and the kit:

- ``attention_core``: SDPA, OF3's Triton kernel, the kit, cuEquivariance, DeepSpeed
  at triangle ``[1, N, N, 4, 32]`` and diffusion ``[1, 48, N, 16, 48]`` shapes;
- ``attention_module``: OF3's ``TriangleAttention`` with each kernel flag, and the kit;
- ``transition``: OF3's pair transition eager and compiled, the kit, Liger-Kernel;
- ``multiplication``: OF3's triangle multiplication eager and compiled, the kit, and
  OF3 with cuEquivariance's fused kernel (its ``use_cueq_triangle_kernels``).

Usage: ``python -m tools.gpu_rivals OUT_DIR [--what core module transition
multiplication]``;
rows go to ``OUT_DIR/<module>.json`` like the CLI's. Build DeepSpeed's op first
(``gpu_session.sh ds-build``), or its first call pays the build.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from of3_megafold import activate
from of3_megafold.bench import (
    attention_core,
    attention_module,
    transition,
    triangle_multiplication,
)

CORE_TRIANGLE = (256, 512, 768, 1024, 1536)
CORE_DIFFUSION = (384, 768)
CORE_PROVIDERS = ("sdpa", "of3-triton", "kit", "cueq", "deepspeed")
MODULE_TRIANGLE = (256, 512, 768, 1024)
TRANSITION_PAIR = (384, 768, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--what",
        nargs="+",
        choices=("core", "module", "transition", "multiplication"),
        default=["core", "module", "transition", "multiplication"],
    )
    args = parser.parse_args()
    activate()
    if "core" in args.what:
        attention_core.run(
            args.out_dir / "attention_core.json",
            sizes={"triangle": CORE_TRIANGLE, "diffusion": CORE_DIFFUSION},
            providers=CORE_PROVIDERS,
        )
    if "module" in args.what:
        attention_module.run(
            args.out_dir / "attention_module.json",
            sizes={"triangle": MODULE_TRIANGLE, "diffusion": ()},
        )
    if "transition" in args.what:
        transition.run(
            args.out_dir / "transition.json",
            sizes={"pair": TRANSITION_PAIR, "single": ()},
        )
    if "multiplication" in args.what:
        triangle_multiplication.run(args.out_dir / "triangle_multiplication.json")


if __name__ == "__main__":
    main()
