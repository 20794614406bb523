"""``of3-megafold bench triangle-multiplication``: OF3's triangle multiplicative
update, forward + backward.

Providers, side by side in one process on the same weights and inputs, all under
bf16 autocast (how OF3 trains):

- ``of3-eager``: OF3's own ``TriangleMultiplicationOutgoing``/``Incoming`` module;
- ``of3-compile``: the same module under ``torch.compile`` (default mode);
- ``kit``: :func:`of3_megafold.kernels.triangle_multiplication.triangle_multiplication`
  on the module's parameters (what EvoFusion's key runs);
- ``of3-cueq``: the module with OF3's ``use_cueq_triangle_kernels`` (cuEquivariance's
  fused kernel, with OF3's glue); a ``skipped`` row names the package when it is
  missing.

Cases: the pairformer's shape, ``z [1, N, N, 128]`` bf16 with ``c_hidden = 128``,
outgoing at N = 384, 768, 1024 and incoming at N = 768; fp32 parameters; a mask with
~10% zeros. One call = forward, backward with a fixed output gradient, gradients of
``z`` and every parameter; ``peak_mib`` is the memory that call allocates above what
was allocated before it (as in the transition bench).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from of3_megafold.bench import rivals
from of3_megafold.bench.common import append_rows, environment_metadata, measure_into

SIZES = (384, 768, 1024)
INCOMING_SIZES = (768,)
PROVIDERS = ("of3-eager", "of3-compile", "kit", "of3-cueq")


def _cases(quick: bool, on_gpu: bool, sizes: Sequence[int] | None) -> list[dict]:
    if not on_gpu:  # CPU smoke run: the interpreter is slow
        return [dict(direction="outgoing", N=16, c=32)]
    out = (768,) if quick else tuple(sizes or SIZES)
    inc = () if quick else INCOMING_SIZES
    return [dict(direction="outgoing", N=n, c=128) for n in out] + [
        dict(direction="incoming", N=n, c=128) for n in inc
    ]


def _module(direction: str, c: int, device: torch.device) -> torch.nn.Module:
    from openfold3.core.model.layers import triangular_multiplicative_update as tmu

    cls = (tmu.TriangleMultiplicationOutgoing if direction == "outgoing"
           else tmu.TriangleMultiplicationIncoming)
    module = cls(c_z=c, c_hidden=c).to(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():  # OF3 initialises linear_z to zero
            scale = 0.1 if p.dim() == 1 else p.shape[1] ** -0.5
            p.copy_(scale * torch.randn(p.shape, generator=gen) + (p.dim() == 1))
    return module


def inputs(n: int, c: int, device: torch.device):
    """``(z, dz, mask)`` of one case: ``z`` (requiring grad) and the output gradient
    ``dz`` standard normal ``[1, n, n, c]`` bf16, ``mask`` ``[1, n, n]`` fp32 with ~10%
    zeros; fixed seed, so every provider and every script gets the same values."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(1, n, n, c, generator=gen).to(device, torch.bfloat16)
    dz = torch.randn(1, n, n, c, generator=gen).to(device, torch.bfloat16)
    mask = (torch.rand(1, n, n, generator=gen) > 0.1).to(device, torch.float32)
    return z.requires_grad_(), dz, mask


def forward_fn(provider: str, module: torch.nn.Module, z, mask):
    """The provider's forward of ``module`` on ``(z, mask)``, a no-argument call."""
    from of3_megafold.kernels.triangle_multiplication import triangle_multiplication

    if provider == "of3-eager":

        def forward():
            return module(z, mask)

    elif provider == "of3-compile":
        compiled = torch.compile(module)

        def forward():
            return compiled(z, mask)

    elif provider == "of3-cueq":

        def forward():
            return module(z, mask, use_cueq_triangle_kernels=True)

    else:
        m = module
        params = (m.layer_norm_in.weight, m.layer_norm_in.bias, m.linear_a_p.weight,
                  m.linear_a_g.weight, m.linear_b_p.weight, m.linear_b_g.weight,
                  m.linear_g.weight, m.layer_norm_out.weight, m.layer_norm_out.bias,
                  m.linear_z.weight)

        def forward():
            return triangle_multiplication(z, mask, *params, outgoing=m._outgoing,
                                           eps=m.layer_norm_in.eps)

    return forward


def _step_fn(provider: str, module: torch.nn.Module, z, mask, dz):
    forward = forward_fn(provider, module, z, mask)
    leaves = [z, *module.parameters()]

    def step():
        with torch.autocast(z.device.type, dtype=torch.bfloat16):
            out = forward()
        out.backward(dz)
        for t in leaves:
            t.grad = None

    return step


def run(
    out_json: Path,
    quick: bool = False,
    *,
    sizes: Sequence[int] | None = None,
    providers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Time every provider on every case and append the rows to ``out_json``.

    ``quick``: outgoing N=768 only (on CPU: one tiny case through the Triton
    interpreter, eager and kit only). ``sizes``: outgoing N instead of the defaults.
    """
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    providers = tuple(providers or (PROVIDERS if on_gpu else ("of3-eager", "kit")))
    meta = environment_metadata(device)
    rows: list[dict[str, Any]] = []
    for case in _cases(quick, on_gpu, sizes):
        n, c = case["N"], case["c"]
        z, dz, mask = inputs(n, c, device)
        module = _module(case["direction"], c, device)
        for provider in providers:
            row = dict(bench="triangle_multiplication", case=case["direction"],
                       provider=provider, shape=f"1x{n}x{n}x{c}", N=n, c=c,
                       dtype="bfloat16", mode="fwd+bwd")
            skipped = rivals.unavailable("cueq") if provider == "of3-cueq" else None
            measure_into(row, partial(_step_fn, provider, module, z, mask, dz), skipped)
            row.update(meta)
            rows.append(row)
            append_rows(out_json, [row])  # kept if a later case is cut off
            print(
                f"{row['case']:8} {row['shape']:>16} {provider:12} "
                + (f"{row['ms']:8.3f} ms {row['peak_mib'] or 0:8.0f} MiB"
                   if "ms" in row else row.get("error") or row["skipped"]),
                flush=True,
            )
    return rows
