"""Pure-torch smooth lDDT: the test oracle and the CPU fallback.

Same semantics as OpenFold3 0.5.0 ``core/loss/diffusion.py::smooth_lddt_loss`` (AF3
Algorithm 27), with the per-atom features already broadcast from tokens to atoms:

    d_ij     = sqrt(eps + |x_i - x_j|^2)            (prediction)
    D_ij     = sqrt(eps + |t_i - t_j|^2)            (ground truth)
    e_ij     = 1/4 * sum_{c in .5, 1, 2, 4} sigmoid(c - |D_ij - d_ij|)
    c_ij     = D_ij < 30 if atom i (the row) is a nucleotide, else D_ij < 15
    m_ij     = [i != j] * [mask_i * mask_j != 0]
    loss     = 1 - (sum c e m / (sum m + eps)) / (sum c m / (sum m + eps) + eps)

one value per (batch, sample), no mean over samples (OF3 averages later, in
``diffusion_loss``). Everything here is dense ``[B, S, N, N]``: fine for tests and
small crops, quadratic in memory otherwise.
"""

from __future__ import annotations

import torch

PROTEIN_CUTOFF = 15.0
NUCLEOTIDE_CUTOFF = 30.0
SIGMOID_SHIFTS = (0.5, 1.0, 2.0, 4.0)


def per_atom_inputs(
    x: torch.Tensor,
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes and view the per-batch inputs as ``[B, N, 3]`` / ``[B, N]``.

    Args:
        x: ``[B, S, N, 3]`` predicted positions.
        truth: ``[B, 1, N, 3]`` or ``[B, N, 3]`` ground-truth positions (shared by
            the ``S`` samples).
        is_nucleotide: ``[B, N]`` or ``[B, 1, N]``, non-zero for DNA/RNA atoms.
        atom_mask: ``[B, N]`` or ``[B, 1, N]``, non-zero for atoms in the loss.

    Returns:
        ``truth [B, N, 3]``, ``is_nucleotide [B, N]``, ``atom_mask [B, N]``: views,
        dtypes unchanged.
    """
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"x must be [B, S, N, 3], got {tuple(x.shape)}")
    b, _, n, _ = x.shape
    if truth.dim() == 4:
        if truth.shape[1] != 1:
            raise ValueError(f"truth must be [B, 1, N, 3], got {tuple(truth.shape)}")
        truth = truth[:, 0]
    if tuple(truth.shape) != (b, n, 3):
        raise ValueError(f"truth must be [B, 1, N, 3] or [B, N, 3], got {truth.shape}")

    def per_atom(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.dim() == 3:
            if t.shape[1] != 1:
                raise ValueError(f"{name} must be [B, N] or [B, 1, N], got {t.shape}")
            t = t[:, 0]
        if tuple(t.shape) != (b, n):
            raise ValueError(f"{name} must be [B, N] or [B, 1, N], got {t.shape}")
        return t

    return truth, per_atom(is_nucleotide, "is_nucleotide"), per_atom(atom_mask, "mask")


def smooth_lddt_reference(
    x: torch.Tensor,
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    eps: float = 1e-8,
    upcast: bool = False,
) -> torch.Tensor:
    """Dense smooth lDDT loss, written op for op like OF3's ``smooth_lddt_loss``.

    Args:
        x: ``[B, S, N, 3]`` predicted positions.
        truth: ``[B, 1, N, 3]`` or ``[B, N, 3]`` ground truth.
        is_nucleotide: ``[B, N]`` or ``[B, 1, N]``.
        atom_mask: ``[B, N]`` or ``[B, 1, N]``: OF3's token loss mask broadcast to
            atoms times ``atom_resolved_mask``.
        eps: OF3's ``eps`` (``1e-8`` in its config).
        upcast: compute in float64 (the oracle for tests); otherwise in ``x``'s
            dtype, exactly as OF3 does.

    Returns:
        ``[B, S]`` loss per sample, dtype float64 with ``upcast``, else ``x.dtype``.
    """
    truth, nuc, valid = per_atom_inputs(x, truth, is_nucleotide, atom_mask)
    nuc, valid = nuc != 0, valid != 0
    dtype = torch.float64 if upcast else x.dtype
    x = x.to(dtype)
    t = truth.to(dtype)[:, None]  # [B, 1, N, 3]
    nuc = nuc.to(dtype)[:, None]  # [B, 1, N]
    mask_atom = valid.to(dtype)[:, None]
    n = x.shape[-2]

    dx = torch.sqrt(
        eps + torch.sum((x[..., None, :] - x[..., None, :, :]) ** 2, dim=-1)
    )
    dx_gt = torch.sqrt(
        eps + torch.sum((t[..., None, :] - t[..., None, :, :]) ** 2, dim=-1)
    )
    d = torch.abs(dx_gt - dx)
    e = 0.25 * sum(torch.sigmoid(shift - d) for shift in SIGMOID_SHIFTS)
    c = (dx_gt < NUCLEOTIDE_CUTOFF) * nuc[..., None] + (dx_gt < PROTEIN_CUTOFF) * (
        1 - nuc[..., None]
    )
    mask = 1 - torch.eye(n, device=x.device, dtype=dtype)
    mask = (mask * (mask_atom[..., None] * mask_atom[..., None, :])).bool()
    ce_mean = torch.sum(c * e * mask, dim=(-1, -2)) / (
        torch.sum(mask, dim=(-1, -2)) + eps
    )
    c_mean = torch.sum(c * mask, dim=(-1, -2)) / (torch.sum(mask, dim=(-1, -2)) + eps)
    return 1 - ce_mean / (c_mean + eps)


def in_radius_reference(
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Dense neighbour relation used by the ball-query backend, for tests.

    Returns ``[B, N, N]`` bool: ``c_ij * m_ij``, i.e. j != i, both atoms in the loss,
    and ``sqrt(eps + |t_i - t_j|^2)`` below 30 A (row atom i a nucleotide) or 15 A.
    Computed in float32 like the kernels.
    """
    if truth.dim() == 4:
        truth = truth[:, 0]
    if is_nucleotide.dim() == 3:
        is_nucleotide = is_nucleotide[:, 0]
    if atom_mask.dim() == 3:
        atom_mask = atom_mask[:, 0]
    t = truth.float()
    d = torch.sqrt(eps + torch.sum((t[:, :, None] - t[:, None, :]) ** 2, dim=-1))
    cutoff = torch.where(is_nucleotide != 0, NUCLEOTIDE_CUTOFF, PROTEIN_CUTOFF)
    valid = atom_mask != 0
    n = t.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=t.device)
    return (d < cutoff[:, :, None]) & valid[:, :, None] & valid[:, None, :] & ~eye


