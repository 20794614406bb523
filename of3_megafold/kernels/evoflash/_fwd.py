"""EvoFlash forward kernel: flash attention with a pair bias shared over S.

One program owns ``BLOCK_M`` query rows of ``S_GROUP`` consecutive S slices of one
``(b, h)`` and walks the keys in ``BLOCK_N`` blocks with the online softmax of
flash-attention 2 (Dao, 2023). The pair-bias tile of a key block is the same for
every S slice when the bias is broadcast over S, so it is loaded once per key block
and used ``S_GROUP`` times: at OF3's triangle shapes the bias tile, not the dots, is
the bulk of the L2 traffic per exponential.

With ``GATED`` the stored output is ``O * sigmoid(gate)``, OF3's gating (a
``[B, S, N, H, D]`` gate, one value per output element) applied in the epilogue.

Stored per query row, base 2: ``lse = m2 + log2(l)`` with ``m2 = log2(e) * max_j s``,
and ``r = 2^(lse - m2 - log2 l)``, the factor the rounding of ``lse`` lost. ``r`` is 1
up to an ulp except for a query whose keys are all masked by a -1e9 bias: there
``m2`` is ~-1.4e9, ``m2 + log2(l)`` rounds back to ``m2`` and ``r = 1 / l`` carries
the normalisation the backward needs.
"""

import triton
import triton.language as tl

from ._tiles import (
    LOG2E,
    _cast,
    _dot,
    _key_block_masked,
    _load_bias,
    _load_key_mask,
    _load_mask_range,
    _load_tile,
    _row_ptr,
    _stat_ptr,
)


@triton.jit
def _evoflash_mask_range_kernel(
    MASK, KRANGE, N, SM, stride_mb, stride_ms, stride_mn, BLOCK: tl.constexpr,
):
    """Per slice ``(b, s)`` of a key mask ``[BM, SM, N]`` (strided; one program per
    slice), the int32 pair ``KRANGE[b, s] = (lo, hi)``: the keys ``[lo, hi)`` hold all
    its nonzero values, ``(0, 0)`` if there are none. The kernels add the key mask
    only to key blocks that overlap that range (``_tiles._key_block_masked``); OF3's
    masks are padding at the end of the crop, one such range per slice."""
    pid = tl.program_id(0)
    b = pid // SM
    s = pid % SM
    row = MASK + b.to(tl.int64) * stride_mb + s.to(tl.int64) * stride_ms
    lo = N
    hi = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.load(row + offs * stride_mn, mask=offs < N, other=0.0)
        nonzero = (m != 0) & (offs < N)  # NaN counts as nonzero
        lo = tl.minimum(lo, tl.min(tl.where(nonzero, offs, N), 0))
        hi = tl.maximum(hi, tl.max(tl.where(nonzero, offs + 1, 0), 0))
    tl.store(KRANGE + pid * 2, tl.where(hi > 0, lo, 0))
    tl.store(KRANGE + pid * 2 + 1, hi)


