"""Launchers, autograd function and functional API of the fused triangle
multiplicative update.

``triangle_multiplication(z, mask, <OF3's parameters>, outgoing)`` computes OF3's
``TriangleMultiplicativeUpdate`` (reference: :mod:`.reference`) for a 16-bit ``z`` as

1. ``x = LN_in(z)`` (the kit's LayerNorm kernel) and one GEMM of ``x`` with the five
   projections' weights stacked, ``[B R, 4 C_h + C_z]``;
2. ``_gate_fwd_kernel``: ``a`` and ``b`` gated and masked, written channel-major
   ``[B, C_h, N, N]``, the layout of
3. one batched GEMM per direction (cuBLAS), ``p = a b^T`` or ``a^T b`` per channel;
4. ``_out_fwd_kernel``: ``LN_out(p) W_z^T`` and the output gate in one pass.

OF3's module makes a copy for every permute, gate, mask product and LayerNorm round
trip, and keeps most of them for its backward. This forward keeps ``z``, the input
LayerNorm's fp32 statistics and ``p``; the backward recomputes ``x``, the
projections and ``a``/``b`` (one LayerNorm, one GEMM and one elementwise pass) and
writes the projections' gradients over the recomputed projections.

On a shard of ``z`` (sequence parallelism: rows ``[*, N/P, N, C_z]`` for the
outgoing update, columns ``[*, N, N/P, C_z]`` for the incoming one) the same
kernels run on the local positions, and a :class:`ShardExchange` completes the one
operand the product needs whole (``b`` outgoing, ``a`` incoming) between steps 2
and 3; the backward gathers it again and sums its gradient back onto the shards.
Every collective is launched before compute that does not need it:

- forward: the operand's all-gather is in flight while the block of ``p`` that
  this rank's own slice of it gives is computed; then one block per other rank;
- backward: the all-gather is in flight while the gathered operand's gradient,
  which needs local tensors only, is computed; that gradient's reduce-scatter is
  in flight while the other operand's gradient, which needs the gathered one, is.

Each block and each gradient is the GEMM of the unsharded path over the same
contraction, so the values do not depend on the overlap. The kernels themselves
know nothing of the shards or of ``torch.distributed``.
"""

from __future__ import annotations

import logging
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from of3_megafold.kernels._launch import TunedKernel
from of3_megafold.kernels.backend import (
    cdiv,
    interpreter_enabled,
    multiprocessors,
    next_power_of_2,
    runs_on,
)
from of3_megafold.kernels.layer_norm.function import layer_norm_bwd, layer_norm_fwd
from of3_megafold.kernels.triangle_multiplication._kernels import (
    _gate_bwd_kernel,
    _gate_fwd_kernel,
    _out_bwd_kernel,
    _out_fwd_kernel,
)
from of3_megafold.kernels.triangle_multiplication.reference import (
    triangle_multiplication_reference,
)

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)
# The output kernels hold a [C_h, C_z] tile of W_z in registers (OF3: 128 x 128 in
# the pair stacks, 64 x 64 in the template stack).
MAX_CHANNELS = 128

_gate_fwd = TunedKernel(_gate_fwd_kernel)
_gate_bwd = TunedKernel(_gate_bwd_kernel)
_out_fwd = TunedKernel(_out_fwd_kernel)
_out_bwd = TunedKernel(_out_bwd_kernel)

T = TypeVar("T", covariant=True)


class Launched(Protocol[T]):
    """A collective in flight; :meth:`wait` completes it (on a GPU: orders the
    current stream after it) and returns its result."""

    def wait(self) -> T: ...


class ShardExchange(Protocol):
    """The collectives of a sharded update, launched asynchronously, along dim 0
    of single tensors: a gathered operand needs no concatenation, a summed gradient
    no chunk copies (``of3_megafold.parallel.comm.GroupExchange`` is one for a
    sequence-parallel group of ``size`` ranks, of which this process is
    ``rank``)."""

    rank: int
    size: int

    def start_gather(self, t: torch.Tensor) -> Launched[torch.Tensor]:
        """Every rank's ``t`` (``[m, ...]``, contiguous, the same shape on every
        rank) stacked in rank order: ``[size m, ...]``."""
        ...

    def start_reduce_scatter(self, t: torch.Tensor) -> Launched[torch.Tensor]:
        """The sum over ranks of ``t`` (``[size m, ...]``, contiguous), this rank's
        slice ``[m, ...]`` of dim 0."""
        ...


