"""Triton kernels around the triangle multiplication's two batched GEMMs.

Layouts: ``R = N * N`` positions per batch item ``b``. ``PROJ`` is ``[B, R, 4 C_h
+ C_z]``, the one GEMM of the normalised input with the five projections' weights
stacked (``a_p | a_g | b_p | b_g | g``, row stride ``STRIDE_P``). The GEMM operands
``A_T``/``B_T`` and their product ``P`` are ``[B, C_h, R]`` (channel-major: one
``[N, N]`` matrix per channel, as the batched GEMM wants them).

* ``_gate_fwd_kernel``: ``a = mask sigmoid(a_g) a_p`` and ``b`` likewise, written
  channel-major (the transpose happens in the kernel, not in a copy).
* ``_gate_bwd_kernel``: their gradients from ``dA``/``dB`` (channel-major), written
  over the four ``PROJ`` slots they came from (each element read, then written, by
  one program).
* ``_out_fwd_kernel``: ``out = (LN_out(p) W_z^T) sigmoid(g)`` per ``BLOCK_R``
  positions: the LayerNorm over ``C_h`` of a channel-major ``P`` tile, one tensor-core
  dot with ``W_z`` and the gate, in one pass.
* ``_out_bwd_kernel``: recomputes that forward; writes ``dg`` over ``PROJ``'s ``g``
  slot, ``dP`` (channel-major), and the two operands of the ``W_z`` gradient GEMM
  (``dy = dout sigmoid(g)`` and ``LN_out(p)``, ``[B R, C]``); the LayerNorm's weight
  and bias gradients are summed per program into fp32 partials (no atomics).

Both output kernels are persistent: a program loads ``W_z`` and the LayerNorm affine
once and walks tiles ``program_id, program_id + programs, ...`` of the ``TILES`` =
``cdiv(R, BLOCK_R) * B`` tiles, so the next tile's loads can be issued while one is
computed (``NUM_STAGES``).
"""

import triton
import triton.language as tl

from .._rounding import dot, round_to


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gate_fwd_kernel(
    PROJ, MASK, A_T, B_T,
    R, CH, STRIDE_P,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < R) & (cols[None, :] < CH)
    src = PROJ + (b * R + rows[:, None]) * STRIDE_P + cols[None, :]
    a_p = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    a_g = tl.load(src + CH, mask=inside, other=0.0).to(tl.float32)
    b_p = tl.load(src + 2 * CH, mask=inside, other=0.0).to(tl.float32)
    b_g = tl.load(src + 3 * CH, mask=inside, other=0.0).to(tl.float32)
    a = _sigmoid(a_g) * a_p
    bb = _sigmoid(b_g) * b_p
    if HAS_MASK:
        m = tl.load(MASK + b * R + rows, mask=rows < R, other=0.0).to(tl.float32)
        a = a * m[:, None]
        bb = bb * m[:, None]
    dst = (b * CH + cols[None, :]) * R + rows[:, None]
    tl.store(A_T + dst, round_to(a, A_T.dtype.element_ty), mask=inside)
    tl.store(B_T + dst, round_to(bb, B_T.dtype.element_ty), mask=inside)


