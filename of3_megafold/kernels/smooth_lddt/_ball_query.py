"""Ball query on the ground truth: up to K in-radius neighbours per atom, sampled.

For every atom i in the loss mask, the neighbours are the atoms j != i in the mask with
``sqrt(eps + |t_i - t_j|^2) < r_i``, where ``r_i`` is 30 A for nucleotide atoms and 15 A
otherwise: exactly the pairs with ``c_ij m_ij = 1`` in smooth lDDT. When more than K
qualify, a uniform random K-subset is kept by reservoir sampling (Vitter's
Algorithm R) made parallel:

* candidates of row i get ranks ``t = 0, 1, ...`` in scan order (a prefix sum per tile);
* candidate ``t < K`` goes to slot ``t``; candidate ``t >= K`` draws ``r`` uniform in
  ``[0, t]`` from a counter-based hash of ``(seed, batch, i, t)`` and, if ``r < K``,
  claims slot ``r``;
* Algorithm R keeps in each slot the *last* candidate that claimed it, so each slot
  takes the maximum of ``(t << 32) | j`` over its claimants (``atomic_max``: the result
  does not depend on the order in which the claims land, so it is deterministic).

The result is the sample Algorithm R draws for that scan order and random stream: every
K-subset equally likely, given a perfect hash. The hash is Chris Wellons' ``lowbias32``
integer finaliser (public domain, hash-prospector), applied twice; ``r`` comes from a
32x32->64-bit multiply-high, biased by at most ``(t + 1) / 2^32``.

The scan visits only block pairs that can hold a neighbour (Morton sort and bounding
boxes, ``_spatial.py``). One program owns a row block and everything about its rows:
it lists the block's tiles, empties the rows' int64 slots, scans, and writes the low
words of the claimed slots (the neighbour indices) as the int32 lists, all in one
launch. One search serves every sample: the ground truth is shared over the sample
dimension. Outputs are integer tensors and carry no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from of3_megafold.kernels.backend import on_device

from ._spatial import SpatialPlan, list_row_block_tiles, make_plan, tile_chunk
from .reference import per_atom_inputs

SEARCH_BLOCK_ROWS = 64
SEARCH_BLOCK_COLS = 32
# 64 x 32 tiles: 8 warps keep 8 pairs per thread, well inside the register budget.
SEARCH_NUM_WARPS = 8
# Slots per row a program empties / converts at once (64 x 64 int64: 16 per thread).
SEARCH_BLOCK_K = 64


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit(do_not_specialize=["seed"])
def _ball_query_kernel(
    t_ptr,  # [B, 3, N] fp32, sorted order
    r_ptr,  # [B, N] fp32 inclusion radius of the row atom, 0 = masked out
    perm_ptr,  # [B, N] int32, sorted position -> original index
    box_ptr,  # [B, NCB, 8] fp32 column block boxes
    tiles_ptr,  # [B, NRB, NCB] int32 scratch: this row block's tile list
    slot_ptr,  # [B, N, K] int64 scratch, original row order
    nbr_ptr,  # [B, N, K] int32 out, original row order
    count_ptr,  # [B, N] int32 out, original order
    N,
    NRB,
    NCB,
    K,
    seed,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rb = tl.program_id(0)
    b = tl.program_id(1)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    t_base = t_ptr + b.to(tl.int64) * 3 * N
    ti0 = tl.load(t_base + rows, mask=row_ok, other=0.0)
    ti1 = tl.load(t_base + N + rows, mask=row_ok, other=0.0)
    ti2 = tl.load(t_base + 2 * N + rows, mask=row_ok, other=0.0)
    ri = tl.load(r_ptr + b * N + rows, mask=row_ok, other=0.0)
    ri2 = ri * ri
    orig_i = tl.load(perm_ptr + b * N + rows, mask=row_ok, other=0)

    # This program alone writes its rows' slots: empty them (the claims below take
    # the maximum with what is there) and list the row block's tiles. Other threads
    # of the program read both, hence the barrier.
    slot_row = slot_ptr + (b * N + orig_i).to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        empty = tl.full([BLOCK_M, BLOCK_K], -1, tl.int64)
        in_row = row_ok[:, None] & (ks[None, :] < K)
        tl.store(slot_row[:, None] + ks[None, :], empty, mask=in_row)
    tile_row = tiles_ptr + (b * NRB + rb).to(tl.int64) * NCB
    n_tiles = list_row_block_tiles(
        box_ptr, tile_row, b, rb, NCB, BLOCK_M // BLOCK_N, False, CHUNK
    )
    tl.debug_barrier()

    stream = _lowbias32(seed.to(tl.uint32) ^ (b.to(tl.uint32) * 0x9E3779B9))
    row_key = _lowbias32(stream + orig_i.to(tl.uint32))
    count = tl.zeros([BLOCK_M], dtype=tl.int32)
    for q in range(0, n_tiles):
        cb = tl.load(tile_row + q)
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        tj0 = tl.load(t_base + cols, mask=col_ok, other=0.0)
        tj1 = tl.load(t_base + N + cols, mask=col_ok, other=0.0)
        tj2 = tl.load(t_base + 2 * N + cols, mask=col_ok, other=0.0)
        rj = tl.load(r_ptr + b * N + cols, mask=col_ok, other=0.0)
        orig_j = tl.load(perm_ptr + b * N + cols, mask=col_ok, other=0)

        u0 = ti0[:, None] - tj0[None, :]
        u1 = ti1[:, None] - tj1[None, :]
        u2 = ti2[:, None] - tj2[None, :]
        dg2 = u0 * u0 + u1 * u1 + u2 * u2 + eps
        hit = (
            (dg2 < ri2[:, None])
            & (rj[None, :] > 0.0)
            & (rows[:, None] != cols[None, :])
        )
        hit_i = hit.to(tl.int32)
        rank = count[:, None] + tl.cumsum(hit_i, axis=1) - hit_i
        count += tl.sum(hit_i, axis=1)

        draw = _lowbias32(row_key[:, None] ^ (rank.to(tl.uint32) * 0x85EBCA6B))
        pick = tl.umulhi(draw, (rank + 1).to(tl.uint32)).to(tl.int32)
        slot = tl.where(rank < K, rank, pick)
        claim = hit & (slot < K)
        packed = (rank.to(tl.int64) << 32) | orig_j[None, :].to(tl.int64)
        tl.atomic_max(slot_row[:, None] + slot, packed, mask=claim, sem="relaxed")

    tl.store(count_ptr + b * N + orig_i, count, mask=row_ok)
    # The low word of a claimed slot is the neighbour index: write those, then -1.
    tl.debug_barrier()
    n_listed = tl.minimum(count, K)
    nbr_row = nbr_ptr + (b * N + orig_i).to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        used = row_ok[:, None] & (ks[None, :] < n_listed[:, None])
        packed = tl.load(slot_row[:, None] + ks[None, :], mask=used, other=-1)
        in_row = row_ok[:, None] & (ks[None, :] < K)
        tl.store(nbr_row[:, None] + ks[None, :], packed.to(tl.int32), mask=in_row)


def ball_query_search(
    plan: SpatialPlan,
    max_neighbors: int,
    seed: int,
    eps: float,
    num_warps: int = SEARCH_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the search on a plan (``plan.tiles`` unused: each program lists its row
    block's tiles itself, non-symmetric); see ``ball_query``.

    One launch. Besides the outputs it takes ``B * N * K`` int64 of scratch (the
    packed claims) until it returns.
    """
    b, _, n = plan.truth.shape
    nrb = triton.cdiv(n, plan.block_rows)
    ncb = plan.boxes.shape[1]
    dev = plan.truth.device
    tiles = torch.empty((b, nrb, ncb), device=dev, dtype=torch.int32)
    slots = torch.empty((b, n, max_neighbors), device=dev, dtype=torch.int64)
    neighbors = torch.empty((b, n, max_neighbors), device=dev, dtype=torch.int32)
    counts = torch.empty((b, n), device=dev, dtype=torch.int32)
    _ball_query_kernel[(nrb, b)](
        plan.truth,
        plan.radius,
        plan.perm,
        plan.boxes,
        tiles,
        slots,
        neighbors,
        counts,
        n,
        nrb,
        ncb,
        max_neighbors,
        seed,
        eps,
        BLOCK_M=plan.block_rows,
        BLOCK_N=plan.block_cols,
        CHUNK=tile_chunk(ncb),
        BLOCK_K=SEARCH_BLOCK_K,
        num_warps=num_warps,
    )
    return neighbors, counts


