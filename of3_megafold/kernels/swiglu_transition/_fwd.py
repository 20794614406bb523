"""Forward kernel of the fused SwiGLU transition (private; see ``function.py``).

One program owns ``BLOCK_M`` rows. It normalises them in fp32 registers, then walks
the hidden dimension in chunks of ``BLOCK_H``::

    a = xn @ w_a[chunk].T ; b = xn @ w_b[chunk].T ; h = silu(a) * b
    acc += h @ w_out[:, chunk].T

so the ``[rows, n*c]`` hidden activations never reach global memory (the fused-MLP
schedule of flash-attention's ``fused_dense``/"FusedMLP", written here for
LayerNorm + SwiGLU). ``w_ab`` is ``w_a`` stacked on ``w_b`` (``[2H, c]``, rows
``[0, H)`` and ``[H, 2H)``). ``a`` and ``b`` come out of two independent dots with
the same left operand, each in the tensor cores' accumulator layout, so ``h`` is
formed element by element and feeds the next dot without a layout change
(interleaving the two weights into one ``2 BLOCK_H`` wide product and splitting it
costs warp shuffles and selects on every element, and as many again for the
backward's re-join: 690 against 505 SASS instructions per iteration of the
input-gradient kernel's main loop at 64 x 32 tiles). The weights are re-read from
L2 by every program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from of3_megafold.kernels._rounding import round_to
from of3_megafold.kernels.backend import interpreter_enabled


@triton.jit
def _sigmoid(a, FAST_SIGMOID: tl.constexpr):
    """fp32 logistic function.

    ``FAST_SIGMOID`` uses one ``tanh.approx.f32`` (one MUFU op instead of an exp and
    a reciprocal): sigmoid(a) = 0.5 + 0.5 * tanh(a / 2), absolute error <= ~2.5e-4,
    far below bf16/fp16 rounding; only enabled for 16-bit compute on a GPU. At c=128
    the three short-K matmuls per hidden element leave the special-function unit as
    busy as the tensor cores, so the second MUFU op would be on the critical path.
    """
    if FAST_SIGMOID:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;",
            "=f,f",
            [a * 0.5],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        s = 0.5 * t + 0.5
    else:
        s = 1.0 / (1.0 + tl.exp(-a))
    return s


# The Triton interpreter (TRITON_INTERPRET=1, used by the CPU tests) gets bf16 wrong
# in two ways (triton 3.9 ``runtime/interpreter.py``): ``create_dot`` multiplies the
# raw uint16 bit patterns, and fp32 -> bf16 conversion truncates instead of rounding
# to nearest even. With ``INTERPRETER`` set, ``_mm`` widens bf16 operands to fp32
# (exact); ``round_to`` (``.._rounding``) rounds as the GPU does.
@triton.jit
def _mm(a, b, acc, INPUT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """``tl.dot(a, b, acc)`` with fp32 accumulation."""
    if INTERPRETER and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _weight_tile_kn(W, hid, cols, h_ok, col_ok, C, EVEN: tl.constexpr):
    """``[BLOCK_C, BLOCK_H]`` tile ``W[hid, cols].T`` of a ``[H, C]`` weight (zeros
    outside), the K-major right operand of ``rows @ W[chunk].T``. ``EVEN``: the tile
    lies inside the weight, no bounds mask (fewer live registers)."""
    ptrs = W + hid[None, :] * C + cols[:, None]
    if EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_ok[:, None] & h_ok[None, :], other=0.0)
    return tile


@triton.jit
def _out_weight_tile_cn(W_OUT, hid, cols, h_ok, col_ok, H, EVEN: tl.constexpr):
    """``[BLOCK_C, BLOCK_H]`` tile ``W_OUT[cols, hid]`` of the ``[C, H]`` output
    weight (zeros outside)."""
    ptrs = W_OUT + cols[:, None] * H + hid[None, :]
    if EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_ok[:, None] & h_ok[None, :], other=0.0)
    return tile


def even_weights(args: dict) -> bool:
    """Heuristic shared by the kernels: weight tiles need no bounds mask."""
    return args["C"] == args["BLOCK_C"] and args["H"] % args["BLOCK_H"] == 0


def tuning_space(
    half: list[tuple[int, int, int, int]],
    single: list[tuple[int, int, int, int]],
    interpreter_block_h: int = 32,
) -> tuple[list[triton.Config], dict]:
    """``(configs, prune_configs_by)`` for ``triton.autotune`` from
    ``(BLOCK_M, BLOCK_H, num_warps, num_stages)`` tuples: ``half`` for 16-bit
    weights, ``single`` for fp32 ones (fp32 tiles need twice the shared memory and,
    without TF32, FMA matmuls; only small tiles fit). Under the interpreter: one
    small config, where timing means nothing."""
    if interpreter_enabled():
        small = triton.Config({"BLOCK_M": 32, "BLOCK_H": interpreter_block_h})
        return [small], {}

    def configs(entries):
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_H": bh}, num_warps=w, num_stages=s)
            for bm, bh, w, s in entries
        ]

    half_configs, single_configs = configs(half), configs(single)
    single_ids = {id(c) for c in single_configs}

    def prune(configs, named_args, **kwargs):
        # Triton 3.6 names only positional arguments in named_args, 3.9 all of them.
        fp32 = {**named_args, **kwargs}["W_AB"].dtype == torch.float32
        return [c for c in configs if (id(c) in single_ids) == fp32]

    return half_configs + single_configs, {"early_config_prune": prune}


# Every 16-bit entry compiles for sm_90 without register spills at c = 64; at
# c = 128 all but (128, 128) do (checked with triton 3.9's ptxas: the [BLOCK_M, c]
# fp32 accumulator and the normalised rows, held as the register operand of the
# first two matmuls, set the limit).
FWD_CONFIGS, FWD_PRUNE = tuning_space(
    half=[(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3),
          (128, 128, 8, 2)],
    single=[(64, 32, 4, 2), (64, 64, 8, 2)],
)  # fmt: skip


@triton.autotune(
    configs=FWD_CONFIGS,
    key=["C", "H", "NORMALIZE", "HAS_MASK"],
    prune_configs_by=FWD_PRUNE,
)
@triton.heuristics({"EVEN_WEIGHTS": even_weights})
@triton.jit
def _swiglu_transition_fwd_kernel(
    X,  # [M, C] input, row stride stride_x
    LN_W,  # [C] LayerNorm scale (unused unless NORMALIZE)
    LN_B,  # [C] LayerNorm offset
    W_AB,  # [2H, C] compute dtype: w_a (rows [0, H)) stacked on w_b
    W_OUT,  # [C, H]
    MASK,  # [M] row multiplier (unused unless HAS_MASK)
    Y,  # [M, C] output, row stride stride_y
    MEAN,  # [M] fp32, written when NORMALIZE
    RSTD,  # [M] fp32, written when NORMALIZE
    M,
    C,
    H,
    stride_x,
    stride_y,
    eps,
    NORMALIZE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FAST_SIGMOID: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_WEIGHTS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < M
    col_ok = cols < C
    rows64 = rows.to(tl.int64)
    io_mask = row_ok[:, None] & col_ok[None, :]

    x = tl.load(
        X + rows64[:, None] * stride_x + cols[None, :], mask=io_mask, other=0.0
    ).to(tl.float32)
    if NORMALIZE:
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / C + eps)
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        ln_w = tl.load(LN_W + cols, mask=col_ok, other=0.0).to(tl.float32)
        ln_b = tl.load(LN_B + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = xc * rstd[:, None] * ln_w[None, :] + ln_b[None, :]
    # OF3 rounds the LayerNorm output to the compute dtype before the matmuls.
    xn = round_to(x, W_AB.dtype.element_ty)

    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for k in range(0, H, BLOCK_H):
        hid = k + tl.arange(0, BLOCK_H)
        h_ok = hid < H
        w_a = _weight_tile_kn(W_AB, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
        w_b = _weight_tile_kn(W_AB + H * C, hid, cols, h_ok, col_ok, C, EVEN_WEIGHTS)
        a = _mm(xn, w_a, None, INPUT_PRECISION, INTERPRETER)
        b = _mm(xn, w_b, None, INPUT_PRECISION, INTERPRETER)
        h = round_to(a * _sigmoid(a, FAST_SIGMOID) * b, xn.dtype)
        w_out = _out_weight_tile_cn(W_OUT, hid, cols, h_ok, col_ok, H, EVEN_WEIGHTS)
        acc = _mm(h, tl.trans(w_out), acc, INPUT_PRECISION, INTERPRETER)

    if HAS_MASK:
        row_mask = tl.load(MASK + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * row_mask[:, None]
    tl.store(
        Y + rows64[:, None] * stride_y + cols[None, :],
        round_to(acc, Y.dtype.element_ty),
        mask=io_mask,
    )
