"""Autograd functions and functional API of the smooth lDDT kernels.

Two backends with OpenFold3's ``smooth_lddt_loss`` semantics (see ``reference.py``):

* ``smooth_lddt_fused``: exact. Sorts atoms along a Morton curve of the ground truth,
  skips block pairs whose bounding boxes are beyond the inclusion radius, and sweeps
  the rest with the loss and its gradient in one pass. O(N) memory, deterministic.
* ``smooth_lddt_ball_query``: a sampled estimator. At most ``max_neighbors`` in-radius
  neighbours per atom (a uniform random subset when there are more), scored sparsely.
  Unbiased for the loss and its gradient; exact when no atom has more neighbours
  than ``max_neighbors``.

Both return ``[B, S]`` float32 (one loss per batch element and sample, as OF3's function
does; OF3 averages over samples afterwards).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from of3_megafold.kernels.backend import on_device

from ._ball_query import ball_query_search, check_search_size, draw_seed, search_plan
from ._fused import gather_sorted_x, scatter_grad, smooth_lddt_fused_fwd
from ._loss import lddt_loss_from_sums
from ._sparse_score import neighbor_score_bwd, neighbor_score_fwd, reverse_neighbors
from ._spatial import make_plan
from .reference import per_atom_inputs

FUSED_BLOCK_ROWS = 64
FUSED_BLOCK_COLS = 32


class SmoothLDDTFusedFunction(torch.autograd.Function):
    """Exact smooth lDDT, loss and gradient in one pass (see ``_fused.py``)."""

    @staticmethod
    def forward(ctx, x, truth, is_nucleotide, atom_mask, eps, split, num_warps):
        truth, nuc, mask = per_atom_inputs(x, truth, is_nucleotide, atom_mask)
        b, s, n, _ = x.shape
        want_grad = ctx.needs_input_grad[0]
        with on_device(x):
            plan = make_plan(truth, nuc, mask, FUSED_BLOCK_ROWS, FUSED_BLOCK_COLS, True)
            x_sorted = gather_sorted_x(x, plan)
            a_part, c_part, g_part = smooth_lddt_fused_fwd(
                x_sorted, plan, eps, want_grad, split=split, num_warps=num_warps
            )
            loss, dloss_da = lddt_loss_from_sums(a_part, c_part, plan.n_valid, s, eps)
            if want_grad:
                # dLoss/dx in the original atom order, [B, S, N, 3] float32.
                ctx.save_for_backward(scatter_grad(g_part, dloss_da, plan))
                ctx.x_dtype = x.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        # grad_loss is [B, S] float32 (autograd casts it to the output's dtype).
        grad_x = (grad * grad_loss[..., None, None]).to(ctx.x_dtype)
        return grad_x, None, None, None, None, None, None


def smooth_lddt_fused(
    x: torch.Tensor,
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    eps: float = 1e-8,
    split: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Exact smooth lDDT loss with O(N) memory (Triton).

    Args:
        x: ``[B, S, N, 3]`` predicted positions, float32/bfloat16/float16 (computed in
            float32). Gradients flow to ``x`` only.
        truth: ``[B, 1, N, 3]`` or ``[B, N, 3]`` ground truth, shared by the samples.
        is_nucleotide: ``[B, N]`` or ``[B, 1, N]``, non-zero for DNA/RNA atoms (their
            rows use the 30 A inclusion radius, others 15 A).
        atom_mask: ``[B, N]`` or ``[B, 1, N]``, non-zero for atoms in the loss (OF3: the
            token loss mask broadcast to atoms times ``atom_resolved_mask``).
        eps: OF3's eps.
        split: column splits per row block (a launch detail; default fills the GPU).
        num_warps: Triton warps per program (a launch detail).

    Returns:
        ``[B, S]`` float32 loss, equal to OF3's ``smooth_lddt_loss`` up to fp32
        rounding. The gradient is computed during the forward when ``x`` requires it
        (``B * S * N * 3`` floats are kept for the backward) and is deterministic.
    """
    return SmoothLDDTFusedFunction.apply(
        x, truth, is_nucleotide, atom_mask, eps, split, num_warps
    )


