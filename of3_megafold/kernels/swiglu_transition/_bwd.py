"""Backward kernels of the fused SwiGLU transition (private; see ``function.py``).

Nothing of the ``[rows, n*c]`` hidden activations was kept by the forward pass; both
kernels recompute ``xn = LN(x)`` from ``x`` and the saved per-row mean / rstd, and
``a = xn w_a^T``, ``b = xn w_b^T``, ``dh = dy w_out`` chunk by chunk, with
(``s = sigmoid(a)``)::

    h  = a s b
    db = dh a s
    da = dh b s (1 + a (1 - s)) = dh b (s + a s (1 - s))

The input gradient wants a sum over the hidden dimension for each row; the weight
gradients want a sum over all rows for each hidden unit. One schedule cannot hold
both sums in registers (the weight gradients of one c=128, n=4 transition are
768 KiB in fp32), and flushing partial weight gradients per row block (atomics or
read-modify-write) moves more data through L2 than recomputing ``a, b, dh`` costs
in tensor-core time. So the reductions are split, as flash-attention's backward
splits dQ from dK/dV:

* ``_swiglu_transition_bwd_input_kernel``: a program per ``BLOCK_M`` rows loops over
  hidden chunks, accumulates ``dxn = [da | db] w_ab`` in fp32 registers, then does
  the LayerNorm backward in place and writes ``dx`` plus per-program partial sums
  for the LayerNorm scale/offset gradients. Three products per chunk
  (``xn [w_a | w_b]^T``, ``dy w_out``, ``da w_a + db w_b``), 5 GEMM-equivalents of
  work.
  With ``STORE_HIDDEN`` it also writes ``xn``, the masked ``dy``, ``[da | db]`` and
  ``h`` of its rows, which the launcher's cuBLAS GEMMs reduce over a chunk of rows
  into the weight gradients (the "gemm" path of ``function.py``: 3 more
  GEMM-equivalents, nothing recomputed twice).
* ``_swiglu_transition_bwd_weight_kernel`` (the "kernel" path, for fewer rows): a
  program per (hidden chunk, row split) recomputes ``a, b, dh`` and keeps ``dw_a``,
  ``dw_b`` and ``dw_out`` of its chunk in fp32 registers while it walks its share of
  the row blocks, and writes them to a per-split partial buffer that the launcher
  sums (deterministic, no atomics). Six dots per row block (``a``, ``b``, ``dh`` and
  the three weight-gradient products), 6 GEMM-equivalents.
"""

from __future__ import annotations

import triton
import triton.language as tl

from of3_megafold.kernels._rounding import round_to
from of3_megafold.kernels.swiglu_transition._fwd import (
    _mm,
    _out_weight_tile_cn,
    _sigmoid,
    _weight_tile_kn,
    even_weights,
    tuning_space,
)


