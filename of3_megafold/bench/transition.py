"""``of3-megafold bench transition``: OF3's SwiGLU transition, forward + backward.

Providers, side by side in one process on the same weights and inputs:

- ``of3-eager``: OF3's own ``SwiGLUTransition`` module;
- ``of3-compile``: the same module under ``torch.compile`` (default mode);
- ``kit``: :func:`of3_megafold.kernels.swiglu_transition.swiglu_transition` on the
  module's parameters;
- ``liger``: the module's parameters through Liger-Kernel's LayerNorm and
  ``silu(a) * b`` kernels and torch's linears
  (:func:`of3_megafold.bench.rivals.liger_swiglu_transition`); a ``skipped`` row
  names the package when it is missing.

Cases: the pair transition (``c=128, n=4``, ``x [1, N, N, 128]``) at N = 384, 768,
1024 and the single transition (``c=384, n=4``, ``x [1, N, 384]``) at N = 384, 768;
bf16 activations, fp32 parameters (OF3's ``Linear`` casts them to bf16, as in
training). One call = forward, backward with a fixed output gradient, gradients of
the input and every parameter; ``peak_mib`` is the memory that call allocates above
what was allocated before it (inputs, output gradient and weights excluded; the
output, the input gradient, the parameter gradients and every temporary counted).
``tflops`` counts the nine GEMMs a forward + backward needs (``18 M c H`` flops),
not the kit's recomputation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from of3_megafold.bench import rivals
from of3_megafold.bench.common import append_rows, environment_metadata, measure_into

PAIR_SIZES = (384, 768, 1024)
SINGLE_SIZES = (384, 768)


def _cases(
    quick: bool, on_gpu: bool, sizes: Mapping[str, Sequence[int]] | None = None
) -> list[dict[str, Any]]:
    if not on_gpu:  # CPU smoke run: the interpreter is slow
        return [dict(case="pair", shape=(1, 16, 16, 32), c=32, n=4)]
    sizes = {"pair": PAIR_SIZES, "single": SINGLE_SIZES, **(sizes or {})}
    pair = (768,) if quick else sizes["pair"]
    single = (384,) if quick else sizes["single"]
    return [dict(case="pair", shape=(1, n, n, 128), c=128, n=4) for n in pair] + [
        dict(case="single", shape=(1, n, 384), c=384, n=4) for n in single
    ]


def _module(c: int, n: int, device: torch.device) -> torch.nn.Module:
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = SwiGLUTransition(c_in=c, n=n).to(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():  # OF3 initialises linear_out to zero
            p.copy_(0.05 * torch.randn(p.shape, generator=gen) + (p.dim() == 1))
    return module


def inputs(shape, device: torch.device, dtype: torch.dtype):
    """``(x, dy, mask)`` of one case: ``x`` (requiring grad) and the output gradient
    ``dy`` standard normal of ``shape``, ``mask`` ``shape[:-1]`` with ~10% zeros;
    fixed seed, so every provider and every script gets the same values."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    mask = (torch.rand(shape[:-1], generator=gen) > 0.1).to(device, dtype)
    return x, dy, mask


def _step_fn(provider: str, module: torch.nn.Module, x, mask, dy):
    """One forward + backward; clears the gradients afterwards so every call
    allocates them afresh (and the peak counts them)."""
    from of3_megafold.kernels.swiglu_transition import swiglu_transition

    if provider == "of3-eager":

        def forward():
            return module(x, mask=mask)

    elif provider == "of3-compile":
        compiled = torch.compile(module)

        def forward():
            return compiled(x, mask=mask)

    elif provider == "liger":
        liger = rivals.liger_swiglu_transition(module)

        def forward():
            return liger(x, mask)

    else:
        ln, sw, out = module.layer_norm, module.swiglu, module.linear_out
        weights = (ln.weight, ln.bias, sw.linear_a.weight, sw.linear_b.weight)

        def forward():
            return swiglu_transition(x, *weights, out.weight, mask=mask)

    leaves = [x, *module.parameters()]

    def step():
        forward().backward(dy)
        for t in leaves:
            t.grad = None

    return step


def run(
    out_json: Path,
    quick: bool = False,
    *,
    sizes: Mapping[str, Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Time every provider on every case and append the rows to ``out_json``.

    ``quick``: pair N=768 and single N=384 only (on CPU: one tiny case through the
    Triton interpreter, eager and kit only). ``sizes``: N per case (``pair``,
    ``single``) instead of the defaults; an empty list leaves the case out.
    """
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16
    providers = (
        ("of3-eager", "of3-compile", "kit", "liger") if on_gpu else ("of3-eager", "kit")
    )
    meta = environment_metadata(device)
    rows: list[dict[str, Any]] = []
    for case in _cases(quick, on_gpu, sizes):
        shape, c, n = case["shape"], case["c"], case["n"]
        m = 1
        for s in shape[:-1]:
            m *= s
        x, dy, mask = inputs(shape, device, dtype)
        module = _module(c, n, device)
        for provider in providers:
            row = dict(
                bench="transition",
                case=case["case"],
                provider=provider,
                shape="x".join(map(str, shape)),
                N=shape[1],
                c=c,
                n=n,
                dtype=str(dtype).removeprefix("torch."),
                mode="fwd+bwd",
            )
            skipped = None
            if provider in rivals.RIVALS:
                skipped = rivals.unavailable(provider)
            timing = measure_into(
                row, partial(_step_fn, provider, module, x, mask, dy), skipped
            )
            if timing is not None:
                row["tflops"] = 18 * m * c * (n * c) / (timing.ms * 1e-3) / 1e12
            row.update(meta)
            rows.append(row)
            append_rows(out_json, [row])  # kept if a later case is cut off
            print(
                f"{row['case']:6} {row['shape']:>16} {provider:12} "
                + (
                    f"{row['ms']:8.3f} ms {row['peak_mib'] or 0:8.0f} MiB "
                    f"{row['tflops']:6.1f} TFLOP/s"
                    if "ms" in row
                    else row.get("error") or row["skipped"]
                ),
                flush=True,
            )
    return rows
