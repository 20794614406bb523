"""EvoFlash-3D in OF3's ``Attention``: attention with pair bias on one fused kernel.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_evoflash_attention``
(default false). With a key on, ``Attention.forward`` of every module of that model
(triangle attention start/end in the pairformer, MSA module, template stack and
confidence pairformer; ``AttentionPairBias`` on the single representation;
``DiffusionAttentionPairBias`` with its bias shared over the diffusion samples)
runs its core on :func:`evoflash_attention`: the ``[*, H, Q, K]`` logits are never
stored. Parameter names are unchanged, so OF3
checkpoints load as they are.

The key is mutually exclusive with OF3's own kernel flags
(``use_deepspeed_evo_attention``, ``use_cueq_triangle_kernels``,
``use_triton_triangle_kernels``, ``use_lma``) in the same mode; note OF3's ``eval``
section turns ``use_triton_triangle_kernels`` on by default.

The kernel takes equal query and key lengths. ``CrossAttentionPairBias`` (OF3's local
atom attention: blocks of 32 queries against 128 keys) therefore keeps OF3's path;
the whole module is 2-3% of a training step (docs/benchmarks.md,
"CrossAttentionPairBias, measured"), the bound on what a kernel could save there.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.kernels.backend import runs_on, triton_backend

NAME = "evoflash_attention"
FLAG = "use_evoflash_attention"
OF3_KERNEL_FLAGS = (
    "use_deepspeed_evo_attention",
    "use_cueq_triangle_kernels",
    "use_triton_triangle_kernels",
    "use_lma",
)


def _flatten_bias(bias: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """``[*, h, q, k]`` broadcastable to ``lead + [H, Q, K]`` -> ``[B, s, h, q, k]``.

    ``lead`` is the query's batch shape; its last dim is the kernel's S, the others
    fold into B. ``s`` stays 1 where the bias is shared over S (a stride-0 view).
    """
    bias = bias.reshape((1,) * (len(lead) + 3 - bias.dim()) + bias.shape)
    outer = lead[:-1]
    s = bias.shape[len(outer)]
    bias = bias.expand(*outer, s, *bias.shape[-3:])
    return bias.reshape(math.prod(outer), s, *bias.shape[-3:])


def split_biases(
    biases: list[torch.Tensor], lead: torch.Size
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sort OF3's bias list into the kernel's mask bias and pair bias.

    A bias with singleton head and query dims (``[*, 1, 1, K]``) is a mask; anything
    else is a pair bias. Several of a kind are summed.

    Returns:
        ``mask_bias [B, S|1, 1, 1, K]`` and ``pair_bias [B, S|1, H|1, Q, K]``, each
        ``None`` when absent.
    """
    masks = [b for b in biases if b.shape[-3] == 1 and b.shape[-2] == 1]
    pairs = [b for b in biases if not (b.shape[-3] == 1 and b.shape[-2] == 1)]

    def combine(group):
        if not group:
            return None
        flat = [_flatten_bias(b, lead) for b in group]
        return flat[0] if len(flat) == 1 else sum(flat[1:], flat[0])

    return combine(masks), combine(pairs)


def _projections(attention: Any) -> list[Any]:
    """The input projections in packing order: q, k, v and, with gating, g."""
    linears = [attention.linear_q, attention.linear_k, attention.linear_v]
    return linears + ([attention.linear_g] if attention.linear_g is not None else [])