class SmoothLDDTBallQueryFunction(torch.autograd.Function):
    """Sampled smooth lDDT on ball-query neighbour lists (see ``_sparse_score.py``)."""

    @staticmethod
    def forward(
        ctx,
        x,
        truth,
        is_nucleotide,
        atom_mask,
        max_neighbors,
        seed,
        eps,
        deterministic,
        neighbors,
    ):
        truth, nuc, mask = per_atom_inputs(x, truth, is_nucleotide, atom_mask)
        b, _, n, _ = x.shape
        if neighbors is not None:
            nbr, counts = neighbors
            if nbr.dim() != 3 or tuple(nbr.shape[:2]) != (b, n):
                raise ValueError(f"neighbors must be [B, N, K], got {tuple(nbr.shape)}")
            if tuple(counts.shape) != (b, n):
                raise ValueError(f"counts must be [B, N], got {tuple(counts.shape)}")
        with on_device(x):
            if neighbors is None:
                plan = search_plan(truth, nuc, mask)
                nbr, counts = ball_query_search(plan, max_neighbors, seed, eps)
                n_valid = plan.n_valid
            else:
                nbr = nbr.to(torch.int32).contiguous()
                counts = counts.to(torch.int32).contiguous()
                n_valid = (mask != 0).sum(dim=1, dtype=torch.int32)
            x = x.contiguous()
            t32 = truth.float().contiguous()
            loss, dloss_da = neighbor_score_fwd(x, t32, nbr, counts, n_valid, eps)
            if ctx.needs_input_grad[0]:
                saved = [x, t32, nbr, counts, dloss_da]
                if deterministic:
                    saved += list(reverse_neighbors(nbr))
                ctx.save_for_backward(*saved)
                ctx.eps = eps
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        x, t32, nbr, counts, dloss_da, *reverse = ctx.saved_tensors
        with on_device(x):
            grad = neighbor_score_bwd(
                x,
                t32,
                nbr,
                counts,
                dloss_da,
                grad_loss,
                ctx.eps,
                reverse=tuple(reverse) if reverse else None,
            )
        return grad.to(x.dtype), None, None, None, None, None, None, None, None


def smooth_lddt_ball_query(
    x: torch.Tensor,
    truth: torch.Tensor,
    is_nucleotide: torch.Tensor,
    atom_mask: torch.Tensor,
    max_neighbors: int = 256,
    seed: int | None = None,
    eps: float = 1e-8,
    deterministic: bool = False,
    neighbors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Smooth lDDT loss estimated on at most ``max_neighbors`` neighbours per atom.

    The neighbour search (``ball_query``) runs once per batch element on the ground
    truth; it lists every pair that smooth lDDT includes (``c_ij m_ij = 1``) and, for
    atoms with more than ``K = max_neighbors`` of them, a uniform random K-subset. Each
    listed score is weighted by ``n_i / min(n_i, K)`` (``n_i`` in-radius neighbours).

    Exact parts: ``sum m`` (from the mask count) and ``sum c m`` (from ``n_i``).
    Sampled part: ``sum c e m``, estimated without bias. The loss is affine in it, so
    the returned loss and its gradient are unbiased estimates of OF3's, and equal to
    them (up to fp32 rounding) when every ``n_i <= K``. The variance falls as K grows;
    a fresh seed per step averages it out over training.

    Args:
        x: ``[B, S, N, 3]`` predicted positions (float32/bfloat16/float16; computed in
            float32). Gradients flow to ``x`` only.
        truth: ``[B, 1, N, 3]`` or ``[B, N, 3]`` ground truth.
        is_nucleotide: ``[B, N]`` or ``[B, 1, N]``.
        atom_mask: ``[B, N]`` or ``[B, 1, N]``.
        max_neighbors: ``K``; memory is ``B * N * K`` int32 for the lists.
        seed: seed of the neighbour sample; ``None`` draws one from torch's default
            generator.
        eps: OF3's eps.
        deterministic: avoid floating-point atomics in the backward. Builds the
            reverse lists in the forward (a stable sort of ``B * N * K`` keys, plus
            ``B * N * K`` int32 kept for the backward) and recomputes each pair a
            second time for its column term; the backward then is bitwise
            reproducible. The forward and the neighbour search are deterministic in
            both modes.
        neighbors: precomputed ``(neighbors, counts)`` from ``ball_query`` (e.g. to
            reuse one search over chunks of samples); skips the search.

    Returns:
        ``[B, S]`` float32.
    """
    if neighbors is None:
        check_search_size(x.shape[-2], max_neighbors)
        seed = draw_seed() if seed is None else int(seed) % (2**31)
    return SmoothLDDTBallQueryFunction.apply(
        x,
        truth,
        is_nucleotide,
        atom_mask,
        max_neighbors,
        seed,
        eps,
        deterministic,
        neighbors,
    )
