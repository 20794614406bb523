"""Pure-torch attention with pair bias: the test oracle and the CPU fallback.

It computes exactly what OpenFold3's ``_attention`` computes for the triangle,
diffusion-transformer and single-attention call sites, but in the layout the
kernels take (``[B, S, N, H, D]``, straight out of the q/k/v projections).
"""

from __future__ import annotations

import torch


def evoflash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_bias: torch.Tensor | None = None,
    pair_bias: torch.Tensor | None = None,
    scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """``O = softmax(scale * Q K^T + mask_bias + pair_bias) V`` in plain torch.

    Args:
        q, k, v: ``[B, S, N, H, D]``; S is the axis the attention is batched over
            (pair rows for triangle attention, diffusion samples, 1 for the trunk),
            N the sequence attended over, H heads, D the head dimension.
        mask_bias: optional additive key mask broadcastable to ``[B, S, 1, 1, N]``,
            OF3 style ``inf * (mask - 1)`` with a large finite ``inf`` (1e9).
        pair_bias: optional additive bias broadcastable to ``[B, S, H, N, N]``,
            usually ``[B, 1, H, N, N]`` (shared by all S).
        scale: logit scale, default ``D ** -0.5``.
        upcast: compute in fp32 when the inputs are bf16/fp16 (OF3's
            ``use_high_precision``); the output is returned in the input dtype.

    Returns:
        ``[B, S, N, H, D]`` in ``q.dtype``.

    The mask bias is added to the logits in fp32, which is what OF3's fp32 and bf16
    paths do in effect: a -1e9 bias swallows the logit it is added to, so a query
    whose keys are all masked gets uniform weights (and torch autograd still sends
    ``dS = P (dP - delta)`` through it). Adding it in fp32 here too makes an fp64
    oracle agree with that instead of un-masking such rows.
    """
    in_dtype = q.dtype
    if scale is None:
        scale = q.shape[-1] ** -0.5
    compute = in_dtype
    if upcast and in_dtype in (torch.bfloat16, torch.float16):
        compute = torch.float32
    # [B, S, N, H, D] -> [B, S, H, N, D]
    qh = q.to(compute).transpose(-2, -3)
    kh = k.to(compute).transpose(-2, -3)
    vh = v.to(compute).transpose(-2, -3)
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if pair_bias is not None:
        logits = logits + pair_bias.to(compute)
    if mask_bias is not None:
        logits = (logits.float() + mask_bias.float()).to(compute)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, vh)
    return out.transpose(-2, -3).to(in_dtype)
