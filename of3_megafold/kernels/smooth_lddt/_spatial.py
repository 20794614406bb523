"""Spatial sort and block-sparse tile lists shared by both smooth lDDT backends.

Only pairs closer than the inclusion radius (15 A, 30 A for nucleotide rows) in the
ground truth contribute to smooth lDDT. Sorting atoms along a Z-order (Morton) curve of
the ground truth puts spatial neighbours in the same blocks; a pair of blocks whose
axis-aligned bounding boxes are farther apart than the radius has no contributing
pair and is skipped exactly. This is the cell-list / space-filling-curve sort of
N-body and molecular-dynamics codes; the Morton bit interleave is the textbook
"part1by2" trick.

Planning is two or three small Triton kernels and one ``torch.argsort`` per call,
without host synchronisation:

1. ``_morton_keys_kernel``: per structure, the bounding box of the atoms in the mask,
   then a 30-bit Morton key per atom (atoms outside the mask sort last).
2. ``_sorted_blocks_kernel``: gathers the ground truth and inclusion radius into
   sorted order and writes each column block's bounding box and largest radius.
3. ``_tile_list_kernel`` (``list_tiles=True``): for each row block, the column blocks
   whose boxes come within the radius, compacted in increasing order
   (``list_row_block_tiles``). A consumer with one program per row block (the
   neighbour search) calls that function itself instead, one launch fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import NUCLEOTIDE_CUTOFF, PROTEIN_CUTOFF

_MORTON_BITS = 10
# The kernels compare rounded fp32 distances; a little slack keeps the skip exact.
_CUTOFF_SLACK = tl.constexpr(1e-3)
_CUTOFF_RELATIVE_SLACK = tl.constexpr(1e-5)


@dataclass
class SpatialPlan:
    """Sorted view of one batch of ground-truth structures.

    Attributes:
        perm: ``[B, N]`` int32, sorted position -> original atom index.
        inv_perm: ``[B, N]`` int32, original atom index -> sorted position.
        truth: ``[B, 3, N]`` float32 ground truth in sorted order (structure of arrays).
        radius: ``[B, N]`` float32 in sorted order: inclusion radius of the atom as a
            row (15 or 30 A), 0 for atoms outside the loss mask.
        n_valid: ``[B]`` int32, atoms in the loss mask.
        boxes: ``[B, NCB, 8]`` float32 per column block: lowest x, y, z and highest
            x, y, z of its atoms in the mask (``+inf``/``-inf`` when it has none),
            largest radius, unused.
        tiles: ``[B, NRB, NCB]`` int32: for each row block, the column blocks that
            may hold a contributing pair, in increasing order; only the first
            ``n_tiles`` entries of a row are written. None without ``list_tiles``.
        n_tiles: ``[B, NRB]`` int32, or None without ``list_tiles``.
        block_rows, block_cols: block sizes the tiles were built for.
    """

    perm: torch.Tensor
    inv_perm: torch.Tensor
    truth: torch.Tensor
    radius: torch.Tensor
    n_valid: torch.Tensor
    boxes: torch.Tensor
    tiles: torch.Tensor | None
    n_tiles: torch.Tensor | None
    block_rows: int
    block_cols: int


@triton.jit
def _spread_bits(v):
    # Insert two zero bits between the low 10 bits of v ("part1by2").
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    v = (v | (v << 2)) & 0x09249249
    return v


@triton.jit
def _morton_keys_kernel(
    t_ptr,  # [B, N, 3] fp32
    valid_ptr,  # [B, N] any dtype, non-zero = in the loss mask
    key_ptr,  # [B, N] int32 out
    n_valid_ptr,  # [B] int32 out
    N,
    BLOCK: tl.constexpr,
    TOP: tl.constexpr,
):
    b = tl.program_id(0)
    t_base = t_ptr + b.to(tl.int64) * N * 3
    lo0 = tl.full([], float("inf"), tl.float32)
    lo1 = tl.full([], float("inf"), tl.float32)
    lo2 = tl.full([], float("inf"), tl.float32)
    hi0 = tl.full([], float("-inf"), tl.float32)
    hi1 = tl.full([], float("-inf"), tl.float32)
    hi2 = tl.full([], float("-inf"), tl.float32)
    count = tl.zeros([], tl.int32)
    for n0 in range(0, N, BLOCK):
        idx = n0 + tl.arange(0, BLOCK)
        ok = idx < N
        v = ok & (tl.load(valid_ptr + b * N + idx, mask=ok, other=0) != 0)
        c0 = tl.load(t_base + idx * 3, mask=v, other=0.0)
        c1 = tl.load(t_base + idx * 3 + 1, mask=v, other=0.0)
        c2 = tl.load(t_base + idx * 3 + 2, mask=v, other=0.0)
        lo0 = tl.minimum(lo0, tl.min(tl.where(v, c0, float("inf")), axis=0))
        lo1 = tl.minimum(lo1, tl.min(tl.where(v, c1, float("inf")), axis=0))
        lo2 = tl.minimum(lo2, tl.min(tl.where(v, c2, float("inf")), axis=0))
        hi0 = tl.maximum(hi0, tl.max(tl.where(v, c0, float("-inf")), axis=0))
        hi1 = tl.maximum(hi1, tl.max(tl.where(v, c1, float("-inf")), axis=0))
        hi2 = tl.maximum(hi2, tl.max(tl.where(v, c2, float("-inf")), axis=0))
        count += tl.sum(v.to(tl.int32), axis=0)
    # One scale for all axes: cells stay cubes, so the curve follows real distances.
    span = tl.maximum(tl.maximum(hi0 - lo0, hi1 - lo1), hi2 - lo2)
    scale = TOP / tl.maximum(span, 1e-3)
    for n0 in range(0, N, BLOCK):
        idx = n0 + tl.arange(0, BLOCK)
        ok = idx < N
        v = ok & (tl.load(valid_ptr + b * N + idx, mask=ok, other=0) != 0)
        c0 = tl.load(t_base + idx * 3, mask=v, other=0.0)
        c1 = tl.load(t_base + idx * 3 + 1, mask=v, other=0.0)
        c2 = tl.load(t_base + idx * 3 + 2, mask=v, other=0.0)
        q0 = tl.minimum(tl.maximum((c0 - lo0) * scale, 0.0), TOP).to(tl.int32)
        q1 = tl.minimum(tl.maximum((c1 - lo1) * scale, 0.0), TOP).to(tl.int32)
        q2 = tl.minimum(tl.maximum((c2 - lo2) * scale, 0.0), TOP).to(tl.int32)
        key = _spread_bits(q0) | (_spread_bits(q1) << 1) | (_spread_bits(q2) << 2)
        key = tl.where(v, key, 1 << 30)
        tl.store(key_ptr + b * N + idx, key, mask=ok)
    tl.store(n_valid_ptr + b, count)


@triton.jit
def _sorted_blocks_kernel(
    t_ptr,  # [B, N, 3] fp32, original order
    nuc_ptr,  # [B, N] any dtype, non-zero = nucleotide
    valid_ptr,  # [B, N] any dtype, non-zero = in the loss mask
    order_ptr,  # [B, N] int64 from argsort: sorted position -> original index
    perm_ptr,  # [B, N] int32 out, same as order
    inv_perm_ptr,  # [B, N] int32 out
    ts_ptr,  # [B, 3, N] fp32 out, sorted
    rs_ptr,  # [B, N] fp32 out, sorted radius
    box_ptr,  # [B, NCB, 8] fp32 out: lo xyz, hi xyz, max radius, unused
    N,
    NCB,
    BLOCK: tl.constexpr,
    R_PROTEIN: tl.constexpr,
    R_NUCLEOTIDE: tl.constexpr,
):
    cb = tl.program_id(0)
    b = tl.program_id(1)
    pos = cb * BLOCK + tl.arange(0, BLOCK)
    ok = pos < N
    src = tl.load(order_ptr + b * N + pos, mask=ok, other=0).to(tl.int32)
    v = ok & (tl.load(valid_ptr + b * N + src, mask=ok, other=0) != 0)
    nuc = tl.load(nuc_ptr + b * N + src, mask=ok, other=0) != 0
    t_base = t_ptr + b.to(tl.int64) * N * 3
    c0 = tl.load(t_base + src * 3, mask=ok, other=0.0)
    c1 = tl.load(t_base + src * 3 + 1, mask=ok, other=0.0)
    c2 = tl.load(t_base + src * 3 + 2, mask=ok, other=0.0)
    r = tl.where(v, tl.where(nuc, R_NUCLEOTIDE, R_PROTEIN), 0.0)

    tl.store(perm_ptr + b * N + pos, src, mask=ok)
    tl.store(inv_perm_ptr + b * N + src, pos, mask=ok)
    ts_base = ts_ptr + b.to(tl.int64) * 3 * N
    tl.store(ts_base + pos, c0, mask=ok)
    tl.store(ts_base + N + pos, c1, mask=ok)
    tl.store(ts_base + 2 * N + pos, c2, mask=ok)
    tl.store(rs_ptr + b * N + pos, r, mask=ok)

    box = box_ptr + (b * NCB + cb) * 8
    tl.store(box + 0, tl.min(tl.where(v, c0, float("inf")), axis=0))
    tl.store(box + 1, tl.min(tl.where(v, c1, float("inf")), axis=0))
    tl.store(box + 2, tl.min(tl.where(v, c2, float("inf")), axis=0))
    tl.store(box + 3, tl.max(tl.where(v, c0, float("-inf")), axis=0))
    tl.store(box + 4, tl.max(tl.where(v, c1, float("-inf")), axis=0))
    tl.store(box + 5, tl.max(tl.where(v, c2, float("-inf")), axis=0))
    tl.store(box + 6, tl.max(r, axis=0))


@triton.jit
def list_row_block_tiles(
    box_ptr,  # [B, NCB, 8] fp32
    out_ptr,  # [NCB] int32 out: this row block's list
    b,
    rb,
    NCB,
    SUB: tl.constexpr,  # column blocks per row block
    SYMMETRIC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Write the column blocks that may hold a pair of row block ``rb`` of structure
    ``b`` to ``out_ptr``, in increasing order; return how many."""
    sub = rb * SUB + tl.arange(0, SUB)
    sub_ok = sub < NCB
    row_box = box_ptr + (b * NCB + sub) * 8
    rlo0 = tl.min(tl.load(row_box + 0, mask=sub_ok, other=float("inf")), axis=0)
    rlo1 = tl.min(tl.load(row_box + 1, mask=sub_ok, other=float("inf")), axis=0)
    rlo2 = tl.min(tl.load(row_box + 2, mask=sub_ok, other=float("inf")), axis=0)
    rhi0 = tl.max(tl.load(row_box + 3, mask=sub_ok, other=float("-inf")), axis=0)
    rhi1 = tl.max(tl.load(row_box + 4, mask=sub_ok, other=float("-inf")), axis=0)
    rhi2 = tl.max(tl.load(row_box + 5, mask=sub_ok, other=float("-inf")), axis=0)
    r_row = tl.max(tl.load(row_box + 6, mask=sub_ok, other=0.0), axis=0)

    count = tl.zeros([], tl.int32)
    for c0 in range(0, NCB, CHUNK):
        cb = c0 + tl.arange(0, CHUNK)
        ok = cb < NCB
        col_box = box_ptr + (b * NCB + cb) * 8
        clo0 = tl.load(col_box + 0, mask=ok, other=float("inf"))
        clo1 = tl.load(col_box + 1, mask=ok, other=float("inf"))
        clo2 = tl.load(col_box + 2, mask=ok, other=float("inf"))
        chi0 = tl.load(col_box + 3, mask=ok, other=float("-inf"))
        chi1 = tl.load(col_box + 4, mask=ok, other=float("-inf"))
        chi2 = tl.load(col_box + 5, mask=ok, other=float("-inf"))
        r_col = tl.load(col_box + 6, mask=ok, other=0.0)
        # Empty boxes are (+inf, -inf): their gaps are +inf, never NaN.
        g0 = tl.maximum(tl.maximum(clo0 - rhi0, rlo0 - chi0), 0.0)
        g1 = tl.maximum(tl.maximum(clo1 - rhi1, rlo1 - chi1), 0.0)
        g2 = tl.maximum(tl.maximum(clo2 - rhi2, rlo2 - chi2), 0.0)
        dist2 = g0 * g0 + g1 * g1 + g2 * g2
        r_rows = r_col * 0.0 + r_row  # as a tensor (the interpreter needs it)
        cut = tl.maximum(r_col, r_rows) if SYMMETRIC else r_rows
        limit = cut * (1.0 + _CUTOFF_RELATIVE_SLACK) + _CUTOFF_SLACK
        active = ok & (dist2 < limit * limit) & (r_rows > 0.0) & (r_col > 0.0)
        active_i = active.to(tl.int32)
        slot = count + tl.cumsum(active_i, axis=0) - active_i
        tl.store(out_ptr + slot, cb, mask=active)
        count += tl.sum(active_i, axis=0)
    return count