def _gate_blocks(ch: int) -> dict:
    """Block sizes of the gate kernels (one program per ``BLOCK_R`` positions by
    ``BLOCK_C`` channels). The H200 sweep found nothing faster than 64 rows and 4
    warps; at N=768 both kernels run near the memory bound."""
    return {"BLOCK_R": 16 if interpreter_enabled() else 64,
            "BLOCK_C": min(64, max(16, next_power_of_2(ch))), "num_warps": 4}


def _gate_launch(r: int, ch: int, batch: int) -> tuple[tuple[int, int, int], dict]:
    """``(grid, meta)`` of a gate kernel over ``batch`` items of ``r`` positions."""
    blocks = _gate_blocks(ch)
    return (cdiv(r, blocks["BLOCK_R"]), cdiv(ch, blocks["BLOCK_C"]), batch), blocks


def _out_blocks(ch: int, cz: int, backward: bool) -> dict:
    """Block sizes of the persistent output kernels: ``BLOCK_R`` positions by every
    channel. On the H200 at C = 128 (``tools/gpu_sweep_triangle_multiplication.py``,
    N = 768 and 1024) 64 rows
    and 2 stages were fastest for both, with 2 programs per SM for the forward
    (0.225 ms at N=768) and 8 for the backward (1.43 ms; one program per tile: 1.53)."""
    block_ch, block_cz = max(16, next_power_of_2(ch)), max(16, next_power_of_2(cz))
    return {"BLOCK_R": 16 if interpreter_enabled() else 64, "BLOCK_CH": block_ch,
            "BLOCK_CZ": block_cz, "NUM_STAGES": 2, "num_warps": 4,
            "PROGRAMS_PER_SM": 8 if backward else 2}


def _out_launch(blocks: dict, r: int, batch: int, device: torch.device):
    """``(grid, tiles, meta)`` of a persistent output kernel: at most
    ``PROGRAMS_PER_SM`` programs per SM (4 under the interpreter, so that small
    tests walk several tiles per program)."""
    meta = dict(blocks)
    per_sm = meta.pop("PROGRAMS_PER_SM")
    tiles = cdiv(r, meta["BLOCK_R"]) * batch
    slots = (4 if interpreter_enabled() or device.type != "cuda"
             else per_sm * multiprocessors(device.index))
    return (max(1, min(tiles, slots)),), tiles, meta


