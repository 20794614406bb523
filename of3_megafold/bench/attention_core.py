"""``of3-megafold bench attention``: attention with pair bias, forward + backward.

The attention core alone, ``softmax(Q K^T / sqrt(D) + mask_bias + pair_bias) V``
over ``[B, S, N, H, D]`` inputs with a ``[B, 1, H, N, N]`` pair bias shared by the S
slices and an OF3 ``1e9 * (mask - 1)`` key mask (the last ~5 % of the keys padded).
Providers, side by side in one process on the same inputs:

- ``torch``: :func:`~of3_megafold.kernels.evoflash.evoflash_attention_reference`
  (plain torch, OF3's ``_attention`` in the kit's layout);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (memory-efficient
  backend) with mask and bias added and expanded over S into one ``attn_mask``;
- ``of3-triton``: OF3's ``TritonEvoformer`` kernel;
- ``kit``: :func:`~of3_megafold.kernels.evoflash.evoflash_attention`, deterministic;
- ``kit-atomic``: the same with ``deterministic=False`` (dQ by fp32 atomics);
- ``kit-fp32-bias``: the kit with an fp32 pair bias (at triangle N=1024 and the
  larger diffusion size only);
- ``cueq``, ``deepspeed``: cuEquivariance's and DeepSpeed's kernels
  (:mod:`of3_megafold.bench.rivals`), each timed on inputs already in its own
  layout (the layout copy is made once, outside the timing); a missing one gets a
  row with ``skipped`` naming the package.

Shapes: triangle attention ``[1, N, N, 4, 32]`` (N = 256 ... 2048) and the diffusion
transformer ``[1, 48, N, 16, 48]`` (N = 384, 768); bf16 q/k/v and pair bias. Case
``diffusion-hp`` is the diffusion shape as OF3 trains it: OF3 calls the diffusion
transformer's (and the trunk's single) attention with ``use_high_precision=True``, so
its ``_attention`` runs in fp32 (bf16 q/k/v upcast); there ``torch`` upcasts, ``sdpa``
gets fp32 inputs, ``kit`` runs ``high_precision=True`` (fp32 tiles; dots at torch's
float32 matmul precision) and OF3's Triton kernel, which OF3 never uses there, sits
out. One call = forward, backward with a fixed output gradient, gradients of q, k, v
and the pair bias. ``tflops`` counts ``3.5 x 4 B S H N^2 D`` (forward + backward of
the two matmuls), not any recomputation. On the first shape every provider's output and
gradients are also compared with the fp32 reference (``err_*`` fields: max abs
difference). A provider that runs out of memory gets ``error: out of memory``.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from of3_megafold.bench import rivals
from of3_megafold.bench.common import append_rows, environment_metadata, timed_peak

TRIANGLE_SIZES = (256, 384, 512, 768, 1024, 1536, 2048)
DIFFUSION_SIZES = (384, 768)
PROVIDERS = (
    "torch",
    "sdpa",
    "of3-triton",
    "kit",
    "kit-atomic",
    "kit-fp32-bias",
    *rivals.ATTENTION_CALLS,
)
GRAD_NAMES = ("o", "dq", "dk", "dv", "dbias")


def _cases(
    quick: bool, on_gpu: bool, sizes: Mapping[str, Sequence[int]] | None = None
) -> list[dict[str, Any]]:
    if not on_gpu:  # CPU smoke run through the Triton interpreter
        return [dict(case="triangle", shape=(1, 16, 16, 2, 16))]
    sizes = {"triangle": TRIANGLE_SIZES, "diffusion": DIFFUSION_SIZES, **(sizes or {})}
    tri = (512, 1024) if quick else sizes["triangle"]
    dif = (768,) if quick else sizes["diffusion"]
    cases = [dict(case="triangle", shape=(1, n, n, 4, 32)) for n in tri] + [
        dict(case="diffusion", shape=(1, 48, n, 16, 48)) for n in dif
    ]
    cases += [dict(case="diffusion-hp", shape=(1, 48, n, 16, 48)) for n in dif]
    # The target shapes first, so a time-boxed run measures them.
    targets = {(1, 1024, 1024, 4, 32), (1, 48, 768, 16, 48)}
    return sorted(cases, key=lambda c: c["shape"] not in targets)


def _inputs(shape, device, dtype, bias_dtype):
    B, S, N, H, D = shape
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*s, dt=dtype):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dt)

    q, k, v = (randn(B, S, N, H, D).requires_grad_() for _ in range(3))
    pair_bias = randn(B, 1, H, N, N, dt=bias_dtype).requires_grad_()
    keep = torch.ones(B, S, N)
    keep[..., N - max(1, N // 20) :] = 0.0
    mask_bias = (1e9 * (keep - 1.0))[:, :, None, None, :].to(device=device, dtype=dtype)
    do = randn(B, S, N, H, D)
    return q, k, v, mask_bias, pair_bias, do


HIGH_PRECISION_PROVIDERS = ("torch", "sdpa", "kit")


def _forward_fn(provider: str, high_precision: bool = False):
    """``f(q, k, v, mask_bias, pair_bias) -> o`` in the ``[B, S, N, H, D]`` layout;
    ``high_precision``: OF3's ``use_high_precision`` numerics (fp32 attention)."""
    from of3_megafold.kernels.evoflash import (
        evoflash_attention,
        evoflash_attention_reference,
    )

    if provider == "torch":

        def torch_attention(q, k, v, mask_bias, pair_bias):
            return evoflash_attention_reference(
                q, k, v, mask_bias, pair_bias, upcast=high_precision
            )

        return torch_attention
    if provider == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v, mask_bias, pair_bias):
            B, S, N, H, D = q.shape
            in_dtype = q.dtype
            if high_precision:
                q, k, v = q.float(), k.float(), v.float()
            attn_mask = (pair_bias + mask_bias).to(q.dtype).reshape(B * S, H, N, N)

            def heads(t):
                return t.reshape(B * S, N, H, D).transpose(1, 2)

            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    heads(q), heads(k), heads(v), attn_mask=attn_mask
                )
            return o.transpose(1, 2).reshape(B, S, N, H, D).to(in_dtype)

        return sdpa
    if provider in rivals.ATTENTION_CALLS:
        call = rivals.ATTENTION_CALLS[provider]()

        def rival(q, k, v, mask_bias, pair_bias):
            native = call.to_native(q, k, v, mask_bias, pair_bias)
            return call.from_native(call.forward(*native))

        return rival
    if provider == "of3-triton":
        from openfold3.core.kernels.triton.evoformer import TritonEvoformer

        if TritonEvoformer is None:
            raise RuntimeError("OF3's Triton kernel is unavailable")

        def of3(q, k, v, mask_bias, pair_bias):
            # TritonEvoformer(Q, K, V, res_mask, pair_bias, has_pair_bias): Q/K/V
            # [B, S, N, H, D], res_mask [B, S, 1, 1, N], pair_bias [B, 1, H, N, N]
            return TritonEvoformer(q, k, v, mask_bias, pair_bias, True)

        return of3

    deterministic = provider != "kit-atomic"

    def kit(q, k, v, mask_bias, pair_bias):
        return evoflash_attention(
            q,
            k,
            v,
            mask_bias,
            pair_bias,
            deterministic=deterministic,
            high_precision=high_precision,
        )

    return kit