def smooth_lddt_from_neighbors_reference(
    x: torch.Tensor,
    truth: torch.Tensor,
    atom_mask: torch.Tensor,
    neighbors: torch.Tensor,
    counts: torch.Tensor,
    eps: float = 1e-8,
) -> torch.Tensor:
    """The ball-query estimator in plain torch (float64), for tests.

    ``neighbors [B, N, K]`` int (``-1`` = empty slot) and ``counts [B, N]`` are what
    ``ball_query`` returns. Row i's sampled scores are weighted by
    ``counts_i / min(counts_i, K)``; ``sum c m`` is ``sum(counts)`` and ``sum m`` is
    ``n (n - 1)`` with ``n`` the number of atoms in the loss, both exact.
    """
    if truth.dim() == 4:
        truth = truth[:, 0]
    if atom_mask.dim() == 3:
        atom_mask = atom_mask[:, 0]
    b, s, n, _ = x.shape
    k = neighbors.shape[-1]
    x = x.double()
    t = truth.double()
    ok = neighbors >= 0
    j = neighbors.clamp_min(0).long()  # [B, N, K]
    xj = torch.gather(x, 2, j.reshape(b, 1, n * k, 1).expand(b, s, n * k, 3))
    xj = xj.reshape(b, s, n, k, 3)
    tj = torch.gather(t, 1, j.reshape(b, n * k, 1).expand(b, n * k, 3)).reshape(
        b, n, k, 3
    )
    dp = torch.sqrt(eps + ((x[:, :, :, None] - xj) ** 2).sum(-1))
    dg = torch.sqrt(eps + ((t[:, :, None] - tj) ** 2).sum(-1))[:, None]
    delta = torch.abs(dg - dp)
    e = 0.25 * sum(torch.sigmoid(shift - delta) for shift in SIGMOID_SHIFTS)
    cnt = counts.double()
    weight = torch.where(cnt > 0, cnt / cnt.clamp(max=k).clamp_min(1), 0.0)
    num = (e * ok[:, None] * weight[:, None, :, None]).sum(dim=(-1, -2))
    n_valid = (atom_mask != 0).sum(-1).double()
    m_sum = (n_valid * (n_valid - 1))[:, None]
    c_sum = cnt.sum(-1)[:, None]
    return 1 - (num / (m_sum + eps)) / (c_sum / (m_sum + eps) + eps)
