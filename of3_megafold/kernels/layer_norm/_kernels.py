"""LayerNorm kernels: rows of ``C <= BLOCK_C`` channels, statistics in fp32.

* ``_layer_norm_fwd_kernel``: program per ``BLOCK_R`` rows; stores ``y`` in the
  output's dtype and the per-row ``mean`` and ``rstd`` (fp32) for the backward.
* ``_layer_norm_bwd_kernel``: programs own contiguous runs of ``ROWS_PER_PROGRAM``
  rows; per row ``dx = rstd (w dy - mean(w dy) - xhat mean(w dy xhat))`` with
  ``xhat = (x - mean) rstd`` recomputed from ``x``; ``dw = sum dy xhat`` and
  ``db = sum dy`` are summed over the program's rows in registers and stored as one
  fp32 partial per program (the launcher sums the partials over programs in a fixed
  order: no atomics, reproducible).
"""

import triton
import triton.language as tl

from .._rounding import round_to


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    R, C, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None] * C + cols[None, :]
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / C
    xc = tl.where(inside, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / C + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, round_to(y, Y.dtype.element_ty), mask=inside)
    tl.store(MEAN + rows, mean, mask=rows < R)
    tl.store(RSTD + rows, rstd, mask=rows < R)


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART,
    R, C, ROWS_PER_PROGRAM,
    HAS_W: tl.constexpr, NEED_DWB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_in = cols < C
    if HAS_W:
        w = tl.load(W + cols, mask=col_in, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    last = tl.minimum(first + ROWS_PER_PROGRAM, R)
    for start in range(first, last, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_in = rows < last
        inside = row_in[:, None] & col_in[None, :]
        offs = rows[:, None] * C + cols[None, :]
        x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_in, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_in, other=0.0)
        xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:  # noqa: SIM108 (constexpr branches)
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, 1) / C
        c2 = tl.sum(wdy, 1) / C
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + offs, round_to(dx, DX.dtype.element_ty), mask=inside)
        if NEED_DWB:
            dw += tl.sum(dy * xhat, 0)
            db += tl.sum(dy, 0)
    if NEED_DWB:
        tl.store(DW_PART + pid * C + cols, dw, mask=col_in)
        tl.store(DB_PART + pid * C + cols, db, mask=col_in)