@triton.jit
def _normalized_rows(
    X, LN_W, LN_B, MEAN, RSTD, rows, cols, row_ok, col_ok, stride_x,
    NORMALIZE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """``(xn, xhat, rstd)`` of a row block: the matmul input in the compute dtype,
    the fp32 normalised rows (zero outside) and their rstd (1 without LayerNorm)."""
    io_mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(
        X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
        mask=io_mask,
        other=0.0,
    ).to(tl.float32)
    if NORMALIZE:
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(io_mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        ln_w = tl.load(LN_W + cols, mask=col_ok, other=0.0).to(tl.float32)
        ln_b = tl.load(LN_B + cols, mask=col_ok, other=0.0).to(tl.float32)
        xn = round_to(xhat * ln_w[None, :] + ln_b[None, :], COMPUTE_DTYPE)
    else:
        rstd = tl.full((rows.shape[0],), 1.0, tl.float32)
        xhat = x
        xn = round_to(x, COMPUTE_DTYPE)
    return xn, xhat, rstd


@triton.jit
def _masked_grad_rows(
    DY, MASK, rows, cols, row_ok, col_ok, stride_dy,
    HAS_MASK: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """The output gradient of a row block times the row mask, in the compute dtype
    (zero on padded rows, so padded rows add nothing to any sum)."""
    dy = tl.load(
        DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_MASK:
        row_mask = tl.load(MASK + rows, mask=row_ok, other=0.0).to(tl.float32)
        dy = dy * row_mask[:, None]
    return round_to(dy, COMPUTE_DTYPE)


# The first three compile for sm_90 without register spills at c = 128 (triton
# 3.9's ptxas), all of them at c = 64.
BWD_INPUT_CONFIGS, BWD_INPUT_PRUNE = tuning_space(
    half=[(128, 32, 8, 3), (64, 32, 8, 3), (64, 64, 8, 3), (128, 32, 8, 4),
          (128, 64, 8, 3)],
    single=[(32, 32, 4, 2), (64, 32, 8, 2)],
)  # fmt: skip


@triton.autotune(
    configs=BWD_INPUT_CONFIGS,
    key=["C", "H", "NORMALIZE", "HAS_MASK", "STORE_DX", "LN_GRAD", "STORE_HIDDEN"],
    prune_configs_by=BWD_INPUT_PRUNE,
    # The partial buffers have a row per program of the smallest BLOCK_M; configs
    # with a larger one write fewer rows, and benchmarking must not leave stale
    # rows behind.
    reset_to_zero=["DLN_W_PART", "DLN_B_PART"],
)
@triton.heuristics({"EVEN_WEIGHTS": even_weights})
@triton.jit
def _swiglu_transition_bwd_input_kernel(
    X, LN_W, LN_B, W_AB, W_OUT, MASK, DY, MEAN, RSTD,
    DX,  # [M, C] written when STORE_DX
    DLN_W_PART,  # [>= P0 + programs, C] fp32, row P0 + pid written when LN_GRAD
    DLN_B_PART,
    # The hidden buffers hold the launch's rows [ROW0, M) from their row 0:
    XN_OUT,  # [M - ROW0, C] contiguous, compute dtype: xn, written when STORE_HIDDEN
    DYM_OUT,  # [M - ROW0, C] contiguous: dy * mask, written when STORE_HIDDEN
    DAB_OUT,  # [M - ROW0, 2H] contiguous: [da | db] (columns as w_ab's rows)
    H_OUT,  # [M - ROW0, H] contiguous: silu(a) * b, written when STORE_HIDDEN
    ROW0, P0,  # first row of this launch; first partial-sum row of this launch
    M, C, H, stride_x, stride_dy, stride_dx,
    NORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    STORE_DX: tl.constexpr,
    LN_GRAD: tl.constexpr,
    NEED_DXN: tl.constexpr,  # STORE_DX or LN_GRAD
    STORE_HIDDEN: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_WEIGHTS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    local = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = ROW0 + local
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < M
    col_ok = cols < C
    dtype = W_AB.dtype.element_ty
    xn, _, _ = _normalized_rows(
        X, LN_W, LN_B, MEAN, RSTD, rows, cols, row_ok, col_ok, stride_x,
        NORMALIZE, dtype,
    )  # fmt: skip
    dy = _masked_grad_rows(
        DY, MASK, rows, cols, row_ok, col_ok, stride_dy, HAS_MASK, dtype
    )
    rows64 = rows.to(tl.int64)
    local64 = local.to(tl.int64)
    if STORE_HIDDEN:
        io_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(XN_OUT + local64[:, None] * C + cols[None, :], xn, mask=io_mask)
        tl.store(DYM_OUT + local64[:, None] * C + cols[None, :], dy, mask=io_mask)

    dxn = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for k in range(0, H, BLOCK_H):
        hid = k + tl.arange(0, BLOCK_H)
        h_ok = hid < H
        w_a = _weight_tile_kn(W_AB, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
        w_b = _weight_tile_kn(W_AB + H * C, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
        w_out = _out_weight_tile_cn(W_OUT, hid, cols, h_ok, col_ok, H, EVEN_WEIGHTS)
        a = _mm(xn, w_a, None, INPUT_PRECISION, INTERPRETER)
        b = _mm(xn, w_b, None, INPUT_PRECISION, INTERPRETER)
        dh = _mm(dy, w_out, None, INPUT_PRECISION, INTERPRETER)
        sig = _sigmoid(a, FAST_SIGMOID)
        silu = a * sig
        db = round_to(dh * silu, xn.dtype)
        # d silu(a) / da = sig (1 + a (1 - sig)) = sig + silu (1 - sig): one FMA
        da = round_to((dh * b) * (sig + silu * (1.0 - sig)), xn.dtype)
        if STORE_HIDDEN:
            # What the weight-gradient GEMMs of the launcher read (see function.py)
            h_mask = row_ok[:, None] & h_ok[None, :]
            h = round_to(silu * b, xn.dtype)
            tl.store(H_OUT + local64[:, None] * H + hid[None, :], h, mask=h_mask)
            dab_ptrs = DAB_OUT + local64[:, None] * (2 * H) + hid[None, :]
            tl.store(dab_ptrs, da, mask=h_mask)
            tl.store(dab_ptrs + H, db, mask=h_mask)
        if NEED_DXN:
            dxn = _mm(da, tl.trans(w_a), dxn, INPUT_PRECISION, INTERPRETER)
            dxn = _mm(db, tl.trans(w_b), dxn, INPUT_PRECISION, INTERPRETER)

    if NORMALIZE:
        # Reloaded rather than kept: the fp32 rows would hold 64 registers per
        # thread through the whole loop (at BLOCK_M = BLOCK_C = 128, 8 warps).
        _, xhat, rstd = _normalized_rows(
            X, LN_W, LN_B, MEAN, RSTD, rows, cols, row_ok, col_ok, stride_x,
            NORMALIZE, dtype,
        )  # fmt: skip
        if LN_GRAD:
            part = (P0 + pid) * C + cols
            tl.store(DLN_W_PART + part, tl.sum(dxn * xhat, axis=0), col_ok)
            tl.store(DLN_B_PART + part, tl.sum(dxn, axis=0), col_ok)
        if STORE_DX:
            ln_w = tl.load(LN_W + cols, mask=col_ok, other=0.0).to(tl.float32)
            g = dxn * ln_w[None, :]
            mean_g = tl.sum(g, axis=1) / C
            mean_gx = tl.sum(g * xhat, axis=1) / C
            dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
    else:
        dx = dxn
    if STORE_DX:
        tl.store(
            DX + rows64[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


# The three [C, BLOCK_H] fp32 accumulators live in registers for the whole program, so
# the hidden chunks are narrower than in the other two kernels. The first three
# compile for sm_90 without register spills at c = 128, all of them at c = 64.
BWD_WEIGHT_CONFIGS, BWD_WEIGHT_PRUNE = tuning_space(
    half=[(64, 32, 8, 2), (64, 32, 8, 3), (128, 16, 8, 2), (128, 32, 8, 2),
          (64, 32, 4, 3)],
    single=[(32, 32, 4, 2), (64, 16, 4, 2)],
    interpreter_block_h=16,
)  # fmt: skip


@triton.autotune(
    configs=BWD_WEIGHT_CONFIGS,
    key=["C", "H", "NORMALIZE", "HAS_MASK"],
    prune_configs_by=BWD_WEIGHT_PRUNE,
    # The number of row splits depends on BLOCK_H; unused split rows must be zero.
    reset_to_zero=["DW_AB_PART", "DW_OUT_PART"],
)
@triton.heuristics({"EVEN_WEIGHTS": even_weights})
@triton.jit
def _swiglu_transition_bwd_weight_kernel(
    X, LN_W, LN_B, W_AB, W_OUT, MASK, DY, MEAN, RSTD,
    DW_AB_PART,  # [splits, 2H, C] fp32 (rows as w_ab), written when NEED_DW_AB
    DW_OUT_PART,  # [splits, C, H] fp32, written when NEED_DW_OUT
    M, C, H, stride_x, stride_dy,
    NORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NEED_DW_AB: tl.constexpr,
    NEED_DW_OUT: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_WEIGHTS: tl.constexpr,
):  # fmt: skip
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    dtype = W_AB.dtype.element_ty
    hid = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_C)
    h_ok = hid < H
    col_ok = cols < C
    # This program's chunk of the weights stays in shared memory.
    w_a = _weight_tile_kn(W_AB, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
    w_b = _weight_tile_kn(W_AB + H * C, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
    w_out = _out_weight_tile_cn(W_OUT, hid, cols, h_ok, col_ok, H, EVEN_WEIGHTS)

    # Accumulators transposed ([C, hidden]): every weight-gradient matmul then has
    # M = BLOCK_C, a full tensor-core tile, whatever BLOCK_H is.
    dw_a = tl.zeros((BLOCK_C, BLOCK_H), dtype=tl.float32)
    dw_b = tl.zeros((BLOCK_C, BLOCK_H), dtype=tl.float32)
    dw_out = tl.zeros((BLOCK_C, BLOCK_H), dtype=tl.float32)
    # Row blocks are dealt round-robin, so every split gets the same share.
    for block in range(split, tl.cdiv(M, BLOCK_M), n_splits):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        xn, _, _ = _normalized_rows(
            X, LN_W, LN_B, MEAN, RSTD, rows, cols, row_ok, col_ok, stride_x,
            NORMALIZE, dtype,
        )  # fmt: skip
        dy = _masked_grad_rows(
            DY, MASK, rows, cols, row_ok, col_ok, stride_dy, HAS_MASK, dtype,
        )  # fmt: skip
        a = _mm(xn, w_a, None, INPUT_PRECISION, INTERPRETER)
        b = _mm(xn, w_b, None, INPUT_PRECISION, INTERPRETER)
        sig = _sigmoid(a, FAST_SIGMOID)
        silu = a * sig
        if NEED_DW_OUT:
            h = round_to(silu * b, xn.dtype)
            dw_out = _mm(tl.trans(dy), h, dw_out, INPUT_PRECISION, INTERPRETER)
        if NEED_DW_AB:
            # d(h)/d(a), formed before the next matmul so that only two fp32
            # tiles (silu, gate) stay live across it instead of four (a, b, sig, silu)
            gate = b * (sig + silu * (1.0 - sig))
            dh = _mm(dy, w_out, None, INPUT_PRECISION, INTERPRETER)
            xn_t = tl.trans(xn)
            dw_a = _mm(
                xn_t, round_to(dh * gate, xn.dtype), dw_a, INPUT_PRECISION, INTERPRETER
            )
            dw_b = _mm(
                xn_t, round_to(dh * silu, xn.dtype), dw_b, INPUT_PRECISION, INTERPRETER
            )

    if NEED_DW_AB:
        ab_mask = col_ok[:, None] & h_ok[None, :]
        part_a = split * 2 * H * C + hid[None, :] * C + cols[:, None]
        tl.store(DW_AB_PART + part_a, dw_a, mask=ab_mask)
        tl.store(DW_AB_PART + part_a + H * C, dw_b, mask=ab_mask)
    if NEED_DW_OUT:
        part_out = split * C * H + cols[:, None] * H + hid[None, :]
        tl.store(DW_OUT_PART + part_out, dw_out, mask=col_ok[:, None] & h_ok[None, :])