def stacked_projection(
    attention: Any,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The q, k, v (and, with gating, gate) projections' weights stacked per head.

    Returns:
        ``weight [P, H, c, C]`` and ``bias [P, H, c]`` (zeros where a projection has
        none; ``None`` when none has one), with ``P`` = 3, or 4 with gating; the
        weight gradients reach each ``Linear`` through the stack. ``None`` where OF3
        computes a projection at a fixed precision of its own (``Linear.precision``).
    """
    linears = _projections(attention)
    if any(getattr(linear, "precision", None) is not None for linear in linears):
        return None
    heads, c = attention.no_heads, attention.c_hidden
    weight = torch.stack([linear.weight for linear in linears])
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.stack([
            linear.bias if linear.bias is not None
            else linear.weight.new_zeros(linear.out_features)
            for linear in linears
        ]).view(len(linears), heads, c)
    return weight.view(len(linears), heads, c, -1), bias


def projection_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype OF3's ``Linear.forward`` computes a projection of ``x`` in: bf16
    inputs stay bf16 with autocast off (unless DeepSpeed is initialised); otherwise
    autocast's dtype where it is on, else ``x``'s."""
    from openfold3.core.model.primitives import linear as of3_linear
    from openfold3.core.utils.device_utils import autocast_device_type

    deepspeed_on = (of3_linear.deepspeed_is_installed
                    and of3_linear.deepspeed.comm.comm.is_initialized())
    if x.dtype is torch.bfloat16 and not deepspeed_on:
        return x.dtype
    device = autocast_device_type(x)
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def evoflash_forward(
    attention: Any,
    q_x: torch.Tensor,
    kv_x: torch.Tensor,
    biases: list[torch.Tensor],
    high_precision: bool,
) -> torch.Tensor:
    """OF3's ``Attention.forward`` with the core on the EvoFlash-3D kernel.

    Self-attention (``q_x is kv_x``: every OF3 call site the kernel serves) outside
    high precision runs its q/k/v/gate projections inside the kernel's autograd
    function (:func:`evoflash_attention_projected`, weights from
    :func:`stacked_projection`, in OF3's projection dtype): one GEMM per chunk of
    S slices, recomputed in backward instead of stored, one input-gradient GEMM
    instead of four plus their sum, the gating in the kernel. High-precision calls
    (the diffusion transformer, the trunk's single attention) and cross inputs keep
    OF3's projections and gating around the kernel: there q, k and v are upcast to
    fp32, and an fp32 copy of a packed projection, gate included, cost more memory
    than it saved (docs/benchmarks.md).

    Args:
        attention: OF3's ``Attention`` module (its weights are used as they are).
        q_x, kv_x: ``[*, N, C]`` query and key/value inputs (same ``N``).
        biases: OF3's bias list, each broadcastable to ``[*, H, N, N]``.
        high_precision: OF3's ``use_high_precision`` (fp32 core).

    Returns:
        ``[*, N, C_q]``, as OF3's ``Attention.forward``.
    """
    from of3_megafold.kernels.evoflash import (
        evoflash_attention,
        evoflash_attention_projected,
    )

    heads, c = attention.no_heads, attention.c_hidden
    lead = q_x.shape[:-2] if q_x.dim() > 2 else torch.Size([1])
    n = q_x.shape[-2]
    b = math.prod(lead[:-1])
    mask_bias, pair_bias = split_biases(biases, lead)
    projection = (stacked_projection(attention)
                  if q_x is kv_x and not high_precision else None)
    if projection is not None:
        dtype = projection_dtype(q_x)
        weight, bias = (t.to(dtype) if t is not None else None for t in projection)
        o = evoflash_attention_projected(
            q_x.to(dtype).reshape(b, lead[-1], n, -1),
            weight,
            bias,
            mask_bias=mask_bias,
            pair_bias=pair_bias,
            scale=1.0 / math.sqrt(c),
        )
        if attention.linear_g is None:  # nothing to gate: OF3's output projection
            return attention._wrap_up(o.view(*q_x.shape[:-1], heads, c), q_x)
        return attention.linear_o(o.view(*q_x.shape[:-1], heads * c))
    q, k, v = (
        linear(x).view(b, lead[-1], n, heads, c)
        for linear, x in (
            (attention.linear_q, q_x),
            (attention.linear_k, kv_x),
            (attention.linear_v, kv_x),
        )
    )
    in_dtype = q.dtype
    if high_precision:
        q, k, v = q.float(), k.float(), v.float()
    o = evoflash_attention(
        q,
        k,
        v,
        mask_bias=mask_bias,
        pair_bias=pair_bias,
        scale=1.0 / math.sqrt(c),
        high_precision=high_precision,
    )
    # As OF3's ``_attention``: the core's result in the projections' dtype.
    o = o.to(in_dtype)
    return attention._wrap_up(o.view(*q_x.shape[:-1], heads, c), q_x)


def _enabled(module: Any) -> bool:
    return registry.module_enabled(module, NAME, FLAG)


def _patch_attention_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        q_x, kv_x = call.arguments["q_x"], call.arguments["kv_x"]
        if not _enabled(self) or q_x.shape[-2] != kv_x.shape[-2]:
            return original(self, *args, **kwargs)
        if not runs_on(q_x):  # CPU tensors on a GPU machine
            registry.log_device_fallback(NAME, q_x.device.type)
            return original(self, *args, **kwargs)
        high_precision = bool(call.arguments.get("use_high_precision", False))
        biases = call.arguments.get("biases") or []
        return evoflash_forward(self, q_x, kv_x, biases, high_precision)

    return forward


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="run triangle, single and diffusion attention on the fused EvoFlash-3D "
        "Triton kernel (no [*, H, N, N] logits stored). Exclusive with OF3's kernel "
        "flags in the same section.",
        summary="Fused attention with pair bias (forward and backward) for "
        "triangle, single and diffusion attention",
        requires=("triton",),
        device_check=triton_backend,
        patches=(
            registry.Patch(
                "openfold3.core.model.primitives.attention:Attention.forward",
                _patch_attention_forward,
            ),
        ),
        exclusive_with=OF3_KERNEL_FLAGS,
        exclusive_what="attention kernel",
    )
)
