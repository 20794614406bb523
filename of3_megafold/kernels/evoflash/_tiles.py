"""Tile loads and the dot shared by the EvoFlash forward and backward kernels.

Conventions used by every kernel of the op:

* logits ``s = scale q.k + pair_bias + mask_bias`` are formed in natural units
  (one FMA and one add per element) and exponentiated as ``exp2(s * log2(e) - c)``
  with ``c`` a per-row constant kept in base 2: the ``log2(e)`` rides on that FMA,
  so the bias needs no scaling (flash-attention 2's trick for the softmax scale).
* keys past the end of the sequence get ``-inf`` through the column mask; rows past
  the end load zeros and are never stored.
* head dims that are not a power of two >= 16 are zero padded by masked loads.
* ``PRECISION``: 0 computes the dots in the input dtype (tf32 for fp32 inputs),
  1 upcasts every tile to fp32 and uses tf32 dots, 2 upcasts and uses 3xTF32 dots
  (each fp32 operand split into a tf32 high part and a tf32 residual, three
  tensor-core products: fp32 accuracy at tensor-core speed; see
  ``function.evoflash_attention``'s ``high_precision``).
"""

import triton
import triton.language as tl

from .._rounding import round_to as _cast  # noqa: F401 (the kernels' cast)
from ..backend import interpreter_enabled

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)


if interpreter_enabled():

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr):
        # The interpreter (Triton 3.9) multiplies bf16 bit patterns as integers.
        # Upcasting first computes what the tensor cores do: exact products of
        # the rounded inputs, accumulated in fp32.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc,
                      input_precision="ieee")

else:

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr):
        """``acc + a @ b``: 3xTF32 for ``PRECISION == 2``, else the tiles' own
        tensor-core precision (bf16/fp16, tf32 for fp32 tiles)."""
        if PRECISION == 2:
            out = tl.dot(a, b, acc, input_precision="tf32x3")
        else:
            out = tl.dot(a, b, acc)
        return out


@triton.jit
def _row_ptr(T, b, s, h, stride_b, stride_s, stride_h):
    """Pointer to ``T[b, s, 0, h, 0]`` (int64 offsets: tensors exceed 2**31)."""
    return (
        T
        + b.to(tl.int64) * stride_b
        + s.to(tl.int64) * stride_s
        + h.to(tl.int64) * stride_h
    )


@triton.jit
def _stat_ptr(T, b, s, h, S, H, N):
    """Pointer to row 0 of a contiguous ``[B, S, H, N]`` per-query statistic."""
    return T + ((b.to(tl.int64) * S + s) * H + h) * N


@triton.jit
def _load_tile(
    base,
    offs_r,
    offs_d,
    stride_r,
    N,
    D,
    EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    TO_FP32: tl.constexpr,
):
    """``[R, BLOCK_D]`` tile of sequence rows ``offs_r`` (``[BLOCK_D, R]`` if
    TRANSPOSED), zero outside ``N`` rows and ``D`` columns."""
    if TRANSPOSED:
        ptrs = base + offs_r[None, :] * stride_r + offs_d[:, None]
        inside = (offs_r[None, :] < N) & (offs_d[:, None] < D)
    else:
        ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :]
        inside = (offs_r[:, None] < N) & (offs_d[None, :] < D)
    # Nested constexpr ifs rather than `and`/`not`: portable across Triton versions.
    if EVEN_N:
        if PAD_D:  # noqa: SIM108 (constexpr branches)
            tile = tl.load(ptrs, mask=inside, other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=inside, other=0.0)
    if TO_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_rowstat(base, offs_r, N, other, EVEN_N: tl.constexpr):
    if EVEN_N:
        x = tl.load(base + offs_r)
    else:
        x = tl.load(base + offs_r, mask=offs_r < N, other=other)
    return x