@triton.jit
def _gate_bwd_kernel(
    PROJ, MASK, DA_T, DB_T,
    R, CH, STRIDE_P,
    HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < R) & (cols[None, :] < CH)
    src = PROJ + (b * R + rows[:, None]) * STRIDE_P + cols[None, :]
    grad = (b * CH + cols[None, :]) * R + rows[:, None]
    da = tl.load(DA_T + grad, mask=inside, other=0.0).to(tl.float32)
    db = tl.load(DB_T + grad, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        m = tl.load(MASK + b * R + rows, mask=rows < R, other=0.0).to(tl.float32)
        da = da * m[:, None]
        db = db * m[:, None]
    _gate_grad(src, src + CH, da, inside)
    _gate_grad(src + 2 * CH, src + 3 * CH, db, inside)


@triton.jit
def _gate_grad(SRC_P, SRC_G, d, inside):
    """Overwrite the projection ``p`` and gate ``g`` of ``d (sigmoid(g) p)``'s
    operand with their gradients, given the (masked) gradient ``d``."""
    p = tl.load(SRC_P, mask=inside, other=0.0).to(tl.float32)
    s = _sigmoid(tl.load(SRC_G, mask=inside, other=0.0).to(tl.float32))
    dtype = SRC_P.dtype.element_ty
    tl.store(SRC_P, round_to(d * s, dtype), mask=inside)
    tl.store(SRC_G, round_to(d * p * s * (1.0 - s), dtype), mask=inside)


@triton.jit
def _out_weights(LN_W, LN_B, WZ, CH, CZ,
                 BLOCK_CH: tl.constexpr, BLOCK_CZ: tl.constexpr):
    """The output LayerNorm's affine (fp32 ``[BLOCK_CH]``) and ``W_z^T``
    (``[BLOCK_CH, BLOCK_CZ]``), zero outside: loaded once per program."""
    ch = tl.arange(0, BLOCK_CH)
    cz = tl.arange(0, BLOCK_CZ)
    w = tl.load(LN_W + ch, mask=ch < CH, other=0.0).to(tl.float32)
    bias = tl.load(LN_B + ch, mask=ch < CH, other=0.0).to(tl.float32)
    w_z_t = tl.load(WZ + cz[None, :] * CH + ch[:, None],
                    mask=(ch[:, None] < CH) & (cz[None, :] < CZ), other=0.0)
    return w, bias, w_z_t


@triton.jit
def _tile_rows(t, R, BLOCK_R: tl.constexpr):
    """Batch item and positions of tile ``t`` (tiles run over positions, then
    batch items)."""
    tiles_r = tl.cdiv(R, BLOCK_R)
    b = (t // tiles_r).to(tl.int64)
    rows = (t % tiles_r).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return b, rows


@triton.jit
def _out_tile(
    P, w, bias, w_z_t, b, rows, R, CH, eps, BLOCK_CH: tl.constexpr,
):
    """``(xhat, rstd, ln, y)`` of ``BLOCK_R`` positions: the normalised channel-major
    ``P`` tile ``[BLOCK_R, BLOCK_CH]`` (fp32), its rstd, ``LN_out(p)`` rounded to
    ``w_z_t``'s dtype, and ``y = LN_out(p) W_z^T`` (fp32 ``[BLOCK_R, BLOCK_CZ]``)."""
    ch = tl.arange(0, BLOCK_CH)
    x_in = (rows[:, None] < R) & (ch[None, :] < CH)
    x = tl.load(P + (b * CH + ch[None, :]) * R + rows[:, None], mask=x_in,
                other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / CH
    xc = tl.where(x_in, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / CH + eps)
    xhat = xc * rstd[:, None]
    ln = round_to(tl.where(x_in, xhat * w[None, :] + bias[None, :], 0.0),
                  w_z_t.dtype)
    y = dot(ln, w_z_t)
    return xhat, rstd, ln, y


@triton.jit
def _out_fwd_kernel(
    P, PROJ, LN_W, LN_B, WZ, OUT,
    R, CH, CZ, STRIDE_P, eps, TILES,
    BLOCK_R: tl.constexpr, BLOCK_CH: tl.constexpr, BLOCK_CZ: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    cz = tl.arange(0, BLOCK_CZ)
    w, bias, w_z_t = _out_weights(LN_W, LN_B, WZ, CH, CZ, BLOCK_CH, BLOCK_CZ)
    for t in tl.range(tl.program_id(0), TILES, tl.num_programs(0),
                      num_stages=NUM_STAGES):
        b, rows = _tile_rows(t, R, BLOCK_R)
        _, _, _, y = _out_tile(P, w, bias, w_z_t, b, rows, R, CH, eps, BLOCK_CH)
        out_in = (rows[:, None] < R) & (cz[None, :] < CZ)
        pos = b * R + rows[:, None]
        g = tl.load(PROJ + pos * STRIDE_P + 4 * CH + cz[None, :], mask=out_in,
                    other=0.0).to(tl.float32)
        tl.store(OUT + pos * CZ + cz[None, :], round_to(y * _sigmoid(g),
                 OUT.dtype.element_ty), mask=out_in)


@triton.jit
def _out_bwd_kernel(
    P, PROJ, LN_W, LN_B, WZ, DOUT, DP, DY, LNO, DW_PART, DB_PART,
    R, CH, CZ, STRIDE_P, eps, TILES,
    BLOCK_R: tl.constexpr, BLOCK_CH: tl.constexpr, BLOCK_CZ: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    ch = tl.arange(0, BLOCK_CH)
    cz = tl.arange(0, BLOCK_CZ)
    w, bias, w_z_t = _out_weights(LN_W, LN_B, WZ, CH, CZ, BLOCK_CH, BLOCK_CZ)
    w_z = tl.trans(w_z_t)
    dw = tl.zeros([BLOCK_CH], dtype=tl.float32)
    db = tl.zeros([BLOCK_CH], dtype=tl.float32)
    for t in tl.range(tl.program_id(0), TILES, tl.num_programs(0),
                      num_stages=NUM_STAGES):
        b, rows = _tile_rows(t, R, BLOCK_R)
        xhat, rstd, ln, y = _out_tile(P, w, bias, w_z_t, b, rows, R, CH, eps,
                                      BLOCK_CH)
        row_in = rows[:, None] < R
        out_in = row_in & (cz[None, :] < CZ)
        x_in = row_in & (ch[None, :] < CH)
        pos = b * R + rows[:, None]
        g_ptr = PROJ + pos * STRIDE_P + 4 * CH + cz[None, :]
        s = _sigmoid(tl.load(g_ptr, mask=out_in, other=0.0).to(tl.float32))
        dout = tl.load(DOUT + pos * CZ + cz[None, :], mask=out_in,
                       other=0.0).to(tl.float32)
        tl.store(g_ptr, round_to(dout * y * s * (1.0 - s), PROJ.dtype.element_ty),
                 mask=out_in)
        dy = round_to(dout * s, w_z.dtype)
        tl.store(DY + pos * CZ + cz[None, :], dy, mask=out_in)
        tl.store(LNO + pos * CH + ch[None, :], ln, mask=x_in)
        dln = dot(dy, w_z)
        dw += tl.sum(dln * xhat, 0)
        db += tl.sum(tl.where(x_in, dln, 0.0), 0)
        dxhat = dln * w[None, :]
        c1 = tl.sum(dxhat * xhat, 1) / CH
        c2 = tl.sum(tl.where(x_in, dxhat, 0.0), 1) / CH
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DP + (b * CH + ch[None, :]) * R + rows[:, None],
                 round_to(dx, DP.dtype.element_ty), mask=x_in)
    tl.store(DW_PART + tl.program_id(0) * CH + ch, dw, mask=ch < CH)
    tl.store(DB_PART + tl.program_id(0) * CH + ch, db, mask=ch < CH)
