"""Smooth lDDT scored on ball-query neighbour lists (forward and backward kernels).

Row i has ``n_i`` in-radius neighbours (``counts``) of which ``k_i = min(n_i, K)`` are
listed; each listed score is weighted by ``w_i = n_i / k_i``. With the uniform sample of
``_ball_query.py`` every in-radius pair is listed with probability ``k_i / n_i``, so
``A_hat = sum_i w_i sum_listed e_ij`` is an unbiased estimate of ``A = sum c e m`` (the
Horvitz-Thompson estimator), exact when ``n_i <= K``. ``C = sum c m = sum_i n_i`` and
``M = sum m`` are exact, and the loss is affine in ``A``, so the loss estimate and its
gradient are unbiased too.

The forward writes one partial sum of ``A_hat`` per row block, and the last program
of each (batch, sample) to finish reduces them to the loss (``_loss.py``), so the
forward is one launch.

Backward, per listed pair (i, j): ``dA_hat/dx_i += w_i s'(d) (x_i - x_j) / d`` and the
opposite term goes to ``x_j``. The row term is a register reduction. The column term
is either an ``atomic_add`` (default) or, for ``deterministic=True``, a second pass
over the reverse lists (for each j, the rows i that list j, in a fixed order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._loss import LOSS_BLOCK, lddt_loss_of_row
from ._pair_score import lddt_pair_score

SCORE_BLOCK_ROWS = 32
SCORE_BLOCK_K = 64
SCORE_NUM_WARPS = 8

MODE_LOSS = 0  # forward: partial sums of w_i e_ij, then the loss
MODE_GRAD_ATOMIC = 1  # backward: rows in registers, columns with atomic_add
MODE_GRAD_ROWS = 2  # backward, deterministic: rows only (columns in a second pass)


@triton.jit
def _backward_scale(dloss_ptr, grad_ptr, bs, S, grad_stride_b, grad_stride_s):
    """dLoss/dA of (batch, sample) ``bs`` times the incoming gradient of its loss."""
    grad_off = (bs // S) * grad_stride_b + (bs % S) * grad_stride_s
    return tl.load(dloss_ptr + bs) * tl.load(grad_ptr + grad_off).to(tl.float32)


@triton.jit
def _neighbor_rows_kernel(
    x_ptr,  # [B*S, N, 3] any float dtype, original order
    t_ptr,  # [B, N, 3] fp32
    nbr_ptr,  # [B, N, K] int32, -1 = empty, used slots first
    count_ptr,  # [B, N] int32 in-radius counts
    n_valid_ptr,  # [B] int32 atoms in the mask (MODE_LOSS)
    a_ptr,  # [B*S, NRB] fp32 partial sums (MODE_LOSS)
    arrived_ptr,  # [B*S] int32 zeros: programs done per (b, s) (MODE_LOSS)
    loss_ptr,  # [B*S] fp32 out (MODE_LOSS)
    g_ptr,  # [B*S, N, 3] fp32 gradient (other modes)
    dloss_ptr,  # [B*S] fp32 dLoss/dA: out in MODE_LOSS, in otherwise
    grad_ptr,  # [B, S] incoming gradient of the loss, any strides (other modes)
    N,
    S,
    NRB,
    K,
    grad_stride_b,
    grad_stride_s,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
):
    rb = tl.program_id(0)
    bs = tl.program_id(1)
    b = bs // S
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    x_base = x_ptr + bs.to(tl.int64) * N * 3
    t_base = t_ptr + b.to(tl.int64) * N * 3
    xi0 = tl.load(x_base + rows * 3, mask=row_ok, other=0.0).to(tl.float32)
    xi1 = tl.load(x_base + rows * 3 + 1, mask=row_ok, other=0.0).to(tl.float32)
    xi2 = tl.load(x_base + rows * 3 + 2, mask=row_ok, other=0.0).to(tl.float32)
    ti0 = tl.load(t_base + rows * 3, mask=row_ok, other=0.0)
    ti1 = tl.load(t_base + rows * 3 + 1, mask=row_ok, other=0.0)
    ti2 = tl.load(t_base + rows * 3 + 2, mask=row_ok, other=0.0)
    n_in = tl.load(count_ptr + b * N + rows, mask=row_ok, other=0)
    n_listed = tl.minimum(n_in, K)
    weight = tl.where(n_listed > 0, n_in.to(tl.float32) / tl.maximum(n_listed, 1), 0.0)
    if MODE != 0:
        scale = _backward_scale(
            dloss_ptr, grad_ptr, bs, S, grad_stride_b, grad_stride_s
        )
        weight = weight * (0.25 * scale)

    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    g0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    nbr_row = nbr_ptr + (b * N + rows).to(tl.int64) * K
    k_end = tl.max(n_listed, axis=0)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (ks[None, :] < n_listed[:, None])
        j = tl.load(nbr_row[:, None] + ks[None, :], mask=ok, other=0)
        ok = ok & (j >= 0)  # lists passed in by the caller may have holes
        xj0 = tl.load(x_base + j * 3, mask=ok, other=0.0).to(tl.float32)
        xj1 = tl.load(x_base + j * 3 + 1, mask=ok, other=0.0).to(tl.float32)
        xj2 = tl.load(x_base + j * 3 + 2, mask=ok, other=0.0).to(tl.float32)
        tj0 = tl.load(t_base + j * 3, mask=ok, other=0.0)
        tj1 = tl.load(t_base + j * 3 + 1, mask=ok, other=0.0)
        tj2 = tl.load(t_base + j * 3 + 2, mask=ok, other=0.0)
        u0 = ti0[:, None] - tj0
        u1 = ti1[:, None] - tj1
        u2 = ti2[:, None] - tj2
        dg2 = u0 * u0 + u1 * u1 + u2 * u2 + eps
        dg = dg2 * tl.rsqrt(dg2)
        v0 = xi0[:, None] - xj0
        v1 = xi1[:, None] - xj1
        v2 = xi2[:, None] - xj2
        dp2 = v0 * v0 + v1 * v1 + v2 * v2 + eps
        inv_dp = tl.rsqrt(dp2)
        score, dscore = lddt_pair_score(dg, dp2 * inv_dp, MODE != 0)
        if MODE == 0:
            acc += tl.sum(tl.where(ok, score, 0.0), axis=1)
        else:
            h = tl.where(ok, dscore * inv_dp, 0.0) * weight[:, None]
            g0 += tl.sum(h * v0, axis=1)
            g1 += tl.sum(h * v1, axis=1)
            g2 += tl.sum(h * v2, axis=1)
            if MODE == 1:
                g_base = g_ptr + bs.to(tl.int64) * N * 3
                tl.atomic_add(g_base + j * 3, -h * v0, mask=ok, sem="relaxed")
                tl.atomic_add(g_base + j * 3 + 1, -h * v1, mask=ok, sem="relaxed")
                tl.atomic_add(g_base + j * 3 + 2, -h * v2, mask=ok, sem="relaxed")

    if MODE == 0:
        tl.store(a_ptr + bs * NRB + rb, tl.sum(acc * weight, axis=0) * 0.25)
        # The last program of (b, s) to finish reduces its partials (in a fixed
        # order, whichever program that is): the barrier and the release/acquire
        # of the count make every other program's partial visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrived_ptr + bs, 1, sem="acq_rel")
        if arrived == NRB - 1:
            lddt_loss_of_row(
                a_ptr + bs * NRB,
                count_ptr + b * N,
                tl.load(n_valid_ptr + b),
                loss_ptr + bs,
                dloss_ptr + bs,
                NRB,
                N,
                eps,
                LOSS_BLOCK,
            )
    else:
        g_rows = g_ptr + bs.to(tl.int64) * N * 3 + rows * 3
        if MODE == 1:
            tl.atomic_add(g_rows, g0, mask=row_ok, sem="relaxed")
            tl.atomic_add(g_rows + 1, g1, mask=row_ok, sem="relaxed")
            tl.atomic_add(g_rows + 2, g2, mask=row_ok, sem="relaxed")
        else:
            tl.store(g_rows, g0, mask=row_ok)
            tl.store(g_rows + 1, g1, mask=row_ok)
            tl.store(g_rows + 2, g2, mask=row_ok)


@triton.jit
def _neighbor_cols_kernel(
    x_ptr,  # [B*S, N, 3] any float dtype
    t_ptr,  # [B, N, 3] fp32
    count_ptr,  # [B, N] int32
    rev_ptr_ptr,  # [B, N + 1] int32 CSR offsets of the reverse lists
    rev_src_ptr,  # [B, N*K] int32: rows i listing j, grouped by j
    g_ptr,  # [B*S, N, 3] fp32, holds the row terms; the column terms are added
    dloss_ptr,  # [B*S] fp32 dLoss/dA
    grad_ptr,  # [B, S] incoming gradient of the loss, any strides
    N,
    S,
    K,
    grad_stride_b,
    grad_stride_s,
    eps,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    jb = tl.program_id(0)
    bs = tl.program_id(1)
    b = bs // S
    js = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = js < N
    x_base = x_ptr + bs.to(tl.int64) * N * 3
    t_base = t_ptr + b.to(tl.int64) * N * 3
    xj0 = tl.load(x_base + js * 3, mask=j_ok, other=0.0).to(tl.float32)
    xj1 = tl.load(x_base + js * 3 + 1, mask=j_ok, other=0.0).to(tl.float32)
    xj2 = tl.load(x_base + js * 3 + 2, mask=j_ok, other=0.0).to(tl.float32)
    tj0 = tl.load(t_base + js * 3, mask=j_ok, other=0.0)
    tj1 = tl.load(t_base + js * 3 + 1, mask=j_ok, other=0.0)
    tj2 = tl.load(t_base + js * 3 + 2, mask=j_ok, other=0.0)
    start = tl.load(rev_ptr_ptr + b * (N + 1) + js, mask=j_ok, other=0)
    degree = tl.load(rev_ptr_ptr + b * (N + 1) + js + 1, mask=j_ok, other=0) - start
    scale = 0.25 * _backward_scale(
        dloss_ptr, grad_ptr, bs, S, grad_stride_b, grad_stride_s
    )
    src_base = rev_src_ptr + b.to(tl.int64) * N * K

    g0 = tl.zeros([BLOCK_J], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_J], dtype=tl.float32)
    g2 = tl.zeros([BLOCK_J], dtype=tl.float32)
    for e0 in range(0, tl.max(degree, axis=0), BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        ok = es[None, :] < degree[:, None]
        i = tl.load(src_base + start[:, None] + es[None, :], mask=ok, other=0)
        n_in = tl.load(count_ptr + b * N + i, mask=ok, other=0)
        n_listed = tl.maximum(tl.minimum(n_in, K), 1)
        weight = n_in.to(tl.float32) / n_listed
        xi0 = tl.load(x_base + i * 3, mask=ok, other=0.0).to(tl.float32)
        xi1 = tl.load(x_base + i * 3 + 1, mask=ok, other=0.0).to(tl.float32)
        xi2 = tl.load(x_base + i * 3 + 2, mask=ok, other=0.0).to(tl.float32)
        ti0 = tl.load(t_base + i * 3, mask=ok, other=0.0)
        ti1 = tl.load(t_base + i * 3 + 1, mask=ok, other=0.0)
        ti2 = tl.load(t_base + i * 3 + 2, mask=ok, other=0.0)
        u0 = ti0 - tj0[:, None]
        u1 = ti1 - tj1[:, None]
        u2 = ti2 - tj2[:, None]
        dg2 = u0 * u0 + u1 * u1 + u2 * u2 + eps
        dg = dg2 * tl.rsqrt(dg2)
        v0 = xi0 - xj0[:, None]
        v1 = xi1 - xj1[:, None]
        v2 = xi2 - xj2[:, None]
        dp2 = v0 * v0 + v1 * v1 + v2 * v2 + eps
        inv_dp = tl.rsqrt(dp2)
        _, dscore = lddt_pair_score(dg, dp2 * inv_dp, True)
        h = tl.where(ok, dscore * inv_dp * weight, 0.0)
        g0 -= tl.sum(h * v0, axis=1)
        g1 -= tl.sum(h * v1, axis=1)
        g2 -= tl.sum(h * v2, axis=1)

    g_cols = g_ptr + bs.to(tl.int64) * N * 3 + js * 3
    tl.store(g_cols, tl.load(g_cols, mask=j_ok) + g0 * scale, mask=j_ok)
    tl.store(g_cols + 1, tl.load(g_cols + 1, mask=j_ok) + g1 * scale, mask=j_ok)
    tl.store(g_cols + 2, tl.load(g_cols + 2, mask=j_ok) + g2 * scale, mask=j_ok)


def reverse_neighbors(neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of the transposed neighbour lists, for the deterministic backward.

    Returns ``offsets [B, N + 1]`` int32 and ``sources [B, N * K]`` int32: the rows i
    whose list holds j are ``sources[b, offsets[b, j]:offsets[b, j + 1]]``, in
    increasing (i, slot) order (a stable sort, itself deterministic).
    """
    b, n, k = neighbors.shape
    flat = neighbors.reshape(b, n * k)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, n))
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    sources = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    bounds = torch.arange(n + 1, device=neighbors.device, dtype=sorted_key.dtype)
    offsets = torch.searchsorted(
        sorted_key, bounds.expand(b, n + 1).contiguous(), out_int32=True
    )
    return offsets, sources