@triton.jit
def _load_key_mask(
    MASK, b, s, offs_n, N, stride_mb, stride_ms, stride_mn,
    HAS_MASK: tl.constexpr, EVEN_N: tl.constexpr,
):
    """The key mask ``mask_bias[b, s, j]`` for keys ``offs_n`` in fp32, ``-inf``
    past N. Read in its own dtype; values below -2^29 (OF3's -1e9) are pinned to
    -2^30: like -1e9 in fp32 it swallows any logit below 32 in magnitude, so a query
    whose keys are all masked sees equal logits and uniform weights, as in OF3;
    being a power of two, its product with log2(e) is exact, so those logits stay
    equal whether the compiler fuses ``s * log2(e) - c`` into one FMA or not.
    Values below -2^31 (a second mask added to OF3's, as sequence parallelism does
    for padding keys, or -inf) are pinned to -2^32: next to a -2^30 key they weigh
    nothing, as in OF3's fp32 softmax, and a query whose keys are all there is
    uniform over them."""
    if HAS_MASK:
        ptrs = (
            MASK
            + b.to(tl.int64) * stride_mb
            + s.to(tl.int64) * stride_ms
            + offs_n * stride_mn
        )
        if EVEN_N:
            m = tl.load(ptrs).to(tl.float32)
        else:
            m = tl.load(ptrs, mask=offs_n < N, other=0.0).to(tl.float32)
        pinned = tl.where(m < -2147483648.0, -4294967296.0, -1073741824.0)
        m = tl.where(m < -536870912.0, pinned, m)
        if not EVEN_N:
            m = tl.where(offs_n < N, m, float("-inf"))
    else:
        m = tl.where(offs_n < N, 0.0, float("-inf"))
    return m


@triton.jit
def _load_mask_range(KRANGE, b, s, stride_rb, stride_rs, MASK_RANGES: tl.constexpr):
    """``(lo, hi)``: keys ``[lo, hi)`` hold every nonzero value of slice ``(b, s)``'s
    key mask, read from ``KRANGE``, the int32 ``[B, S, 2]`` that
    ``_evoflash_mask_range_kernel`` writes. Without ``MASK_RANGES`` (no mask, or
    no ranges computed) nothing is read: ``_key_block_masked`` ignores them then."""
    if MASK_RANGES:
        ptr = KRANGE + b.to(tl.int64) * stride_rb + s.to(tl.int64) * stride_rs
        lo = tl.load(ptr)
        hi = tl.load(ptr + 1)
    else:
        lo = 0
        hi = 0
    return lo, hi


@triton.jit
def _key_block_masked(start_n, lo, hi, N, BLOCK_N: tl.constexpr,
                      MASK_RANGES: tl.constexpr):
    """Whether the keys ``[start_n, start_n + BLOCK_N)`` need the column mask: the
    block runs past N, or it overlaps the slice's nonzero mask range ``[lo, hi)``.
    Elsewhere the key mask is all zeros and its load and add are skipped (a block-
    uniform branch): per logit they were about two of the kernels' 11-18
    instructions (docs/benchmarks.md). Without ``MASK_RANGES`` a constant True, so
    no branch is compiled (an always-taken one cost the forward and dQ kernels
    12-16% at triangle N=384 on the H200)."""
    if MASK_RANGES:
        end = start_n + BLOCK_N
        masked = (end > N) | ((start_n < hi) & (end > lo))
    else:
        masked = True
    return masked


@triton.jit
def _load_bias(
    BIAS, b, s, h, offs_i, offs_j, N,
    stride_bb, stride_bs, stride_bh, stride_bi,
    EVEN_N: tl.constexpr,
):
    """``pair_bias[b, s, h, i, j]`` (fp32) as an ``[I, J]`` tile, zero outside the
    N x N square. The j stride is 1."""
    base = (
        BIAS
        + b.to(tl.int64) * stride_bb
        + s.to(tl.int64) * stride_bs
        + h.to(tl.int64) * stride_bh
    )
    ptrs = base + offs_i[:, None] * stride_bi + offs_j[None, :]
    if EVEN_N:  # noqa: SIM108
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(offs_i[:, None] < N) & (offs_j[None, :] < N),
                       other=0.0)
    return tile.to(tl.float32)