@triton.jit
def _tile_list_kernel(
    box_ptr,  # [B, NCB, 8] fp32
    tiles_ptr,  # [B, NRB, NCB] int32 out
    n_tiles_ptr,  # [B, NRB] int32 out
    NRB,
    NCB,
    SUB: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    rb = tl.program_id(0)
    b = tl.program_id(1)
    out = tiles_ptr + (b * NRB + rb).to(tl.int64) * NCB
    count = list_row_block_tiles(box_ptr, out, b, rb, NCB, SUB, SYMMETRIC, CHUNK)
    tl.store(n_tiles_ptr + b * NRB + rb, count)


def tile_chunk(ncb: int) -> int:
    """``CHUNK`` of ``list_row_block_tiles`` for ``ncb`` column blocks."""
    return min(1024, triton.next_power_of_2(ncb))


def _as_loadable(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def make_plan(
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    block_rows: int,
    block_cols: int,
    symmetric: bool,
    list_tiles: bool = True,
) -> SpatialPlan:
    """Sort atoms and list the block pairs that can hold an included pair.

    Args:
        truth: ``[B, N, 3]`` ground truth (any float dtype).
        is_nucleotide, atom_mask: ``[B, N]``, any dtype; non-zero means true.
        block_rows, block_cols: row / column block sizes of the kernel tiles (powers
            of two, ``block_rows`` a multiple of ``block_cols``).
        symmetric: keep a tile if it may hold a pair included from either side
            (``c_ij`` or ``c_ji``: the fused kernel's gradient needs both); otherwise
            only pairs included for the row atom (the neighbour search).
        list_tiles: build ``tiles`` / ``n_tiles``; without, they are None and the
            consumer lists each row block's tiles from ``boxes`` itself
            (``list_row_block_tiles``).
    """
    if block_rows % block_cols:
        raise ValueError("block_rows must be a multiple of block_cols")
    b, n, _ = truth.shape
    dev = truth.device
    t = truth.float().contiguous()
    nuc = _as_loadable(is_nucleotide)
    valid = _as_loadable(atom_mask)
    nrb = triton.cdiv(n, block_rows)
    ncb = triton.cdiv(n, block_cols)

    keys = torch.empty((b, n), device=dev, dtype=torch.int32)
    n_valid = torch.empty((b,), device=dev, dtype=torch.int32)
    _morton_keys_kernel[(b,)](
        t, valid, keys, n_valid, n, BLOCK=1024, TOP=float((1 << _MORTON_BITS) - 1)
    )
    order = torch.argsort(keys, dim=1, stable=True)

    perm = torch.empty((b, n), device=dev, dtype=torch.int32)
    inv_perm = torch.empty((b, n), device=dev, dtype=torch.int32)
    t_sorted = torch.empty((b, 3, n), device=dev, dtype=torch.float32)
    r_sorted = torch.empty((b, n), device=dev, dtype=torch.float32)
    boxes = torch.empty((b, ncb, 8), device=dev, dtype=torch.float32)
    _sorted_blocks_kernel[(ncb, b)](
        t,
        nuc,
        valid,
        order,
        perm,
        inv_perm,
        t_sorted,
        r_sorted,
        boxes,
        n,
        ncb,
        BLOCK=block_cols,
        R_PROTEIN=PROTEIN_CUTOFF,
        R_NUCLEOTIDE=NUCLEOTIDE_CUTOFF,
    )

    tiles = n_tiles = None
    if list_tiles:
        tiles = torch.empty((b, nrb, ncb), device=dev, dtype=torch.int32)
        n_tiles = torch.empty((b, nrb), device=dev, dtype=torch.int32)
        _tile_list_kernel[(nrb, b)](
            boxes,
            tiles,
            n_tiles,
            nrb,
            ncb,
            SUB=block_rows // block_cols,
            SYMMETRIC=symmetric,
            CHUNK=tile_chunk(ncb),
        )
    return SpatialPlan(
        perm=perm,
        inv_perm=inv_perm,
        truth=t_sorted,
        radius=r_sorted,
        n_valid=n_valid,
        boxes=boxes,
        tiles=tiles,
        n_tiles=n_tiles,
        block_rows=block_rows,
        block_cols=block_cols,
    )