def _timed(provider: str, high_precision: bool, inputs: tuple):
    """``(forward, inputs)`` that ``provider`` is timed on: a rival runs on inputs
    already in its own layout, made once here, outside the timing."""
    if provider not in rivals.ATTENTION_CALLS:
        return _forward_fn(provider, high_precision), inputs
    call = rivals.ATTENTION_CALLS[provider]()
    q, k, v, mask_bias, pair_bias, do = inputs
    with torch.no_grad():
        q, k, v, mask, bias = call.to_native(q, k, v, mask_bias, pair_bias)
        do = call.to_native_out(do)
    q, k, v, bias = (t.detach().requires_grad_() for t in (q, k, v, bias))
    return call.forward, (q, k, v, mask, bias, do)


def _step(forward, q, k, v, mask_bias, pair_bias, do):
    leaves = (q, k, v, pair_bias)

    def step():
        forward(q, k, v, mask_bias, pair_bias).backward(do)
        for t in leaves:
            t.grad = None

    return step


def _errors(forward, q, k, v, mask_bias, pair_bias, do) -> dict[str, float]:
    """Max abs difference of output and gradients from the fp32 reference."""
    from of3_megafold.kernels.evoflash import evoflash_attention_reference

    def run(fn, upcast_bias):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, pair_bias)]
        if upcast_bias:
            leaves[3] = leaves[3].detach().float().requires_grad_()
        o = fn(*leaves[:3], mask_bias, leaves[3])
        grads = torch.autograd.grad(o, leaves, do)
        return [o.detach()] + list(grads)

    def reference(q, k, v, m, b):
        return evoflash_attention_reference(q, k, v, m, b, upcast=True)

    got = run(forward, upcast_bias=False)
    want = run(reference, upcast_bias=True)
    return {
        f"err_{name}": (g.float() - w.float()).abs().max().item()
        for name, g, w in zip(GRAD_NAMES, got, want, strict=True)
    }


