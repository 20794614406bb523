"""``of3-megafold bench smooth-lddt``: the smooth lDDT loss, forward + backward.

Providers, side by side in one process on the same inputs:

- ``of3-dense``: OF3's own ``smooth_lddt_loss`` (dense ``[B, S, N, N]``);
- ``of3-compile``: the same function under ``torch.compile(dynamic=False)``: fp32 at
  N = 1262, 3329, 7680, 12000 and bf16 at 7680 (one Inductor compile per shape; this
  bounds the run to about three minutes of GPU time);
- ``kit-fused``: :func:`smooth_lddt_fused`, exact;
- ``kit-ball-query-K``: :func:`smooth_lddt_ball_query` with ``K`` = 128, 256, 512
  (neighbour search included in every call, as in training with a fresh seed);
- ``kit-ball-query-256-det``: the same with ``deterministic=True``.

Inputs: one structure (batch 1) with 2 diffusion samples; ground truth uniform in a
ball at 0.07 atoms per cubic angstrom (protein density), prediction = truth + N(0, 1 A)
noise per coordinate, every atom protein and resolved. N_atom = 1262, 3329, 4000,
6000, 7680, 12000, 50000; fp32 and bf16 (positions in that dtype; the kit computes
in fp32). One call = loss forward and backward to the positions; ``peak_mib`` is
what that call allocates above what was allocated before it. Dense providers that
run out of memory get a row with ``error``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from of3_megafold.bench.common import (
    append_rows,
    environment_metadata,
    free_device_memory,
    is_out_of_memory,
    timed_peak,
)
from of3_megafold.kernels.backend import interpreter_enabled

SIZES = (1262, 3329, 4000, 6000, 7680, 12000, 50000)
QUICK_SIZES = (1262, 7680)
COMPILE_SIZES = {torch.float32: (1262, 3329, 7680, 12000), torch.bfloat16: (7680,)}
BALL_QUERY_K = (128, 256, 512)
SAMPLES = 2
DENSITY = 0.07  # atoms per cubic angstrom
EPS = 1e-8


def make_inputs(
    n_atom: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Uniform ball at protein density, truth + N(0, 1 A) noise, all protein.

    Positions are in ``dtype``; masks and per-atom features stay float32, as in
    OF3's batches under bf16 autocast (in bf16, counts of ones round: 50,000 atoms
    would sum to 49,920 and break OF3's atom broadcasting).
    """
    gen = torch.Generator().manual_seed(seed)
    radius = (3 * n_atom / (4 * math.pi * DENSITY)) ** (1 / 3)
    direction = torch.randn(n_atom, 3, generator=gen)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    truth = direction * radius * torch.rand(n_atom, 1, generator=gen) ** (1 / 3)
    x = truth + torch.randn(SAMPLES, n_atom, 3, generator=gen)
    return {
        "x": x[None].to(device, dtype),
        "truth": truth[None, None].to(device, dtype),
        "is_nucleotide": torch.zeros(1, n_atom, device=device),
        "atom_mask": torch.ones(1, 1, n_atom, device=device),
    }