@triton.jit
def _fwd_key_block(
    acc, m_i, l_i, q, bias, masked,
    K_row, V_row, MASK, b, s_idx, offs_n, offs_d, N, D,
    stride_kn, stride_vn, stride_mb, stride_ms, stride_mn, sm_scale,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step of one S slice over the key block ``offs_n``;
    ``masked``: the block needs the column mask (``_tiles._key_block_masked``)."""
    k_t = _load_tile(K_row, offs_n, offs_d, stride_kn, N, D, EVEN_N, PAD_D, True,
                     PRECISION > 0)
    v = _load_tile(V_row, offs_n, offs_d, stride_vn, N, D, EVEN_N, PAD_D, False,
                   PRECISION > 0)
    s = _dot(q, k_t, None, PRECISION) * sm_scale
    if HAS_BIAS:
        s += bias
    if COL_MASK:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if masked:
            key_mask = _load_key_mask(MASK, b, s_idx, offs_n, N, stride_mb,
                                      stride_ms, stride_mn, HAS_MASK, EVEN_N)
            s += key_mask[None, :]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s * LOG2E - (m_new * LOG2E)[:, None])
    alpha = tl.math.exp2((m_i - m_new) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(_cast(p, v.dtype), v, acc * alpha[:, None], PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_store(
    acc, m_i, l_i, O_row, LSE_row, R_row, GATE_row, offs_m, offs_d, stride_on,
    stride_gtn, n_rows, D, GATED: tl.constexpr,
):
    """Normalise and store one S slice's rows, times ``sigmoid(gate)`` if GATED;
    ``n_rows`` is N, or 0 for a slice past S (a scalar row limit rather than a
    boolean: the interpreter cannot combine a scalar int1 with a block mask)."""
    m2 = m_i * LOG2E  # exactly as in _fwd_key_block
    log2_l = tl.math.log2(l_i)
    lse = m2 + log2_l
    r = tl.math.exp2((lse - m2) - log2_l)
    o = acc / l_i[:, None]
    rows_ok = offs_m < n_rows
    if GATED:
        gate = tl.load(GATE_row + offs_m[:, None] * stride_gtn + offs_d[None, :],
                       mask=rows_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        o = o * tl.sigmoid(gate.to(tl.float32))
    o_ptrs = O_row + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, _cast(o, O_row.dtype.element_ty),
             mask=rows_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE_row + offs_m, lse, mask=rows_ok)
    tl.store(R_row + offs_m, r, mask=rows_ok)


@triton.jit
def _evoflash_fwd_kernel(
    Q, K, V, MASK, BIAS, OUT, LSE, RSCALE, RFLAG, GATE, KRANGE,
    sm_scale,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_mb, stride_ms, stride_mn, stride_rb, stride_rs,
    stride_bb, stride_bs, stride_bh, stride_bi,
    stride_gtb, stride_gts, stride_gtn, stride_gth,
    S, N, H, D,
    N_BUCKET, S_BUCKET,  # autotuning key only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_PER_S: tl.constexpr,
    MASK_RANGES: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S_GROUP: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, COL_MASK: tl.constexpr,
):
    tl.static_assert(S_GROUP <= 2)  # one or two S slices per program
    # Program order: query block fastest, then S group, head, batch. The query
    # blocks of one S group share K/V; all programs of a head share its bias,
    # which stays in L2 while the head is processed.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_sg = tl.cdiv(S, S_GROUP)
    m_blk = pid % num_m
    rest = pid // num_m
    s0 = (rest % num_sg) * S_GROUP
    rest = rest // num_sg
    h = rest % H
    b = rest // H

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q0 = _load_tile(_row_ptr(Q, b, s0, h, stride_qb, stride_qs, stride_qh), offs_m,
                    offs_d, stride_qn, N, D, EVEN_N, PAD_D, False, PRECISION > 0)
    K0 = _row_ptr(K, b, s0, h, stride_kb, stride_ks, stride_kh)
    V0 = _row_ptr(V, b, s0, h, stride_vb, stride_vs, stride_vh)
    lo0, hi0 = _load_mask_range(KRANGE, b, s0, stride_rb, stride_rs, MASK_RANGES)
    acc0 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m0 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if S_GROUP == 2:
        # A group running past S recomputes slice S-1 and does not store it.
        s1 = tl.minimum(s0 + 1, S - 1)
        q1 = _load_tile(_row_ptr(Q, b, s1, h, stride_qb, stride_qs, stride_qh),
                        offs_m, offs_d, stride_qn, N, D, EVEN_N, PAD_D, False,
                        PRECISION > 0)
        K1 = _row_ptr(K, b, s1, h, stride_kb, stride_ks, stride_kh)
        V1 = _row_ptr(V, b, s1, h, stride_vb, stride_vs, stride_vh)
        lo1, hi1 = _load_mask_range(KRANGE, b, s1, stride_rb, stride_rs, MASK_RANGES)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m1 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l1 = tl.zeros([BLOCK_M], dtype=tl.float32)

    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = _load_bias(BIAS, b, s0, h, offs_m, offs_n, N, stride_bb,
                                        stride_bs, stride_bh, stride_bi, EVEN_N)
        else:
            bias = 0.0
        acc0, m0, l0 = _fwd_key_block(
            acc0, m0, l0, q0, bias,
            _key_block_masked(start_n, lo0, hi0, N, BLOCK_N, MASK_RANGES),
            K0, V0, MASK, b, s0, offs_n, offs_d, N, D,
            stride_kn, stride_vn, stride_mb, stride_ms, stride_mn, sm_scale,
            HAS_MASK, HAS_BIAS, COL_MASK, EVEN_N, PAD_D, PRECISION)
        if S_GROUP == 2:
            if BIAS_PER_S:
                bias = _load_bias(BIAS, b, s1, h, offs_m, offs_n, N,
                                            stride_bb, stride_bs, stride_bh,
                                            stride_bi, EVEN_N)
            acc1, m1, l1 = _fwd_key_block(
                acc1, m1, l1, q1, bias,
                _key_block_masked(start_n, lo1, hi1, N, BLOCK_N, MASK_RANGES),
                K1, V1, MASK, b, s1, offs_n, offs_d, N, D,
                stride_kn, stride_vn, stride_mb, stride_ms, stride_mn, sm_scale,
                HAS_MASK, HAS_BIAS, COL_MASK, EVEN_N, PAD_D, PRECISION)

    _fwd_store(acc0, m0, l0,
               _row_ptr(OUT, b, s0, h, stride_ob, stride_os, stride_oh),
               _stat_ptr(LSE, b, s0, h, S, H, N), _stat_ptr(RSCALE, b, s0, h, S, H, N),
               _row_ptr(GATE, b, s0, h, stride_gtb, stride_gts, stride_gth),
               offs_m, offs_d, stride_on, stride_gtn, N, D, GATED)
    if S_GROUP == 2:
        _fwd_store(acc1, m1, l1,
                   _row_ptr(OUT, b, s1, h, stride_ob, stride_os, stride_oh),
                   _stat_ptr(LSE, b, s1, h, S, H, N),
                   _stat_ptr(RSCALE, b, s1, h, S, H, N),
                   _row_ptr(GATE, b, s1, h, stride_gtb, stride_gts, stride_gth),
                   offs_m, offs_d, stride_on, stride_gtn,
                   tl.where(s0 + 1 < S, N, 0), D, GATED)
    # Zero the backward's per-slice flags (set by its preprocess kernel, after this
    # kernel has run: no fill launch of its own).
    if (m_blk == 0) & (h == 0):
        tl.store(RFLAG + b * S + s0, 0)
        if S_GROUP == 2:
            tl.store(RFLAG + b * S + s0 + 1, 0, mask=s0 + 1 < S)