def neighbor_score_fwd(
    x: torch.Tensor,
    truth: torch.Tensor,
    neighbors: torch.Tensor,
    counts: torch.Tensor,
    n_valid: torch.Tensor,
    eps: float,
    num_warps: int = SCORE_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and dLoss/dA_hat, both ``[B, S]`` float32 (see ``_loss.py``), in one
    launch: the last program of each (batch, sample) reduces the partial sums.

    ``x [B, S, N, 3]`` contiguous (any float dtype), ``truth [B, N, 3]`` float32,
    ``neighbors [B, N, K]`` and ``counts [B, N]`` int32, ``n_valid [B]`` int32 atoms
    in the mask.
    """
    b, s, n, _ = x.shape
    k = neighbors.shape[-1]
    nrb = -(-n // SCORE_BLOCK_ROWS)
    dev = x.device
    a_part = torch.empty((b * s, nrb), device=dev, dtype=torch.float32)
    arrived = torch.zeros((b * s,), device=dev, dtype=torch.int32)
    loss = torch.empty((b, s), device=dev, dtype=torch.float32)
    dloss = torch.empty((b, s), device=dev, dtype=torch.float32)
    _neighbor_rows_kernel[(nrb, b * s)](
        x,
        truth,
        neighbors,
        counts,
        n_valid,
        a_part,
        arrived,
        loss,
        a_part,
        dloss,
        a_part,
        n,
        s,
        nrb,
        k,
        0,
        0,
        eps,
        BLOCK_M=SCORE_BLOCK_ROWS,
        BLOCK_K=SCORE_BLOCK_K,
        MODE=MODE_LOSS,
        num_warps=num_warps,
    )
    return loss, dloss


def neighbor_score_bwd(
    x: torch.Tensor,
    truth: torch.Tensor,
    neighbors: torch.Tensor,
    counts: torch.Tensor,
    dloss_da: torch.Tensor,
    grad_loss: torch.Tensor,
    eps: float,
    reverse: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = SCORE_NUM_WARPS,
) -> torch.Tensor:
    """``dloss_da[b, s] * grad_loss[b, s] * dA_hat/dx`` as ``[B, S, N, 3]`` float32.

    ``dloss_da`` is ``[B, S]`` float32 contiguous (from ``lddt_loss_from_sums``);
    ``grad_loss`` is ``[B, S]`` float, any strides (an expanded gradient is read as
    it is). With ``reverse`` (from ``reverse_neighbors``) no atomics are used and the
    result is bitwise reproducible; otherwise column terms are accumulated with
    ``atomic_add``.
    """
    b, s, n, _ = x.shape
    k = neighbors.shape[-1]
    nrb = -(-n // SCORE_BLOCK_ROWS)
    grad_stride_b, grad_stride_s = grad_loss.stride()
    if reverse is None:
        grad = torch.zeros((b, s, n, 3), device=x.device, dtype=torch.float32)
        mode = MODE_GRAD_ATOMIC
    else:
        grad = torch.empty((b, s, n, 3), device=x.device, dtype=torch.float32)
        mode = MODE_GRAD_ROWS
    _neighbor_rows_kernel[(nrb, b * s)](
        x,
        truth,
        neighbors,
        counts,
        counts,
        grad,
        counts,
        grad,
        grad,
        dloss_da,
        grad_loss,
        n,
        s,
        nrb,
        k,
        grad_stride_b,
        grad_stride_s,
        eps,
        BLOCK_M=SCORE_BLOCK_ROWS,
        BLOCK_K=SCORE_BLOCK_K,
        MODE=mode,
        num_warps=num_warps,
    )
    if reverse is not None:
        offsets, sources = reverse
        _neighbor_cols_kernel[(nrb, b * s)](
            x,
            truth,
            counts,
            offsets,
            sources,
            grad,
            dloss_da,
            grad_loss,
            n,
            s,
            k,
            grad_stride_b,
            grad_stride_s,
            eps,
            BLOCK_J=SCORE_BLOCK_ROWS,
            BLOCK_E=SCORE_BLOCK_K,
            num_warps=num_warps,
        )
    return grad