def of3_batch(inputs: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """OF3's batch layout for ``smooth_lddt_loss``: one atom per token."""
    n_atom = inputs["x"].shape[-2]
    like = inputs["atom_mask"]
    ones = torch.ones(1, 1, n_atom, device=like.device, dtype=like.dtype)
    batch = {
        "token_mask": ones,
        "num_atoms_per_token": ones,
        "is_dna": inputs["is_nucleotide"][:, None],
        "is_rna": torch.zeros_like(ones),
        "ground_truth": {
            "atom_positions": inputs["truth"],
            "atom_resolved_mask": inputs["atom_mask"],
        },
    }
    return batch, ones


def _loss_fn(provider: str, inputs: dict[str, torch.Tensor]) -> Callable:
    if provider in ("of3-dense", "of3-compile"):
        from openfold3.core.loss.diffusion import smooth_lddt_loss

        batch, loss_token_mask = of3_batch(inputs)
        fn = smooth_lddt_loss
        if provider == "of3-compile":
            torch._dynamo.reset()  # a fresh compile per shape, no recompile limit
            fn = torch.compile(smooth_lddt_loss, dynamic=False)
        return lambda x: fn(x, batch, loss_token_mask, EPS)

    from of3_megafold.kernels.smooth_lddt import (
        smooth_lddt_ball_query,
        smooth_lddt_fused,
    )

    args = (inputs["truth"], inputs["is_nucleotide"], inputs["atom_mask"])
    if provider == "kit-fused":
        return lambda x: smooth_lddt_fused(x, *args, eps=EPS)
    k = int(provider.split("-")[3])
    deterministic = provider.endswith("-det")
    return lambda x: smooth_lddt_ball_query(
        x, *args, max_neighbors=k, seed=0, eps=EPS, deterministic=deterministic
    )


def _providers(n_atom: int, dtype: torch.dtype, on_gpu: bool) -> list[str]:
    providers = ["of3-dense"]
    if on_gpu and n_atom in COMPILE_SIZES[dtype]:
        providers.append("of3-compile")
    if not (on_gpu or interpreter_enabled()):
        return providers
    providers.append("kit-fused")
    providers += [f"kit-ball-query-{k}" for k in BALL_QUERY_K]
    providers.append("kit-ball-query-256-det")
    return providers


def run(
    out_json: Path,
    quick: bool = False,
    *,
    sizes: tuple[int, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> list[dict[str, Any]]:
    """Time every provider at every size and dtype; append the rows to ``out_json``.

    ``quick``: N = 1262 and 7680, fp32 only. On CPU: N = 48, the kernels through the
    Triton interpreter when ``TRITON_INTERPRET=1`` was set before Python started.
    ``sizes`` / ``dtypes`` override the GPU lists (to re-measure a few cases).
    """
    on_gpu = torch.cuda.is_available()
    if not (on_gpu or interpreter_enabled()):
        print(
            "no CUDA device and TRITON_INTERPRET is not set: OF3 only (set "
            "TRITON_INTERPRET=1 before starting Python to run the kernels on the CPU)"
        )
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        sizes = sizes or (QUICK_SIZES if quick else SIZES)
        dtypes = dtypes or (
            (torch.float32,) if quick else (torch.float32, torch.bfloat16)
        )
    else:
        sizes, dtypes = (48,), (torch.float32,)
    meta = environment_metadata(device)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for n_atom in sizes:
            inputs = make_inputs(n_atom, dtype, device)
            for provider in _providers(n_atom, dtype, on_gpu):
                row = dict(
                    bench="smooth_lddt",
                    provider=provider,
                    dtype=str(dtype).removeprefix("torch."),
                    n_atom=n_atom,
                    samples=SAMPLES,
                    batch=1,
                    mode="fwd+bwd",
                )
                try:
                    x = inputs["x"].clone().requires_grad_()
                    loss_fn = _loss_fn(provider, inputs)

                    def step(loss_fn=loss_fn, x=x):
                        loss_fn(x).sum().backward()
                        x.grad = None

                    timing = timed_peak(step)
                    # same call signature (grad enabled): no recompile for Inductor
                    loss = loss_fn(x).float().mean().item()
                    row.update(ms=timing.ms, peak_mib=timing.peak_mib, loss=loss)
                except Exception as err:  # an out-of-memory is a result here
                    if not is_out_of_memory(err):
                        raise
                    row["error"] = "out of memory"
                free_device_memory()
                row.update(meta)
                rows.append(row)
                append_rows(out_json, [row])  # kept if a later case is cut off
                shown = (
                    f"{row['ms']:9.3f} ms {row['peak_mib'] or 0:9.1f} MiB "
                    f"loss {row['loss']:.5f}"
                    if "ms" in row
                    else row["error"]
                )
                print(
                    f"{row['dtype']:9} N={n_atom:6} {provider:24} {shown}", flush=True
                )
    return rows
