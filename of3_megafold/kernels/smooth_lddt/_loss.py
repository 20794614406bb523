"""Loss and dLoss/dA from the pair sums, one program per (batch, sample).

    loss    = 1 - (A / (M + eps)) / (C / (M + eps) + eps)
    dL / dA = -1 / ((M + eps) (C / (M + eps) + eps))

with ``A = sum c e m`` (partials from the pair kernels), ``C = sum c m`` (partials or
per-atom neighbour counts) and ``M = sum m = n (n - 1)``, exact from the number ``n`` of
atoms in the mask (the pair mask is the outer product of the atom mask without its
diagonal). Sums run in float64 in a fixed order, so the result is reproducible.
``lddt_loss_of_row`` is the reduction of one (batch, sample); the sparse score kernel
calls it from its last program instead of launching ``_lddt_loss_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Partial sums one program reduces per step (a constexpr: kernels read it as a global).
LOSS_BLOCK = tl.constexpr(1024)


@triton.jit
def lddt_loss_of_row(
    a_row,  # [A_LEN] fp32 partial sums of c e m of one (batch, sample)
    c_row,  # [C_LEN] int32 partial sums of c m
    n_valid,  # atoms in the mask (scalar)
    loss_ptr,  # fp32 out, one value
    dloss_ptr,  # fp32 out, one value
    A_LEN,
    C_LEN,
    eps,
    BLOCK: tl.constexpr,
):
    """Reduce one (batch, sample)'s partial sums, in a fixed order, to the loss and
    dLoss/dA."""
    a = tl.zeros([BLOCK], dtype=tl.float64)
    for k0 in range(0, A_LEN, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        a += tl.load(a_row + k, mask=k < A_LEN, other=0.0).to(tl.float64)
    c = tl.zeros([BLOCK], dtype=tl.int64)
    for k0 in range(0, C_LEN, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        c += tl.load(c_row + k, mask=k < C_LEN, other=0).to(tl.int64)
    a_sum = tl.sum(a, axis=0)
    c_sum = tl.sum(c, axis=0).to(tl.float64)
    n = n_valid.to(tl.float64)
    m_sum = n * (n - 1.0) + eps
    c_mean = c_sum / m_sum + eps
    tl.store(loss_ptr, (1.0 - (a_sum / m_sum) / c_mean).to(tl.float32))
    tl.store(dloss_ptr, (-1.0 / (m_sum * c_mean)).to(tl.float32))


@triton.jit
def _lddt_loss_kernel(
    a_ptr,  # [B*S, LEN] fp32 partial sums of c e m
    c_ptr,  # [B*S, LEN] int32 partial sums of c m
    n_valid_ptr,  # [B] int32
    loss_ptr,  # [B*S] fp32 out
    dloss_ptr,  # [B*S] fp32 out
    S,
    LEN,
    eps,
    BLOCK: tl.constexpr,
):
    bs = tl.program_id(0)
    lddt_loss_of_row(
        a_ptr + bs.to(tl.int64) * LEN,
        c_ptr + bs.to(tl.int64) * LEN,
        tl.load(n_valid_ptr + bs // S),
        loss_ptr + bs,
        dloss_ptr + bs,
        LEN,
        LEN,
        eps,
        BLOCK,
    )


def lddt_loss_from_sums(
    a_part: torch.Tensor,
    c_part: torch.Tensor,
    n_valid: torch.Tensor,
    s: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and dLoss/dA, both ``[B, S]`` float32.

    Args:
        a_part: ``[B * S, ...]`` float32 contiguous partial sums of ``c e m``.
        c_part: int32 partial sums of ``c m``, same shape and layout.
        n_valid: ``[B]`` int32 atoms in the mask.
        s: samples per batch element.
        eps: OF3's eps.
    """
    bs = a_part.shape[0]
    loss = torch.empty((bs // s, s), device=a_part.device, dtype=torch.float32)
    dloss = torch.empty_like(loss)
    _lddt_loss_kernel[(bs,)](
        a_part,
        c_part,
        n_valid,
        loss,
        dloss,
        s,
        a_part.numel() // bs,
        eps,
        BLOCK=LOSS_BLOCK.value,
    )
    return loss, dloss