def search_plan(
    truth: torch.Tensor, nuc: torch.Tensor, mask: torch.Tensor
) -> SpatialPlan:
    """The spatial plan of the neighbour search, from the per-atom inputs
    (``[B, N, 3]``, ``[B, N]``, ``[B, N]``, as ``per_atom_inputs`` returns them)."""
    return make_plan(
        truth,
        nuc,
        mask,
        SEARCH_BLOCK_ROWS,
        SEARCH_BLOCK_COLS,
        symmetric=False,
        list_tiles=False,
    )


def draw_seed() -> int:
    """A seed from torch's default CPU generator (follows ``torch.manual_seed``)."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def check_search_size(n: int, max_neighbors: int) -> None:
    """The search's limits: ``max_neighbors >= 1``, and ``N * max_neighbors`` int32
    neighbour slots per batch element.

    Raises:
        ValueError: either limit is broken."""
    if max_neighbors < 1:
        raise ValueError(f"max_neighbors must be >= 1, got {max_neighbors}")
    if n >= 2**31 // max_neighbors:
        raise ValueError("N * max_neighbors must stay below 2**31")


def ball_query(
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    max_neighbors: int = 256,
    seed: int | None = None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-radius neighbours of every atom in the ground truth, at most ``K`` each.

    Args:
        truth: ``[B, N, 3]`` or ``[B, 1, N, 3]`` ground-truth positions.
        is_nucleotide: ``[B, N]`` or ``[B, 1, N]``; nucleotide rows use a 30 A radius,
            others 15 A.
        atom_mask: ``[B, N]`` or ``[B, 1, N]``; masked atoms have no neighbours and are
            nobody's neighbour.
        max_neighbors: ``K``.
        seed: seeds the sample when an atom has more than ``K`` neighbours; ``None``
            draws one from torch's default generator. Same inputs and seed, same
            output, on any run.
        eps: OF3's eps inside the distance square root.

    Returns:
        ``neighbors [B, N, K]`` int32 original atom indices, ``-1`` in unused slots
        (used slots come first), and ``counts [B, N]`` int32, the number of in-radius
        neighbours before sampling (exact). Not differentiable.
    """
    if truth.dim() == 3:
        truth = truth[:, None]
    b, _, n, _ = truth.shape
    dummy = truth.new_empty((b, 1, n, 3))
    truth, nuc, mask = per_atom_inputs(dummy, truth, is_nucleotide, atom_mask)
    check_search_size(n, max_neighbors)
    seed = draw_seed() if seed is None else int(seed) % (2**31)
    with on_device(truth):
        return ball_query_search(
            search_plan(truth, nuc, mask), max_neighbors, seed, eps
        )
