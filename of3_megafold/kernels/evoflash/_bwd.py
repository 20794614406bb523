"""EvoFlash backward kernels.

With ``dS = P * (dP - delta)``, ``dP = dO V^T``, ``delta = rowsum(dO * O)``:
``dV = P^T dO``, ``dK = scale dS^T Q``, ``dQ = scale dS K``, ``d pair_bias = sum_S dS``.
Each of the three reductions runs over a different axis (queries, keys, S), so each
gets its own kernel whose programs own their output tile and accumulate it in
registers: no atomics, a fixed summation order, bit-reproducible gradients.

* ``_evoflash_bwd_dkdv_kernel``: program per (b, h, S group, key block), loops over
  query blocks (flash-attention 2's dK/dV kernel; Dao, 2023).
* ``_evoflash_bwd_dq_kernel``: program per (b, h, S group, query block), loops over
  key blocks. Where the bias gradient needs no S reduction (S == 1, or a bias with
  its own S axis) it also stores ``dS`` as the bias gradient.
* ``_evoflash_bwd_dbias_kernel``: program per (S chunk, b, h, query block, key block),
  loops over S and sums ``dS`` in registers; S is split into a few chunks, summed
  afterwards in a fixed order, when there are too few tiles to fill the GPU. With
  ``FUSE_DQ`` it also adds ``scale dS K`` to an fp32 dQ with atomics, which saves
  the dQ kernel's pass over the exponentials at the price of determinism.

Every kernel recomputes ``P = exp2(log2(e) s - lse) * r`` (see ``_fwd``). ``r`` enters
``dS = p (r dP - r delta)`` through one FMA (``delta`` is stored times ``r``); only
the dK/dV kernel's ``dV = P^T dO`` needs it on the tile itself, and only in the S
slices that hold a fully masked query, flagged per slice by the launcher.

Pass count: at OF3's triangle shapes the exponentials, not the dots, bound the
time; the deterministic backward recomputes P three times (dK/dV, dQ, dbias), the
atomic variant twice.
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
    _load_rowstat,
    _load_tile,
    _row_ptr,
    _stat_ptr,
)


@triton.jit
def _evoflash_bwd_preprocess_kernel(
    OUT, DO, RSCALE, DELTA, RFLAG, GATE, DGATE, DO_OUT,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_gtb, stride_gts, stride_gtn, stride_gth,
    S, N, H, D,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``delta = r * rowsum(dO * O)`` per query row, and ``RFLAG[b, s] = 1`` (an
    int32 zero-initialised ``[B, S]``) where a query of slice ``(b, s)`` has
    ``r < 1``: a fully masked query, whose normalisation the dK/dV pass must apply.

    With ``GATED``, ``OUT`` holds the gated output ``O' = O sigmoid(g)`` and ``DO``
    its gradient. Then ``dO . O = dO' . O'`` gives ``delta`` as it stands, the gate
    gradient ``dO' O' (1 - sigmoid(g))`` goes to ``DGATE`` and the attention's own
    ``dO = dO' sigmoid(g)`` to ``DO_OUT``, both with ``GATE``'s strides, which the
    other backward kernels then read (the launcher passes dQ's slot of the packed
    gradient: the dQ kernel, last to read dO, reads a program's rows before it
    writes them)."""
    pid_m = tl.program_id(0)
    pid_bsh = tl.program_id(1)
    h = pid_bsh % H
    s = (pid_bsh // H) % S
    b = pid_bsh // (H * S)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(_row_ptr(OUT, b, s, h, stride_ob, stride_os, stride_oh), offs_m,
                   offs_d, stride_on, N, D, False, True, False, True)
    do = _load_tile(_row_ptr(DO, b, s, h, stride_dob, stride_dos, stride_doh), offs_m,
                    offs_d, stride_don, N, D, False, True, False, True)
    r_row = _stat_ptr(RSCALE, b, s, h, S, H, N)
    r = tl.load(r_row + offs_m, mask=offs_m < N, other=1.0)
    tl.store(_stat_ptr(DELTA, b, s, h, S, H, N) + offs_m, tl.sum(o * do, 1) * r,
             mask=offs_m < N)
    partial = tl.max((r < 1 - 1e-4).to(tl.int32), 0)
    if partial != 0:
        tl.atomic_max(RFLAG + b * S + s, partial)
    if GATED:
        inside = (offs_m[:, None] < N) & (offs_d[None, :] < D)
        gate_off = offs_m[:, None] * stride_gtn + offs_d[None, :]
        gate_row = _row_ptr(GATE, b, s, h, stride_gtb, stride_gts, stride_gth)
        sig = tl.sigmoid(_load_tile(gate_row, offs_m, offs_d, stride_gtn, N, D,
                                    False, True, False, True))
        dgate_row = _row_ptr(DGATE, b, s, h, stride_gtb, stride_gts, stride_gth)
        tl.store(dgate_row + gate_off,
                 _cast(do * o * (1.0 - sig), DGATE.dtype.element_ty), mask=inside)
        do_out_row = _row_ptr(DO_OUT, b, s, h, stride_gtb, stride_gts, stride_gth)
        tl.store(do_out_row + gate_off, _cast(do * sig, DO_OUT.dtype.element_ty),
                 mask=inside)