def gate_fwd(
    proj: torch.Tensor,
    mask: torch.Tensor | None,
    batch: int,
    positions: tuple[int, int],
    ch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a``, ``b`` ``[batch, ch, n_i, n_j]`` from ``proj`` ``[batch n_i n_j, 4 ch +
    c_z]`` and ``mask`` ``[batch n_i n_j]`` (or ``None``); ``positions`` is
    ``(n_i, n_j)``."""
    r = positions[0] * positions[1]
    a_t = proj.new_empty((batch, ch, *positions))
    b_t = torch.empty_like(a_t)
    grid, blocks = _gate_launch(r, ch, batch)
    _gate_fwd[grid](
        proj, mask if mask is not None else proj, a_t, b_t, r, ch, proj.stride(0),
        HAS_MASK=mask is not None, **blocks,
    )
    return a_t, b_t


def gate_bwd(
    proj: torch.Tensor,
    mask: torch.Tensor | None,
    da_t: torch.Tensor,
    db_t: torch.Tensor,
    ch: int,
) -> None:
    """Overwrite ``proj``'s ``a_p | a_g | b_p | b_g`` slots with their gradients,
    given ``dA``/``dB`` ``[batch, ch, n_i, n_j]``."""
    batch, _, n_i, n_j = da_t.shape
    r = n_i * n_j
    grid, blocks = _gate_launch(r, ch, batch)
    _gate_bwd[grid](
        proj, mask if mask is not None else proj, da_t, db_t, r, ch, proj.stride(0),
        HAS_MASK=mask is not None, **blocks,
    )


def out_fwd(
    p: torch.Tensor,
    proj: torch.Tensor,
    ln_w: torch.Tensor,
    ln_b: torch.Tensor,
    w_z: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``(LN_out(p) W_z^T) sigmoid(g)``, ``[batch n_i n_j, c_z]``, from ``p``
    ``[batch, ch, n_i, n_j]`` and the gate's columns of ``proj`` ``[batch n_i n_j,
    4 ch + c_z]``."""
    batch, ch, n_i, n_j = p.shape
    cz = w_z.shape[0]
    r = n_i * n_j
    out = p.new_empty((batch * r, cz))
    grid, tiles, meta = _out_launch(_out_blocks(ch, cz, False), r, batch, p.device)
    _out_fwd[grid](
        p, proj, ln_w, ln_b, w_z, out, r, ch, cz, proj.stride(0), eps, tiles, **meta,
    )
    return out


def out_bwd(
    dout: torch.Tensor,
    p: torch.Tensor,
    proj: torch.Tensor,
    ln_w: torch.Tensor,
    ln_b: torch.Tensor,
    w_z: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`out_fwd`: writes ``d(g)`` over ``proj``'s gate columns;
    returns ``dP`` (``p``'s layout), ``dW_z`` and the fp32 LayerNorm weight and bias
    gradients."""
    batch, ch, n_i, n_j = p.shape
    cz = w_z.shape[0]
    r = n_i * n_j
    grid, tiles, meta = _out_launch(_out_blocks(ch, cz, True), r, batch, p.device)
    dp = torch.empty_like(p)
    dy = p.new_empty((batch * r, cz))
    ln = p.new_empty((batch * r, ch))
    part = torch.empty((2, grid[0], ch), dtype=torch.float32, device=p.device)
    _out_bwd[grid](
        p, proj, ln_w, ln_b, w_z, dout, dp, dy, ln, part[0], part[1],
        r, ch, cz, proj.stride(0), eps, tiles, **meta,
    )
    dw_z = dy.t() @ ln
    sums = part.sum(dim=1)  # over programs, in a fixed order
    return dp, dw_z, sums[0], sums[1]


def _bmm_operands(t: torch.Tensor) -> torch.Tensor:
    batch, ch, n_i, n_j = t.shape
    return t.view(batch * ch, n_i, n_j)


def _channels(t3: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A batched GEMM's ``[batch ch, n_i, n_j]`` result as ``[batch, ch, n_i, n_j]``."""
    return t3.view(*like.shape[:2], *t3.shape[1:])


def _product(a_t, b_t, outgoing):
    """``p = a b^T`` (outgoing) or ``a^T b`` (incoming), per channel. On a shard
    the whole operand is ``[*, N, N]`` and the other ``[*, N/P, N]`` (outgoing) or
    ``[*, N, N/P]`` (incoming); ``p`` has the shard's shape."""
    a3, b3 = _bmm_operands(a_t), _bmm_operands(b_t)
    p = a3 @ b3.transpose(1, 2) if outgoing else a3.transpose(1, 2) @ b3
    return _channels(p, a_t)


def _product_grads(dp, a_t, b_t, outgoing):
    """``(dA, dB)`` of :func:`_product`, each shaped like its operand."""
    dp3, a3, b3 = _bmm_operands(dp), _bmm_operands(a_t), _bmm_operands(b_t)
    if outgoing:
        da, db = dp3 @ b3, dp3.transpose(1, 2) @ a3
    else:
        da, db = b3 @ dp3.transpose(1, 2), a3 @ dp3
    return _channels(da, a_t), _channels(db, a_t)


def _gathered_rows(a3, b3, outgoing):
    """This shard's slice of the operand the product needs whole, as ``[batch ch,
    n, N]`` rows: ``b`` (outgoing) or ``a^T`` (incoming)."""
    return b3 if outgoing else a3.transpose(1, 2)


def _rows_of(gathered, rank, n):
    """Rank ``rank``'s ``[batch ch, n, N]`` rows of a gathered ``[P n, batch ch,
    N]`` operand (a strided view that cuBLAS takes as it is)."""
    return gathered[rank * n:(rank + 1) * n].transpose(0, 1)


def _sharded_product(a_t, b_t, outgoing, exchange):
    """:func:`_product` of a shard's ``a`` and ``b`` (both ``[batch, ch, n_i,
    n_j]``), the whole operand gathered with ``exchange`` while this rank's own
    block of ``p`` is computed. The operand travels position-major (``[n, batch
    ch, N]``), so the gathered ``[P n, batch ch, N]`` is the whole operand without
    a concatenation. Its rows from rank ``r`` give ``p``'s columns (outgoing) or
    rows (incoming) ``r n .. (r + 1) n``, each the full contraction, so the blocks
    are the unsharded GEMM's values."""
    a3, b3 = _bmm_operands(a_t), _bmm_operands(b_t)
    own = _gathered_rows(a3, b3, outgoing)
    n = own.shape[1]
    pending = exchange.start_gather(own.transpose(0, 1).contiguous())
    p = torch.empty_like(a_t)
    p3 = _bmm_operands(p)

    def block(rank, rows):  # rows: [batch ch, n, N]
        if outgoing:
            torch.bmm(a3, rows.transpose(1, 2), out=p3.narrow(2, rank * n, n))
        else:
            torch.bmm(rows, b3, out=p3.narrow(1, rank * n, n))

    block(exchange.rank, own)
    gathered = pending.wait()
    for rank in range(exchange.size):
        if rank != exchange.rank:
            block(rank, _rows_of(gathered, rank, n))
    return p


def _sharded_product_grads(dp, a_t, b_t, outgoing, exchange):
    """:func:`_product_grads` on a shard: the gathered operand's gradient (local
    tensors only) is computed while the operand's all-gather is in flight, and the
    other operand's gradient (the gathered operand's) while the first one's
    reduce-scatter is. The first is written rank-major, ``[P, batch ch, ...]``
    with block ``r`` the part that rank ``r`` owns, so the reduce-scatter takes it
    as it is: at most two whole-operand buffers (the gathered operand and that
    gradient) are alive at once."""
    dp3, a3, b3 = _bmm_operands(dp), _bmm_operands(a_t), _bmm_operands(b_t)
    own = _gathered_rows(a3, b3, outgoing)
    size, n = exchange.size, own.shape[1]
    pending = exchange.start_gather(own.transpose(0, 1).contiguous())
    d_whole = b3.new_empty((size, *b3.shape))  # each block shaped like the shard's
    for rank in range(size):
        if outgoing:  # rows r n .. of d(b) = dp^T a
            dp_r = dp3.narrow(2, rank * n, n)
            torch.bmm(dp_r.transpose(1, 2), a3, out=d_whole[rank])
        else:  # columns r n .. of d(a) = b dp^T
            dp_r = dp3.narrow(1, rank * n, n)
            torch.bmm(b3, dp_r.transpose(1, 2), out=d_whole[rank])
    summed = exchange.start_reduce_scatter(d_whole.flatten(0, 1))
    del d_whole
    gathered = pending.wait()  # [P n, batch ch, N]
    if outgoing:  # d(a) = dp b, with b = gathered^T per channel
        d_other = torch.bmm(dp3, gathered.transpose(0, 1))
    else:  # d(b) = a dp, with a = gathered permuted per channel
        d_other = torch.bmm(gathered.permute(1, 2, 0), dp3)
    del gathered
    d_other, d_gathered = _channels(d_other, a_t), _channels(summed.wait(), a_t)
    return (d_other, d_gathered) if outgoing else (d_gathered, d_other)


class TriangleMultiplicationFunction(torch.autograd.Function):
    """Autograd function behind :func:`triangle_multiplication`.

    ``apply(z, mask, ln_in_w, ln_in_b, w_in, ln_out_w, ln_out_b, w_z, outgoing,
    eps, exchange)`` with ``w_in`` the stacked ``[4 C_h + C_z, C_z]`` projection
    weights in ``z``'s dtype, ``mask`` ``[B n_i n_j]`` or ``None`` and ``exchange``
    a :class:`ShardExchange` for a shard of ``z`` (``None``: ``z`` whole). Saves
    ``z``, ``p`` and the input LayerNorm's statistics (see the module docstring).
    """

    @staticmethod
    def forward(ctx, z, mask, ln_in_w, ln_in_b, w_in, ln_out_w, ln_out_b, w_z,
                outgoing, eps, exchange):
        *lead, n_i, n_j, cz = z.shape
        batch = int(torch.Size(lead).numel())
        ch = w_z.shape[1]
        z2 = z.reshape(-1, cz)
        if not z2.is_contiguous():
            z2 = z2.contiguous()
        x, mean, rstd = layer_norm_fwd(z2, ln_in_w, ln_in_b, eps)
        proj = F.linear(x, w_in)
        del x
        a_t, b_t = gate_fwd(proj, mask, batch, (n_i, n_j), ch)
        if exchange is None:
            p = _product(a_t, b_t, outgoing)
        else:
            p = _sharded_product(a_t, b_t, outgoing, exchange)
        del a_t, b_t
        out = out_fwd(p, proj, ln_out_w, ln_out_b, w_z, eps)
        ctx.save_for_backward(z2, mask, ln_in_w, ln_in_b, w_in, ln_out_w, ln_out_b,
                              w_z, mean, rstd, p)
        ctx.outgoing, ctx.eps, ctx.shape = outgoing, eps, z.shape
        ctx.exchange = exchange
        return out.view(z.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        (z2, mask, ln_in_w, ln_in_b, w_in, ln_out_w, ln_out_b, w_z, mean, rstd,
         p) = ctx.saved_tensors
        batch, ch = p.shape[:2]
        need = ctx.needs_input_grad
        x, _, _ = layer_norm_fwd(z2, ln_in_w, ln_in_b, ctx.eps)
        proj = F.linear(x, w_in)
        dout2 = dout.reshape(-1, dout.shape[-1])
        if not dout2.is_contiguous():
            dout2 = dout2.contiguous()
        # writes d(g) over proj's g slot, which out_fwd's recompute no longer needs
        dp, dw_z, dln_out_w, dln_out_b = out_bwd(
            dout2, p, proj, ln_out_w, ln_out_b, w_z, ctx.eps
        )
        outgoing, exchange = ctx.outgoing, ctx.exchange
        a_t, b_t = gate_fwd(proj, mask, batch, ctx.shape[-3:-1], ch)
        if exchange is None:
            da_t, db_t = _product_grads(dp, a_t, b_t, outgoing)
        else:
            da_t, db_t = _sharded_product_grads(dp, a_t, b_t, outgoing, exchange)
        del a_t, b_t, dp
        gate_bwd(proj, mask, da_t, db_t, ch)  # proj now holds d(proj)
        del da_t, db_t
        dw_in = proj.t() @ x if need[4] else None
        dz = dln_in_w = dln_in_b = None
        if need[0] or need[2] or need[3]:
            dx = proj @ w_in
            dz, dln_in_w, dln_in_b = layer_norm_bwd(
                dx, z2, ln_in_w, mean, rstd, need_dwb=need[2] or need[3]
            )
            dz = dz.view(ctx.shape) if need[0] else None
        return (
            dz, None,
            _as(dln_in_w, ln_in_w, need[2]), _as(dln_in_b, ln_in_b, need[3]),
            dw_in,
            _as(dln_out_w, ln_out_w, need[5]), _as(dln_out_b, ln_out_b, need[6]),
            _as(dw_z, w_z, need[7]),
            None, None, None,
        )


def _as(grad, like, needed):
    return grad.to(like.dtype) if needed and grad is not None else None


def supports(
    z: torch.Tensor, c_hidden: int, shard: bool = False
) -> tuple[bool, str]:
    """Whether the fused path takes ``z`` (``(ok, why not)``): 16-bit, ``z``'s dtype
    equal to the compute dtype (autocast's, inside autocast), square ``[*, N, N,
    C_z]`` (any ``[*, n_i, n_j, C_z]`` for a ``shard``), channels at most
    ``MAX_CHANNELS``, on a device the kernels run on."""
    if z.dtype not in DTYPES:
        return False, f"dtype {z.dtype}"
    if torch.is_autocast_enabled(z.device.type):
        autocast_dtype = torch.get_autocast_dtype(z.device.type)
        if autocast_dtype != z.dtype:
            return False, f"{z.dtype} input under {autocast_dtype} autocast"
    if z.dim() < 3 or (z.shape[-2] != z.shape[-3] and not shard) or z.numel() == 0:
        return False, f"shape {tuple(z.shape)}"
    if max(z.shape[-1], c_hidden) > MAX_CHANNELS:
        return False, f"channels {z.shape[-1]}/{c_hidden} > {MAX_CHANNELS}"
    if not runs_on(z):
        return False, f"tensor on {z.device} and the Triton interpreter is off"
    return True, ""


def triangle_multiplication(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    ln_in_weight: torch.Tensor,
    ln_in_bias: torch.Tensor,
    w_a_p: torch.Tensor,
    w_a_g: torch.Tensor,
    w_b_p: torch.Tensor,
    w_b_g: torch.Tensor,
    w_g: torch.Tensor,
    ln_out_weight: torch.Tensor,
    ln_out_bias: torch.Tensor,
    w_z: torch.Tensor,
    outgoing: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """OF3's triangle multiplicative update, fused (see the module docstring).

    Args:
        z: ``[*, N, N, C_z]``, bf16 or fp16.
        mask: ``[*, N, N]`` (broadcastable) or ``None``; no gradient flows to it.
        ln_in_weight, ln_in_bias: ``[C_z]``, OF3's ``layer_norm_in``.
        w_a_p, w_a_g, w_b_p, w_b_g: ``[C_h, C_z]``, OF3's ``linear_{a,b}_{p,g}``
            weights (bias-free, as in OF3's config).
        w_g: ``[C_z, C_z]``, ``linear_g``; w_z: ``[C_z, C_h]``, ``linear_z``.
        ln_out_weight, ln_out_bias: ``[C_h]``, OF3's ``layer_norm_out``.
        outgoing: ``TriangleMultiplicationOutgoing`` (``True``) or ``Incoming``.
        eps: both LayerNorms' epsilon.

    Returns:
        ``[*, N, N, C_z]`` in ``z``'s dtype. Statistics, gates and GEMM accumulation
        in fp32; ``LN_in(z)``, the gated ``a``/``b`` and their product are rounded to
        ``z``'s dtype, as in OF3 under autocast. Parameter gradients come back in
        the parameters' dtypes.

    Falls back to :func:`triangle_multiplication_reference` (OF3's math) where
    :func:`supports` says no.
    """
    ch = w_z.shape[1]
    ok, why = supports(z, ch)
    if not ok:
        logger.debug("triangle_multiplication: torch path (%s)", why)
        return triangle_multiplication_reference(
            z, mask, ln_in_weight, ln_in_bias, w_a_p, w_a_g, w_b_p, w_b_g, w_g,
            ln_out_weight, ln_out_bias, w_z, outgoing, eps,
        )
    return fused_triangle_multiplication(
        z, mask, ln_in_weight, ln_in_bias, w_a_p, w_a_g, w_b_p, w_b_g, w_g,
        ln_out_weight, ln_out_bias, w_z, outgoing, eps,
    )


def fused_triangle_multiplication(
    z, mask, ln_in_weight, ln_in_bias, w_a_p, w_a_g, w_b_p, w_b_g, w_g,
    ln_out_weight, ln_out_bias, w_z, outgoing: bool = True, eps: float = 1e-5,
    exchange: ShardExchange | None = None,
) -> torch.Tensor:
    """:func:`triangle_multiplication` on the kernels, for a caller that has
    already checked :func:`supports` (OF3's patched module): no check, no
    fallback. With ``exchange``, ``z`` and ``mask`` are this rank's shard (rows
    for the outgoing update, columns for the incoming one) and so is the result
    (see the module docstring)."""
    w_in = torch.cat([w_a_p, w_a_g, w_b_p, w_b_g, w_g]).to(z.dtype)
    mask1d = None
    if mask is not None:
        mask1d = mask.expand(z.shape[:-1]).reshape(-1)
        mask1d = (mask1d if mask1d.is_floating_point() else mask1d.float()).contiguous()
    return TriangleMultiplicationFunction.apply(
        z, mask1d, ln_in_weight, ln_in_bias, w_in, ln_out_weight, ln_out_bias,
        w_z.to(z.dtype), outgoing, eps, exchange,
    )