def run(
    out_json: Path,
    quick: bool = False,
    *,
    sizes: Mapping[str, Sequence[int]] | None = None,
    providers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Time every provider on every shape and append the rows to ``out_json``.

    ``quick``: triangle N = 512, 1024 and diffusion N = 768 (on CPU: one tiny
    triangle shape through the Triton interpreter, ``torch`` and ``kit`` only).
    ``sizes``: N per case (``triangle``, ``diffusion``; the diffusion-hp case follows
    ``diffusion``) instead of the defaults; ``providers``: a subset of
    :data:`PROVIDERS` (GPU runs).
    """
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16
    if not on_gpu:
        providers = ("torch", "kit")
    providers = PROVIDERS if providers is None else tuple(providers)
    meta = environment_metadata(device)
    rows: list[dict[str, Any]] = []
    for index, case in enumerate(_cases(quick, on_gpu, sizes)):
        shape = case["shape"]
        B, S, N, H, D = shape
        flops = 3.5 * 4 * B * S * H * N * N * D
        high_precision = case["case"] == "diffusion-hp"
        for provider in providers:
            if high_precision and provider not in HIGH_PRECISION_PROVIDERS:
                continue
            skipped = (
                rivals.unavailable(provider) if provider in rivals.RIVALS else None
            )
            fp32_bias = provider == "kit-fp32-bias"
            if fp32_bias and (N, case["case"]) not in (
                (1024, "triangle"),
                (768, "diffusion"),
            ):
                continue
            row = dict(
                bench="attention",
                case=case["case"],
                provider=provider,
                shape="x".join(map(str, shape)),
                B=B,
                S=S,
                N=N,
                H=H,
                D=D,
                dtype=str(dtype).removeprefix("torch."),
                bias_dtype="float32" if fp32_bias else "bfloat16",
                mode="fwd+bwd",
                high_precision=high_precision,
                matmul_precision=torch.get_float32_matmul_precision(),
            )
            try:
                if skipped:
                    row["skipped"] = skipped
                else:
                    inputs = _inputs(
                        shape, device, dtype, torch.float32 if fp32_bias else dtype
                    )
                    if index == 0:
                        row.update(
                            _errors(_forward_fn(provider, high_precision), *inputs)
                        )
                    forward, inputs = _timed(provider, high_precision, inputs)
                    timing = timed_peak(_step(forward, *inputs))
                    row.update(
                        ms=timing.ms,
                        peak_mib=timing.peak_mib,
                        tflops=flops / (timing.ms * 1e-3) / 1e12,
                    )
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            except (RuntimeError, ValueError, ImportError) as err:
                # e.g. no SDPA kernel for this input, a rival's shape limits or
                # a rival's build failing on first use
                row["error"] = (
                    f"{type(err).__name__}: "
                    + (str(err).strip().splitlines() or [""])[0][:200]
                )
            inputs = forward = None
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            row.update(meta)
            rows.append(row)
            append_rows(out_json, [row])  # kept if a later case is cut off
            errs = " ".join(
                f"{k[4:]}={row[k]:.2g}" for k in row if k.startswith("err_")
            )
            print(
                f"{row['case']:9} {row['shape']:>16} {provider:14} "
                + (
                    f"{row['ms']:9.3f} ms {row['peak_mib'] or 0:9.0f} MiB "
                    f"{row['tflops']:6.1f} TFLOP/s {errs}"
                    if "ms" in row
                    else row.get("error") or row["skipped"]
                ),
                flush=True,
            )
    return rows