@triton.jit
def _dkdv_query_block(
    dk, dv, k, v, key_mask, bias_t, needs_r,
    Q_row, DO_row, LSE_row, R_row, DELTA_row, offs_m, offs_d, N, D,
    stride_qn, stride_don, sm_scale,
    HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr, EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK/dV of one key block and one S slice, from the query block ``offs_m``.
    Works on transposed ``[BLOCK_N, BLOCK_M]`` tiles so P^T and dS^T feed the
    dots without a layout change; the bias comes pre-transposed. ``r`` enters dS
    through an FMA; it reaches dV (a per-query factor inside the sum) only in the
    S slices that hold a fully masked query, ``needs_r``, so elsewhere dO goes to
    the tensor cores as loaded."""
    q = _load_tile(Q_row, offs_m, offs_d, stride_qn, N, D, EVEN_N, PAD_D, False,
                   PRECISION > 0)
    do = _load_tile(DO_row, offs_m, offs_d, stride_don, N, D, EVEN_N, PAD_D, False,
                    PRECISION > 0)
    # Rows past N: lse = +inf makes their P^T column exactly 0.
    lse = _load_rowstat(LSE_row, offs_m, N, float("inf"), EVEN_N)
    r = _load_rowstat(R_row, offs_m, N, 0.0, EVEN_N)
    delta = _load_rowstat(DELTA_row, offs_m, N, 0.0, EVEN_N)
    s_t = _dot(k, tl.trans(q), None, PRECISION) * sm_scale
    if HAS_BIAS:
        s_t += bias_t
    if COL_MASK:
        s_t += key_mask[:, None]
    p_t = tl.math.exp2(s_t * LOG2E - lse[None, :])
    dp_t = _dot(v, tl.trans(do), None, PRECISION)
    ds_t = p_t * (dp_t * r[None, :] - delta[None, :])
    dk = _dot(_cast(ds_t, q.dtype), q, dk, PRECISION)
    if needs_r:
        p_t = p_t * r[None, :]
    dv = _dot(_cast(p_t, do.dtype), do, dv, PRECISION)
    return dk, dv


@triton.jit
def _evoflash_bwd_dkdv_kernel(
    Q, K, V, DO, MASK, BIAS_T, LSE, RSCALE, RFLAG, DELTA, DK, DV,
    sm_scale,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_gb, stride_gs, stride_gn, stride_gh,
    stride_mb, stride_ms, stride_mn,
    stride_bb, stride_bs, stride_bh, stride_bi,
    S, N, H, D,
    N_BUCKET, S_BUCKET,  # autotuning key only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_PER_S: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S_GROUP: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, COL_MASK: tl.constexpr,
):
    tl.static_assert(S_GROUP <= 2)  # one or two S slices per program
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_sg = tl.cdiv(S, S_GROUP)
    n_blk = pid % num_n
    rest = pid // num_n
    s0 = (rest % num_sg) * S_GROUP
    rest = rest // num_sg
    h = rest % H
    b = rest // H

    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k0 = _load_tile(_row_ptr(K, b, s0, h, stride_kb, stride_ks, stride_kh), offs_n,
                    offs_d, stride_kn, N, D, EVEN_N, PAD_D, False, PRECISION > 0)
    v0 = _load_tile(_row_ptr(V, b, s0, h, stride_vb, stride_vs, stride_vh), offs_n,
                    offs_d, stride_vn, N, D, EVEN_N, PAD_D, False, PRECISION > 0)
    mask0 = _load_key_mask(MASK, b, s0, offs_n, N, stride_mb, stride_ms, stride_mn,
                           HAS_MASK, EVEN_N)
    Q0 = _row_ptr(Q, b, s0, h, stride_qb, stride_qs, stride_qh)
    DO0 = _row_ptr(DO, b, s0, h, stride_dob, stride_dos, stride_doh)
    needs_r0 = tl.load(RFLAG + b * S + s0) != 0
    dk0 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if S_GROUP == 2:
        s1 = tl.minimum(s0 + 1, S - 1)
        k1 = _load_tile(_row_ptr(K, b, s1, h, stride_kb, stride_ks, stride_kh),
                        offs_n, offs_d, stride_kn, N, D, EVEN_N, PAD_D, False,
                        PRECISION > 0)
        v1 = _load_tile(_row_ptr(V, b, s1, h, stride_vb, stride_vs, stride_vh),
                        offs_n, offs_d, stride_vn, N, D, EVEN_N, PAD_D, False,
                        PRECISION > 0)
        mask1 = _load_key_mask(MASK, b, s1, offs_n, N, stride_mb, stride_ms,
                               stride_mn, HAS_MASK, EVEN_N)
        Q1 = _row_ptr(Q, b, s1, h, stride_qb, stride_qs, stride_qh)
        DO1 = _row_ptr(DO, b, s1, h, stride_dob, stride_dos, stride_doh)
        needs_r1 = tl.load(RFLAG + b * S + s1) != 0
        dk1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    for start_m in range(0, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if HAS_BIAS:
            bias_t = _load_bias(BIAS_T, b, s0, h, offs_n, offs_m, N, stride_bb,
                                stride_bs, stride_bh, stride_bi, EVEN_N)
        else:
            bias_t = 0.0
        dk0, dv0 = _dkdv_query_block(
            dk0, dv0, k0, v0, mask0, bias_t, needs_r0, Q0, DO0,
            _stat_ptr(LSE, b, s0, h, S, H, N), _stat_ptr(RSCALE, b, s0, h, S, H, N),
            _stat_ptr(DELTA, b, s0, h, S, H, N), offs_m, offs_d, N, D, stride_qn,
            stride_don, sm_scale, HAS_BIAS, COL_MASK, EVEN_N, PAD_D,
            PRECISION)
        if S_GROUP == 2:
            if BIAS_PER_S:
                bias_t = _load_bias(BIAS_T, b, s1, h, offs_n, offs_m, N, stride_bb,
                                    stride_bs, stride_bh, stride_bi, EVEN_N)
            dk1, dv1 = _dkdv_query_block(
                dk1, dv1, k1, v1, mask1, bias_t, needs_r1, Q1, DO1,
                _stat_ptr(LSE, b, s1, h, S, H, N),
                _stat_ptr(RSCALE, b, s1, h, S, H, N),
                _stat_ptr(DELTA, b, s1, h, S, H, N), offs_m, offs_d, N, D, stride_qn,
                stride_don, sm_scale, HAS_BIAS, COL_MASK, EVEN_N, PAD_D,
                PRECISION)

    g_ptrs = offs_n[:, None] * stride_gn + offs_d[None, :]
    g_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    DK0 = _row_ptr(DK, b, s0, h, stride_gb, stride_gs, stride_gh)
    DV0 = _row_ptr(DV, b, s0, h, stride_gb, stride_gs, stride_gh)
    tl.store(DK0 + g_ptrs, _cast(dk0 * sm_scale, DK.dtype.element_ty), mask=g_mask)
    tl.store(DV0 + g_ptrs, _cast(dv0, DV.dtype.element_ty), mask=g_mask)
    if S_GROUP == 2:
        n1 = tl.where(s0 + 1 < S, N, 0)  # the slice past S is not stored
        g_mask = (offs_n[:, None] < n1) & (offs_d[None, :] < D)
        DK1 = _row_ptr(DK, b, s1, h, stride_gb, stride_gs, stride_gh)
        DV1 = _row_ptr(DV, b, s1, h, stride_gb, stride_gs, stride_gh)
        tl.store(DK1 + g_ptrs, _cast(dk1 * sm_scale, DK.dtype.element_ty), mask=g_mask)
        tl.store(DV1 + g_ptrs, _cast(dv1, DV.dtype.element_ty), mask=g_mask)


@triton.jit
def _ds_block(
    q, do, lse, r, delta, bias, masked, k_t, V_row, MASK, b, s_idx, offs_n, offs_d,
    N, D, stride_vn, stride_mb, stride_ms, stride_mn, sm_scale,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """``dS`` of a ``[BLOCK_M, BLOCK_N]`` tile of one S slice; ``masked``: the key
    block needs its column mask (``_tiles._key_block_masked``)."""
    v_t = _load_tile(V_row, offs_n, offs_d, stride_vn, N, D, EVEN_N, PAD_D, True,
                     PRECISION > 0)
    s = _dot(q, k_t, None, PRECISION) * sm_scale
    if HAS_BIAS:
        s += bias
    if COL_MASK:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if masked:
            key_mask = _load_key_mask(MASK, b, s_idx, offs_n, N, stride_mb,
                                      stride_ms, stride_mn, HAS_MASK, EVEN_N)
            s += key_mask[None, :]
    p = tl.math.exp2(s * LOG2E - lse[:, None])
    dp = _dot(do, v_t, None, PRECISION)
    return p * (dp * r[:, None] - delta[:, None])


@triton.jit
def _dq_key_block(
    dq, q, do, lse, r, delta, bias, masked,
    K_row, V_row, MASK, DB_row, b, s, offs_m, offs_n, offs_d, N, D,
    stride_kn, stride_vn, stride_mb, stride_ms, stride_mn, stride_dbi,
    sm_scale, n_rows,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE_DQ: tl.constexpr, STORE_DS: tl.constexpr,
):
    k_t = _load_tile(K_row, offs_n, offs_d, stride_kn, N, D, EVEN_N, PAD_D, True,
                     PRECISION > 0)
    ds = _ds_block(q, do, lse, r, delta, bias, masked, k_t, V_row, MASK, b, s,
                   offs_n, offs_d, N, D, stride_vn, stride_mb, stride_ms, stride_mn,
                   sm_scale, HAS_MASK, HAS_BIAS, COL_MASK, EVEN_N, PAD_D,
                   PRECISION)
    if STORE_DS:
        db_ptrs = DB_row + offs_m[:, None] * stride_dbi + offs_n[None, :]
        inside = (offs_m[:, None] < n_rows) & (offs_n[None, :] < N)
        tl.store(db_ptrs, _cast(ds, DB_row.dtype.element_ty), mask=inside)
    if COMPUTE_DQ:
        dq = _dot(_cast(ds, k_t.dtype), tl.trans(k_t), dq, PRECISION)
    return dq


@triton.jit
def _evoflash_bwd_dq_kernel(
    Q, K, V, DO, MASK, BIAS, LSE, RSCALE, DELTA, DQ, DBIAS, KRANGE,
    sm_scale,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_gb, stride_gs, stride_gn, stride_gh,
    stride_mb, stride_ms, stride_mn, stride_rb, stride_rs,
    stride_bb, stride_bs, stride_bh, stride_bi,
    stride_dbb, stride_dbs, stride_dbh, stride_dbi,
    S, N, H, D,
    N_BUCKET, S_BUCKET,  # autotuning key only
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_PER_S: tl.constexpr,
    MASK_RANGES: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_DQ: tl.constexpr, STORE_DS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S_GROUP: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, COL_MASK: tl.constexpr,
):
    tl.static_assert(S_GROUP <= 2)  # one or two S slices per program
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
    do0 = _load_tile(_row_ptr(DO, b, s0, h, stride_dob, stride_dos, stride_doh),
                     offs_m, offs_d, stride_don, N, D, EVEN_N, PAD_D, False,
                     PRECISION > 0)
    lse0 = _load_rowstat(_stat_ptr(LSE, b, s0, h, S, H, N), offs_m, N, float("inf"),
                          EVEN_N)
    r0 = _load_rowstat(_stat_ptr(RSCALE, b, s0, h, S, H, N), offs_m, N, 0.0, EVEN_N)
    delta0 = _load_rowstat(_stat_ptr(DELTA, b, s0, h, S, H, N), offs_m, N, 0.0,
                           EVEN_N)
    K0 = _row_ptr(K, b, s0, h, stride_kb, stride_ks, stride_kh)
    V0 = _row_ptr(V, b, s0, h, stride_vb, stride_vs, stride_vh)
    DB0 = _row_ptr(DBIAS, b, s0, h, stride_dbb, stride_dbs, stride_dbh)
    lo0, hi0 = _load_mask_range(KRANGE, b, s0, stride_rb, stride_rs, MASK_RANGES)
    dq0 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if S_GROUP == 2:
        s1 = tl.minimum(s0 + 1, S - 1)
        q1 = _load_tile(_row_ptr(Q, b, s1, h, stride_qb, stride_qs, stride_qh),
                        offs_m, offs_d, stride_qn, N, D, EVEN_N, PAD_D, False,
                        PRECISION > 0)
        do1 = _load_tile(_row_ptr(DO, b, s1, h, stride_dob, stride_dos, stride_doh),
                         offs_m, offs_d, stride_don, N, D, EVEN_N, PAD_D, False,
                         PRECISION > 0)
        lse1 = _load_rowstat(_stat_ptr(LSE, b, s1, h, S, H, N), offs_m, N,
                             float("inf"), EVEN_N)
        r1 = _load_rowstat(_stat_ptr(RSCALE, b, s1, h, S, H, N), offs_m, N, 0.0,
                           EVEN_N)
        delta1 = _load_rowstat(_stat_ptr(DELTA, b, s1, h, S, H, N), offs_m, N, 0.0,
                               EVEN_N)
        K1 = _row_ptr(K, b, s1, h, stride_kb, stride_ks, stride_kh)
        V1 = _row_ptr(V, b, s1, h, stride_vb, stride_vs, stride_vh)
        DB1 = _row_ptr(DBIAS, b, s1, h, stride_dbb, stride_dbs, stride_dbh)
        lo1, hi1 = _load_mask_range(KRANGE, b, s1, stride_rb, stride_rs, MASK_RANGES)
        dq1 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = _load_bias(BIAS, b, s0, h, offs_m, offs_n, N, stride_bb,
                                        stride_bs, stride_bh, stride_bi, EVEN_N)
        else:
            bias = 0.0
        dq0 = _dq_key_block(
            dq0, q0, do0, lse0, r0, delta0, bias,
            _key_block_masked(start_n, lo0, hi0, N, BLOCK_N, MASK_RANGES),
            K0, V0, MASK, DB0, b, s0,
            offs_m, offs_n, offs_d, N, D, stride_kn, stride_vn, stride_mb, stride_ms,
            stride_mn, stride_dbi, sm_scale, N, HAS_MASK, HAS_BIAS,
            COL_MASK, EVEN_N, PAD_D, PRECISION, COMPUTE_DQ, STORE_DS)
        if S_GROUP == 2:
            if BIAS_PER_S:
                bias = _load_bias(BIAS, b, s1, h, offs_m, offs_n, N,
                                            stride_bb, stride_bs, stride_bh,
                                            stride_bi, EVEN_N)
            dq1 = _dq_key_block(
                dq1, q1, do1, lse1, r1, delta1, bias,
                _key_block_masked(start_n, lo1, hi1, N, BLOCK_N, MASK_RANGES),
                K1, V1, MASK, DB1, b, s1,
                offs_m, offs_n, offs_d, N, D, stride_kn, stride_vn, stride_mb,
                stride_ms, stride_mn, stride_dbi, sm_scale,
                tl.where(s0 + 1 < S, N, 0),
                HAS_MASK, HAS_BIAS, COL_MASK, EVEN_N, PAD_D, PRECISION,
                COMPUTE_DQ, STORE_DS)

    if COMPUTE_DQ:
        g_ptrs = offs_m[:, None] * stride_gn + offs_d[None, :]
        g_mask = (offs_m[:, None] < N) & (offs_d[None, :] < D)
        DQ0 = _row_ptr(DQ, b, s0, h, stride_gb, stride_gs, stride_gh)
        tl.store(DQ0 + g_ptrs, _cast(dq0 * sm_scale, DQ.dtype.element_ty), mask=g_mask)
        if S_GROUP == 2:
            DQ1 = _row_ptr(DQ, b, s1, h, stride_gb, stride_gs, stride_gh)
            n1 = tl.where(s0 + 1 < S, N, 0)  # the slice past S is not stored
            tl.store(DQ1 + g_ptrs, _cast(dq1 * sm_scale, DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < n1) & (offs_d[None, :] < D))


@triton.jit
def _evoflash_bwd_dbias_kernel(
    Q, K, V, DO, MASK, BIAS, LSE, RSCALE, DELTA, DQ_ACC, DBIAS_PART, KRANGE,
    sm_scale,
    stride_qb, stride_qs, stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kn, stride_kh,
    stride_vb, stride_vs, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_don, stride_doh,
    stride_gb, stride_gs, stride_gn, stride_gh,
    stride_mb, stride_ms, stride_mn, stride_rb, stride_rs,
    stride_bb, stride_bh, stride_bi,
    stride_dbp, stride_dbb, stride_dbh, stride_dbi,
    B, S, N, H, D, S_CHUNK,
    N_BUCKET, S_BUCKET,  # autotuning key only
    HAS_MASK: tl.constexpr, MASK_RANGES: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, FUSE_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, PAD_D: tl.constexpr, COL_MASK: tl.constexpr,
):
    # Program order: key block fastest, then query block, head, batch, S chunk, so
    # the programs running together walk the same S slices and share their Q/K/V/dO
    # rows in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    n_blk = pid % num_n
    rest = pid // num_n
    m_blk = rest % num_m
    rest = rest // num_m
    h = rest % H
    rest = rest // H
    b = rest % B
    split = rest // B

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    zero = b * 0
    bias = _load_bias(BIAS, b, zero, h, offs_m, offs_n, N, stride_bb, 0,
                                stride_bh, stride_bi, EVEN_N)
    dbias = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s_lo = split * S_CHUNK
    s_hi = tl.minimum(S, s_lo + S_CHUNK)
    # each slice's mask range is loaded a slice ahead: its latency hides behind the
    # previous slice's work instead of stalling the branch on it
    lo, hi = _load_mask_range(KRANGE, b, s_lo + zero, stride_rb, stride_rs, MASK_RANGES)
    for s_idx in range(s_lo, s_hi):
        s = s_idx + zero  # a tensor under the interpreter too (int64 offsets)
        masked = _key_block_masked(n_blk * BLOCK_N, lo, hi, N, BLOCK_N,
                                   MASK_RANGES)
        lo, hi = _load_mask_range(KRANGE, b, tl.minimum(s + 1, S - 1),
                                  stride_rb, stride_rs, MASK_RANGES)
        q = _load_tile(_row_ptr(Q, b, s, h, stride_qb, stride_qs, stride_qh), offs_m,
                       offs_d, stride_qn, N, D, EVEN_N, PAD_D, False, PRECISION > 0)
        do = _load_tile(_row_ptr(DO, b, s, h, stride_dob, stride_dos, stride_doh),
                        offs_m, offs_d, stride_don, N, D, EVEN_N, PAD_D, False,
                        PRECISION > 0)
        k_t = _load_tile(_row_ptr(K, b, s, h, stride_kb, stride_ks, stride_kh),
                         offs_n, offs_d, stride_kn, N, D, EVEN_N, PAD_D, True,
                         PRECISION > 0)
        lse = _load_rowstat(_stat_ptr(LSE, b, s, h, S, H, N), offs_m, N,
                            float("inf"), EVEN_N)
        r = _load_rowstat(_stat_ptr(RSCALE, b, s, h, S, H, N), offs_m, N, 0.0, EVEN_N)
        delta = _load_rowstat(_stat_ptr(DELTA, b, s, h, S, H, N), offs_m, N, 0.0,
                              EVEN_N)
        ds = _ds_block(q, do, lse, r, delta, bias, masked, k_t,
                       _row_ptr(V, b, s, h, stride_vb, stride_vs, stride_vh), MASK,
                       b, s, offs_n, offs_d, N, D, stride_vn, stride_mb, stride_ms,
                       stride_mn, sm_scale, HAS_MASK, True, COL_MASK, EVEN_N,
                       PAD_D, PRECISION)
        dbias += ds
        if FUSE_DQ:
            dq = _dot(_cast(ds, k_t.dtype), tl.trans(k_t), None, PRECISION)
            dq = dq * sm_scale
            dq_ptrs = (_row_ptr(DQ_ACC, b, s, h, stride_gb, stride_gs, stride_gh)
                       + offs_m[:, None] * stride_gn + offs_d[None, :])
            tl.atomic_add(dq_ptrs, dq,
                          mask=(offs_m[:, None] < N) & (offs_d[None, :] < D),
                          sem="relaxed")

    db_ptrs = (DBIAS_PART + split.to(tl.int64) * stride_dbp
               + b.to(tl.int64) * stride_dbb + h.to(tl.int64) * stride_dbh
               + offs_m[:, None] * stride_dbi + offs_n[None, :])
    tl.store(db_ptrs, _cast(dbias, DBIAS_PART.dtype.element_ty),
             mask=(offs_m[:, None] < N) & (offs_n[None, :] < N))


@triton.jit
def _evoflash_bwd_dbias_sum_kernel(PART, OUT, SPLITS, NUMEL, BLOCK: tl.constexpr):
    """``OUT = sum_k PART[k]`` over the dbias kernel's S chunks ``PART [SPLITS,
    NUMEL]`` (fp32), in a fixed order, stored in ``OUT``'s dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < NUMEL
    ptrs = PART + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, SPLITS):
        acc += tl.load(ptrs, mask=inside, other=0.0)
        ptrs += NUMEL
    tl.store(OUT + offs, _cast(acc, OUT.dtype.element_ty), mask=inside)
