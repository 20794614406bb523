"""``of3-megafold bench linear``: OF3's fp32 linear layers, forward and forward +
backward, in fp32, in TF32 and in the kit's 3xTF32.

Providers, side by side in one process on the same weights and inputs:

- ``torch-fp32``: ``F.linear`` at torch's default float32 matmul precision
  ("highest", OF3's in training): what OF3 runs;
- ``torch-tf32``: ``F.linear`` with TF32 allowed (``--use_tf32``, one TF32 GEMM):
  the precision trade, for scale;
- ``kit``: :func:`of3_megafold.kernels.tf32x3_linear.tf32x3_linear` (the
  ``tf32x3_linear`` extension).

Cases, from OF3's fp32 regions at 48 diffusion samples: the diffusion transformer's
projections (``x [48, N, 768] @ [768, 768]``) and its transition's first GEMM
(``[768, 1536]``) at N = 384 and 768 tokens, the atom transformer's (``[48, 3584,
128] @ [128, 128]``: 3,584 atoms, 9.3 per token at 384 tokens, a protein crop's
order), and one token-level GEMM without samples (``[1, 384, 768]``, below the
extension's ``MIN_MNK``). ``err`` is each provider's largest output error against
an fp64 ``linear`` on the same inputs, relative to the output's largest magnitude.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from of3_megafold.bench.common import append_rows, environment_metadata, measure_into

PROVIDERS = ("torch-fp32", "torch-tf32", "kit")


def _cases(quick: bool, on_gpu: bool) -> list[dict[str, Any]]:
    if not on_gpu:  # CPU smoke run: the split kernel runs under the interpreter
        return [dict(case="token", shape=(2, 9, 48), n=40)]
    cases = [
        dict(case="diffusion", shape=(48, 384, 768), n=768),
        dict(case="diffusion-transition", shape=(48, 384, 768), n=1536),
        dict(case="atom", shape=(48, 3584, 128), n=128),
        dict(case="token", shape=(1, 384, 768), n=768),
        dict(case="diffusion", shape=(48, 768, 768), n=768),
        dict(case="diffusion-transition", shape=(48, 768, 768), n=1536),
    ]
    return cases[:1] if quick else cases


def inputs(shape, n: int, device: torch.device):
    """``(x, weight, bias, dy)`` of one case, fp32, fixed seed: ``x`` standard
    normal, ``weight`` scaled by ``1/sqrt(K)`` as OF3's initialisations are,
    ``x``, ``weight`` and ``bias`` requiring grad."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    k = shape[-1]
    x = torch.randn(shape, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) * 0.1
    dy = torch.randn((*shape[:-1], n), generator=gen)
    leaves = [t.to(device).requires_grad_() for t in (x, weight, bias)]
    return (*leaves, dy.to(device))


def _forward(provider: str):
    from of3_megafold.kernels.backend import cuda_tf32
    from of3_megafold.kernels.tf32x3_linear import tf32x3_linear

    if provider == "kit":
        return tf32x3_linear

    def linear(x, weight, bias):
        with cuda_tf32(provider == "torch-tf32"):
            return F.linear(x, weight, bias)

    return linear


def _step_fn(provider: str, mode: str, x, weight, bias, dy):
    forward = _forward(provider)
    if mode == "fwd":

        def step():
            with torch.no_grad():
                forward(x, weight, bias)

        return step

    def step():
        forward(x, weight, bias).backward(dy)
        for t in (x, weight, bias):
            t.grad = None

    return step


def relative_error(provider: str, x, weight, bias) -> float:
    """Largest ``|out - out_fp64|`` over ``max |out_fp64|`` of the provider's
    forward."""
    with torch.no_grad():
        want = F.linear(x.double(), weight.double(), bias.double())
        got = _forward(provider)(x, weight, bias).double()
    return ((got - want).abs().max() / want.abs().max()).item()


def run(out_json: Path, quick: bool = False) -> list[dict[str, Any]]:
    """Time every provider on every case, forward and forward + backward, and append
    the rows to ``out_json``. ``quick``: the diffusion transformer at 384 tokens
    only (on CPU: one tiny case)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    meta = environment_metadata(device)
    rows: list[dict[str, Any]] = []
    for case in _cases(quick, on_gpu):
        shape, n = case["shape"], case["n"]
        x, weight, bias, dy = inputs(shape, n, device)
        m = x.numel() // shape[-1]
        for provider in PROVIDERS:
            err = relative_error(provider, x, weight, bias)
            for mode, gemms in (("fwd", 1), ("fwd+bwd", 3)):
                row = dict(
                    bench="linear",
                    case=case["case"],
                    provider=provider,
                    shape="x".join(map(str, shape)) + f"@{shape[-1]}x{n}",
                    mnk=m * n * shape[-1],
                    dtype="float32",
                    mode=mode,
                    err=err,
                )
                timing = measure_into(
                    row, partial(_step_fn, provider, mode, x, weight, bias, dy)
                )
                if timing is not None:
                    flops = 2 * gemms * m * n * shape[-1]
                    row["tflops"] = flops / (timing.ms * 1e-3) / 1e12
                row.update(meta)
                rows.append(row)
                append_rows(out_json, [row])  # kept if a later case is cut off
                print(
                    f"{row['case']:20} {row['shape']:>22} {provider:10} {mode:7} "
                    + (
                        f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s "
                        f"err {err:.1e}"
                        if "ms" in row
                        else row.get("error", "")
                    ),
                    flush=True,
                )
    return rows
