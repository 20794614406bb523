"""Spatial sort and block-sparse tile lists shared by both smooth lDDT backends.

Only pairs closer than the inclusion radius (15 A, 30 A for nucleotide rows) in the
ground truth contribute to smooth lDDT. Sorting atoms along a Z-order (Morton) curve of
the ground truth puts spatial neighbours in the same blocks; a pair of blocks whose
axis-aligned bounding boxes are farther apart than the radius has no contributing
pair and is skipped exactly. The idea is the classic cell list / Barnes-Hut spatial
sort of N-body codes; the Morton bit interleave is the textbook "part1by2" trick.

All of this is torch (no host synchronisation); it runs once per call and costs
O(N log N + (N / block)^2) small tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import NUCLEOTIDE_CUTOFF, PROTEIN_CUTOFF

_MORTON_BITS = 10
# Tiles whose boxes are this close to the cutoff are kept: the kernels compare the
# rounded fp32 distance, so a little slack keeps the skip exact.
_CUTOFF_SLACK = 1e-3


@dataclass
class SpatialPlan:
    """Sorted view of one batch of ground-truth structures.

    Attributes:
        perm: ``[B, N]`` int64, sorted position -> original atom index.
        inv_perm: ``[B, N]`` int64, original atom index -> sorted position.
        truth: ``[B, 3, N]`` float32 ground truth in sorted order (structure of arrays).
        radius: ``[B, N]`` float32 in sorted order: inclusion radius of the atom as a
            row (15 or 30 A), 0 for atoms outside the loss mask.
        n_valid: ``[B]`` int64, atoms in the loss mask.
        tiles: ``[B, NRB, NCB]`` int32: for each row block, the column blocks that
            may hold a contributing pair come first, in increasing order.
        n_tiles: ``[B, NRB]`` int32, how many of ``tiles`` are active.
        block_rows, block_cols: block sizes the tiles were built for.
    """

    perm: torch.Tensor
    inv_perm: torch.Tensor
    truth: torch.Tensor
    radius: torch.Tensor
    n_valid: torch.Tensor
    tiles: torch.Tensor
    n_tiles: torch.Tensor
    block_rows: int
    block_cols: int


def atom_radius(is_nucleotide: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` float32: 30 for nucleotide atoms, 15 for others, 0 if masked out."""
    r = torch.where(is_nucleotide, NUCLEOTIDE_CUTOFF, PROTEIN_CUTOFF).float()
    return torch.where(valid, r, torch.zeros_like(r))


def _spread_bits(v: torch.Tensor) -> torch.Tensor:
    # Insert two zero bits between the low 10 bits of v ("part1by2").
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    v = (v | (v << 2)) & 0x09249249
    return v


def morton_order(truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` int64 permutation sorting valid atoms along a Morton curve.

    Atoms outside the mask go last. The order is a deterministic function of the
    inputs (stable sort).
    """
    t = truth.float()
    inf = torch.tensor(float("inf"), device=t.device)
    lo = torch.where(valid[..., None], t, inf).amin(dim=1, keepdim=True)
    hi = torch.where(valid[..., None], t, -inf).amax(dim=1, keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
    # One scale for all axes: cells stay cubes, so the curve follows real distances.
    span = torch.where(torch.isfinite(hi), hi - lo, torch.ones_like(hi))
    span = span.amax(dim=-1, keepdim=True).clamp_min(1e-3)
    top = (1 << _MORTON_BITS) - 1
    q = ((t - lo) / span * top).nan_to_num(0.0).clamp(0, top).long()
    key = _spread_bits(q[..., 0]) | (_spread_bits(q[..., 1]) << 1)
    key = key | (_spread_bits(q[..., 2]) << 2)
    key = torch.where(valid, key, torch.full_like(key, 1 << (3 * _MORTON_BITS)))
    return torch.argsort(key, dim=1, stable=True)


def _block_boxes(
    truth_sorted: torch.Tensor, radius_sorted: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block bounding boxes ``[B, NB, 3]`` over valid atoms, and max radius."""
    b, n, _ = truth_sorted.shape
    nb = -(-n // block)
    pad = nb * block - n
    valid = radius_sorted > 0
    inf = torch.tensor(float("inf"), device=truth_sorted.device)
    lo = torch.where(valid[..., None], truth_sorted, inf)
    hi = torch.where(valid[..., None], truth_sorted, -inf)
    r = radius_sorted
    if pad:
        lo = torch.nn.functional.pad(lo, (0, 0, 0, pad), value=float("inf"))
        hi = torch.nn.functional.pad(hi, (0, 0, 0, pad), value=float("-inf"))
        r = torch.nn.functional.pad(r, (0, pad), value=0.0)
    lo = lo.view(b, nb, block, 3).amin(dim=2)
    hi = hi.view(b, nb, block, 3).amax(dim=2)
    return lo, hi, r.view(b, nb, block).amax(dim=2)


def make_plan(
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    valid: torch.Tensor,
    block_rows: int,
    block_cols: int,
    symmetric: bool,
) -> SpatialPlan:
    """Sort atoms and list the block pairs that can hold an included pair.

    Args:
        truth: ``[B, N, 3]`` ground truth (any float dtype).
        is_nucleotide, valid: ``[B, N]`` bool.
        block_rows, block_cols: row / column block sizes of the kernel tiles.
        symmetric: keep a tile if it may hold a pair included from either side
            (``c_ij`` or ``c_ji``: the fused kernel's gradient needs both); otherwise
            only pairs included for the row atom (the neighbour search).
    """
    b, n, _ = truth.shape
    perm = morton_order(truth, valid)
    inv_perm = torch.empty_like(perm)
    inv_perm.scatter_(1, perm, torch.arange(n, device=perm.device).expand(b, n))
    t_sorted = torch.gather(truth.float(), 1, perm[..., None].expand(b, n, 3))
    r_sorted = torch.gather(atom_radius(is_nucleotide, valid), 1, perm)

    lo_r, hi_r, rad_r = _block_boxes(t_sorted, r_sorted, block_rows)
    lo_c, hi_c, rad_c = _block_boxes(t_sorted, r_sorted, block_cols)
    gap = torch.maximum(
        lo_c[:, None, :, :] - hi_r[:, :, None, :],
        lo_r[:, :, None, :] - hi_c[:, None, :, :],
    ).clamp_min(0.0)
    dist2 = (gap * gap).sum(-1)  # [B, NRB, NCB]
    cut = rad_r[:, :, None]
    if symmetric:
        cut = torch.maximum(cut, rad_c[:, None, :])
    # Empty blocks have radius 0 and infinite gaps: never active.
    active = (dist2 < (cut * (1 + 1e-5) + _CUTOFF_SLACK) ** 2) & (rad_r[:, :, None] > 0)
    active = active & (rad_c[:, None, :] > 0)
    tiles = torch.argsort((~active).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return SpatialPlan(
        perm=perm,
        inv_perm=inv_perm,
        truth=t_sorted.transpose(1, 2).contiguous(),
        radius=r_sorted.contiguous(),
        n_valid=valid.sum(dim=1),
        tiles=tiles.contiguous(),
        n_tiles=active.sum(dim=-1, dtype=torch.int32),
        block_rows=block_rows,
        block_cols=block_cols,
    )
