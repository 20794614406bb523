"""OF3's attention modules, forward + backward: stock, OF3's Triton kernel, the kit.

``of3-megafold bench attention`` runs this after the core benchmark
(:mod:`of3_megafold.bench.attention_core`). Cases:

- ``TriangleAttention(c_in=128, c_hidden=32, no_heads=4, starting=True)``, bf16
  weights and input ``[1, N, N, 128]``, all-ones mask (baseline table A in
  docs/benchmarks.md);
- ``DiffusionAttentionPairBias`` as OF3's diffusion transformer builds it (c_q 768,
  16 heads x 48, c_s 384, c_z 128), ``a [1, 48, N, 768]``, ``z [1, N, N, 128]``,
  high-precision core as OF3 calls it.

Providers: ``stock`` (OF3's torch path), ``of3-triton``
(``use_triton_triangle_kernels``; triangle only, OF3 never passes it to the diffusion
transformer), ``of3-cueq`` and ``of3-deepspeed`` (OF3's ``use_cueq_triangle_kernels``
and ``use_deepspeed_evo_attention``: cuEquivariance's and DeepSpeed's kernels through
OF3's own glue, triangle only, since OF3 runs the diffusion transformer's attention in
high precision, which those flags exclude; a missing package gets a ``skipped`` row,
:mod:`of3_megafold.bench.rivals`), ``kit`` (the extensions that act on these
modules forced on: ``evoflash_attention`` for the core and
``evofusion_transitions`` for OF3's 16-bit LayerNorm). Timing: the median of
``triton.testing.do_bench`` after warm-up; peak memory above what was allocated
before the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from of3_megafold.bench import common, rivals

TRIANGLE_N = (256, 384, 512, 768, 1024, 1536, 2048)
DIFFUSION_N = (384, 768)


def _triangle(n: int, device) -> tuple[torch.nn.Module, dict, Callable[[str], dict]]:
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    module = TriangleAttention(c_in=128, c_hidden=32, no_heads=4, starting=True)
    module = module.to(device=device, dtype=torch.bfloat16)
    inputs = {
        "x": torch.randn(1, n, n, 128, device=device, dtype=torch.bfloat16),
        "mask": torch.ones(1, n, n, device=device, dtype=torch.bfloat16),
    }

    def flags(provider: str) -> dict:
        return {
            "use_triton_triangle_kernels": provider == "of3-triton",
            "use_cueq_triangle_kernels": provider == "of3-cueq",
            "use_deepspeed_evo_attention": provider == "of3-deepspeed",
        }

    return module, inputs, flags


def _diffusion(n: int, device) -> tuple[torch.nn.Module, dict, Callable[[str], dict]]:
    from openfold3.core.model.layers.attention_pair_bias import (
        DiffusionAttentionPairBias,
    )

    module = DiffusionAttentionPairBias(
        c_q=768, c_k=768, c_v=768, c_s=384, c_z=128, c_hidden=48, no_heads=16
    ).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # AF3 zero-initialises some projections
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    samples = 48
    inputs = {
        "a": torch.randn(1, samples, n, 768, device=device, dtype=torch.bfloat16),
        "z": torch.randn(1, n, n, 128, device=device, dtype=torch.bfloat16),
        "s": torch.randn(1, samples, n, 384, device=device, dtype=torch.bfloat16),
        "mask": torch.ones(1, samples, n, device=device, dtype=torch.bfloat16),
    }

    def flags(provider: str) -> dict:
        return {"use_high_precision_attention": True}

    return module, inputs, flags


CASES = {"triangle": (_triangle, TRIANGLE_N), "diffusion": (_diffusion, DIFFUSION_N)}
# What the ``kit`` provider forces on (see the module docstring).
KIT = ("evoflash_attention", "evofusion_transitions")


# OF3 flag providers that run another project's kernel -> that rival's name
RIVAL_FLAGS = {"of3-cueq": "cueq", "of3-deepspeed": "deepspeed"}


def _providers(case: str) -> tuple[str, ...]:
    if case == "triangle":
        return ("stock", "of3-triton", *RIVAL_FLAGS, "kit")
    return ("stock", "kit")


def _step(module, inputs: dict, kwargs: dict, grad_out: torch.Tensor):
    leaves = {k: v.detach().requires_grad_(k != "mask") for k, v in inputs.items()}

    def step():
        out = module(**leaves, **kwargs)
        out.backward(grad_out)
        return out

    return step, [v for v in leaves.values() if v.requires_grad]


def _describe(row: dict[str, Any]) -> str:
    head = f"{row['case']:9s} N={row['n']:5d} {row['provider']:13s}"
    if "ms" not in row:
        return f"{head} {row.get('skipped') or row.get('error') or 'out of memory'}"
    peak = row["peak_mib"]
    return f"{head} {row['ms']:9.3f} ms " + (
        f"{peak:9.0f} MiB" if peak is not None else "(no CUDA peak)"
    )


def run(
    out_json: Path,
    quick: bool = False,
    *,
    sizes: Mapping[str, Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Time every case and provider; append the rows to ``out_json``.

    ``sizes``: N per case (``triangle``, ``diffusion``) instead of the defaults; an
    empty list leaves the case out.
    """
    from of3_megafold import activate, registry

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    meta = common.environment_metadata(device)
    rows: list[dict[str, Any]] = []
    kit_ok, kit_reason = True, ""
    for name in KIT:
        ok, reason = registry.get(name).available()
        if not ok:
            kit_ok, kit_reason = False, reason
    for case, (build, default_sizes) in CASES.items():
        case_sizes = (sizes or {}).get(case, default_sizes)
        for n in case_sizes[:1] if quick else case_sizes:
            if not on_gpu:
                n = min(n, 16)
            module, inputs, flags = build(n, device)
            with torch.no_grad():
                grad_out = torch.randn_like(module(**inputs, **flags("stock")))
            for provider in _providers(case):
                row = {"case": case, "n": n, "provider": provider, **meta}
                if provider == "kit" and not kit_ok:
                    rows.append({**row, "skipped": kit_reason})
                    common.append_rows(out_json, rows[-1:])
                    continue
                skipped = None
                if provider == "of3-triton" and not on_gpu:
                    skipped = "OF3's Triton kernel needs CUDA"
                elif provider in RIVAL_FLAGS:
                    skipped = rivals.unavailable(RIVAL_FLAGS[provider])
                if skipped:
                    rows.append({**row, "skipped": skipped})
                    common.append_rows(out_json, rows[-1:])
                    print(_describe(rows[-1]), flush=True)
                    continue
                activate(force=KIT if provider == "kit" else ())
                step, leaves = _step(module, inputs, flags(provider), grad_out)
                try:
                    timing = common.timed_peak(
                        step, grad_to_none=[*leaves, *module.parameters()]
                    )
                    row.update(ms=timing.ms, peak_mib=timing.peak_mib)
                except Exception as err:  # noqa: BLE001 (OOM is a result here)
                    if common.is_out_of_memory(err):
                        row["oom"] = True
                    elif provider in RIVAL_FLAGS:  # e.g. its build failing
                        row["error"] = f"{type(err).__name__}: {err}"[:200]
                    else:
                        raise
                finally:
                    activate()
                    common.free_device_memory()
                rows.append(row)
                common.append_rows(out_json, [row])  # kept if a later case is cut off
                print(_describe(row), flush=True)
            del module, inputs
            common.free_device_memory()
    return rows
