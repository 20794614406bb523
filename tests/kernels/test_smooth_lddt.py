"""Smooth lDDT kernels against the dense reference and OpenFold3's own loss.

On CPU the Triton kernels run under the interpreter (tests/conftest.py), so shapes stay
small; ``@pytest.mark.gpu`` cases cover realistic sizes on the GPU machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from of3_megafold.kernels.smooth_lddt import (
    ball_query,
    smooth_lddt_ball_query,
    smooth_lddt_fused,
    smooth_lddt_reference,
)
from of3_megafold.kernels.smooth_lddt._ball_query import (
    SEARCH_BLOCK_COLS,
    SEARCH_BLOCK_ROWS,
    ball_query_search,
)
from of3_megafold.kernels.smooth_lddt._spatial import make_plan
from of3_megafold.kernels.smooth_lddt.reference import (
    in_radius_reference,
    smooth_lddt_from_neighbors_reference,
)

# Tolerances against the float64 reference. fp32: the loss is a ratio of sums over
# O(N^2) pairs accumulated in fp32 registers; the gradient is a per-atom sum of terms
# of both signs that cancel, so its relative error is larger than the loss's. bf16
# positions: the kernels compute in fp32, so on the same (bf16-rounded) positions the
# loss is as exact as in fp32, and the gradient carries bf16 output rounding (2^-8).
TOLERANCES = {
    torch.float32: {"loss": 1e-5, "grad": 1e-4},
    torch.bfloat16: {"loss": 1e-5, "grad": 1e-2},
}
# bf16 against fp32 positions: rounding the inputs to bf16 (0.03 A at 10 A) moves the
# distances, hence the loss and the gradient; this bounds how much.
BF16_VS_FP32 = {"loss": 5e-3, "grad": 5e-2}


def make_structure(
    b: int,
    s: int,
    n: int,
    *,
    seed: int = 0,
    device: str = "cpu",
    noise: float = 1.5,
    radius: float | None = None,
    p_nuc: float = 0.3,
    p_mask: float = 0.85,
):
    """Atoms uniform in a ball at about protein density, prediction = truth + noise."""
    g = torch.Generator().manual_seed(seed)
    radius = (
        radius
        if radius is not None
        else max(4.0, (3 * n / (4 * math.pi * 0.07)) ** (1 / 3))
    )
    direction = torch.randn(b, n, 3, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    r = radius * torch.rand(b, n, 1, generator=g) ** (1 / 3)
    truth = (direction * r)[:, None]
    x = truth + noise * torch.randn(b, s, n, 3, generator=g)
    nuc = torch.rand(b, n, generator=g) < p_nuc
    mask = (torch.rand(b, 1, n, generator=g) < p_mask).float()
    return x.to(device), truth.to(device), nuc.to(device), mask.to(device)


def dense_loss_and_grad(x, truth, nuc, mask, weights):
    xr = x.detach().double().requires_grad_()
    loss = smooth_lddt_reference(xr, truth.double(), nuc, mask, upcast=True)
    (grad,) = torch.autograd.grad((loss * weights.to(loss)).sum(), xr)
    return loss.detach(), grad


def kernel_loss_and_grad(fn, x, weights, *args, **kwargs):
    xk = x.detach().clone().requires_grad_()
    loss = fn(xk, *args, **kwargs)
    (grad,) = torch.autograd.grad((loss * weights.to(loss)).sum(), xk)
    return loss.detach(), grad


def rel_err(got, want) -> float:
    """Largest error relative to max |want|."""
    got = got.double().cpu()
    want = want.double().cpu()
    scale = want.abs().max().clamp_min(1e-12)
    return float((got - want).abs().max() / scale)


def assert_close_rel(got, want, rtol, what):
    err = rel_err(got, want)
    assert err <= rtol, (
        f"{what}: max error {err:.3e} (relative to max |ref|) > {rtol:.1e}"
    )


# --------------------------------------------------------------------------- OF3


def test_reference_matches_openfold3():
    pytest.importorskip("openfold3")
    from openfold3.core.loss.diffusion import smooth_lddt_loss
    from openfold3.core.utils.atomize_utils import broadcast_token_feat_to_atoms

    g = torch.Generator().manual_seed(1)
    b, s, n_tok = 2, 3, 23
    atoms_per_token = torch.randint(1, 5, (b, n_tok), generator=g)
    atoms_per_token[1, -3:] = 0  # trailing padding tokens in the second structure
    n_atom = int(atoms_per_token.sum(-1).max())
    atoms_per_token[1, -4] += n_atom - int(atoms_per_token[1].sum())
    token_mask = (atoms_per_token > 0).float()
    kind = torch.randint(0, 3, (b, n_tok), generator=g)  # 0 protein, 1 dna, 2 rna
    is_dna = (kind == 1).float()
    is_rna = (kind == 2).float()
    loss_token_mask = (torch.rand(b, n_tok, generator=g) < 0.8).float()
    truth = 9.0 * torch.randn(b, 1, n_atom, 3, generator=g)
    resolved = (torch.rand(b, 1, n_atom, generator=g) < 0.9).float()
    x = truth + 2.0 * torch.randn(b, s, n_atom, 3, generator=g)

    batch = {
        "token_mask": token_mask[:, None],
        "num_atoms_per_token": atoms_per_token[:, None].float(),
        "is_dna": is_dna[:, None],
        "is_rna": is_rna[:, None],
        "ground_truth": {"atom_positions": truth, "atom_resolved_mask": resolved},
    }
    for dtype in (torch.float32, torch.float64):
        xd = x.to(dtype).requires_grad_()
        cast = {
            k: (
                v.to(dtype)
                if torch.is_tensor(v)
                else {kk: vv.to(dtype) for kk, vv in v.items()}
            )
            for k, v in batch.items()
        }
        of3 = smooth_lddt_loss(xd, cast, loss_token_mask[:, None].to(dtype), eps=1e-8)
        (of3_grad,) = torch.autograd.grad(of3.sum(), xd)

        # Per-atom features: once through OF3's helper, once by hand.
        nuc = broadcast_token_feat_to_atoms(
            cast["token_mask"],
            cast["num_atoms_per_token"],
            cast["is_dna"] + cast["is_rna"],
        )
        atom_mask = broadcast_token_feat_to_atoms(
            cast["token_mask"],
            cast["num_atoms_per_token"],
            loss_token_mask[:, None].to(dtype),
        ) * resolved.to(dtype)
        counts = atoms_per_token.flatten()
        nuc_hand = torch.repeat_interleave((is_dna + is_rna).flatten(), counts).view(
            b, n_atom
        )
        mask_hand = torch.repeat_interleave(loss_token_mask.flatten(), counts).view(
            b, n_atom
        )
        mask_hand = mask_hand * resolved[:, 0]
        assert torch.equal(nuc[:, 0].float(), nuc_hand) and torch.equal(
            atom_mask[:, 0].float(), mask_hand
        )

        xr = x.to(dtype).requires_grad_()
        ours = smooth_lddt_reference(xr, truth.to(dtype), nuc, atom_mask)
        (ours_grad,) = torch.autograd.grad(ours.sum(), xr)
        assert ours.shape == of3.shape == (b, s)
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(ours, of3, rtol=tol, atol=tol)
        torch.testing.assert_close(ours_grad, of3_grad, rtol=tol, atol=tol)
        # upcast=True is the float64 oracle for the same inputs
        up = smooth_lddt_reference(
            x.to(dtype), truth.to(dtype), nuc, atom_mask, upcast=True
        )
        torch.testing.assert_close(up, of3.double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- plan


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gap", [22.0, 60.0])
def test_plan_covers_every_included_pair(symmetric, gap, device):
    _, truth, nuc, mask = two_clusters(device, gap)
    mask[..., 100:110] = 0
    t, nuc_b, mask_b = truth[:, 0], nuc, mask[:, 0]
    plan = make_plan(t, nuc_b, mask_b, 64, 32, symmetric)
    n = t.shape[1]
    perm, inv = plan.perm[0].long().cpu(), plan.inv_perm[0].long().cpu()
    assert torch.equal(perm.sort().values, torch.arange(n))
    assert torch.equal(inv[perm], torch.arange(n))
    assert int(plan.n_valid[0]) == int((mask_b != 0).sum())
    valid_sorted = (mask_b[0].cpu() != 0)[perm]
    assert torch.all(valid_sorted[: int(plan.n_valid[0])]), "masked atoms sort last"
    torch.testing.assert_close(plan.truth[0].T.cpu(), t[0].cpu()[perm])

    rel = in_radius_reference(truth, nuc, mask)[0].cpu()  # rel[i, j]: c_ij m_ij
    if symmetric:
        rel = rel | rel.T
    rel_sorted = rel[perm][:, perm]
    active = torch.zeros(plan.tiles.shape[1], plan.tiles.shape[2], dtype=torch.bool)
    for rb in range(plan.tiles.shape[1]):
        listed = plan.tiles[0, rb, : int(plan.n_tiles[0, rb])].long().cpu()
        assert torch.all(listed.diff() > 0), "tiles in increasing order"
        active[rb, listed] = True
    i, j = rel_sorted.nonzero(as_tuple=True)
    assert torch.all(active[i // 64, j // 32]), (
        "an included pair fell in a skipped tile"
    )
    if gap > 40:
        assert not torch.all(active), "far blocks should be skipped"


# --------------------------------------------------------------------------- fused


@pytest.mark.parametrize("n", [1, 7, 40, 130])
@pytest.mark.parametrize("split", [1, 3])
def test_fused_matches_dense(n, split, device):
    x, truth, nuc, mask = make_structure(2, 3, n, seed=n + split, device=device)
    w = torch.randn(2, 3, generator=torch.Generator().manual_seed(n)).to(device)
    ref_loss, ref_grad = dense_loss_and_grad(x, truth, nuc, mask, w)
    loss, grad = kernel_loss_and_grad(
        smooth_lddt_fused, x, w, truth, nuc, mask, split=split
    )
    assert loss.shape == (2, 3) and loss.dtype == torch.float32
    assert grad.shape == x.shape and grad.dtype == x.dtype
    assert_close_rel(loss, ref_loss, TOLERANCES[torch.float32]["loss"], "loss")
    if n > 1:
        assert_close_rel(grad, ref_grad, TOLERANCES[torch.float32]["grad"], "grad")
    else:
        assert torch.all(grad == 0) and torch.all(loss == 1)


def two_clusters(device, gap: float):
    """Two blobs ``gap`` A apart (centre to centre): tiles between them are skipped,
    and with nucleotides in one blob, pairs between 15 and 30 A count from one side."""
    g = torch.Generator().manual_seed(7)
    n = 150
    truth = 3.0 * torch.randn(1, 1, n, 3, generator=g)
    truth[..., n // 2 :, 0] += gap
    x = truth + 1.0 * torch.randn(1, 2, n, 3, generator=g)
    nuc = torch.zeros(1, n, dtype=torch.bool)
    nuc[:, n // 2 : n // 2 + 40] = True
    mask = torch.ones(1, 1, n)
    mask[..., 3] = 0
    return x.to(device), truth.to(device), nuc.to(device), mask.to(device)


def assert_far_tiles_skipped(truth, nuc, mask, rows, cols, symmetric):
    """The plan with these blocks lists fewer tiles than all of them."""
    plan = make_plan(truth[:, 0], nuc, mask[:, 0] > 0, rows, cols, symmetric=symmetric)
    total = plan.tiles.shape[1] * plan.tiles.shape[2]
    assert int(plan.n_tiles.sum()) < total, "the far cluster pair should be skipped"


@pytest.mark.parametrize("gap", [22.0, 60.0])
def test_fused_exact_with_skipped_tiles(gap, device):
    x, truth, nuc, mask = two_clusters(device, gap)
    if gap > 40:
        assert_far_tiles_skipped(truth, nuc, mask, 64, 32, symmetric=True)
    w = torch.tensor([[1.0, -0.5]], device=device)
    ref_loss, ref_grad = dense_loss_and_grad(x, truth, nuc, mask, w)
    loss, grad = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask)
    assert_close_rel(loss, ref_loss, 1e-5, "loss")
    assert_close_rel(grad, ref_grad, 1e-4, "grad")


def test_fused_all_masked_and_no_pairs(device):
    x, truth, nuc, mask = make_structure(2, 2, 40, seed=3, device=device)
    mask = torch.zeros_like(mask)
    mask[1, 0, 5] = 1  # a single atom: no pair at all
    loss, grad = kernel_loss_and_grad(
        smooth_lddt_fused, x, torch.ones(2, 2), truth, nuc, mask
    )
    ref = smooth_lddt_reference(x, truth, nuc, mask, upcast=True)
    assert torch.all(loss == 1) and torch.all(ref == 1)
    assert torch.all(grad == 0)


def test_fused_is_deterministic(device):
    x, truth, nuc, mask = make_structure(1, 2, 130, seed=5, device=device)
    w = torch.randn(1, 2)
    first = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask, split=3)
    second = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask, split=3)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_no_grad_path_matches(device):
    x, truth, nuc, mask = make_structure(1, 2, 40, seed=9, device=device)
    with torch.no_grad():
        plain = smooth_lddt_fused(x, truth, nuc, mask)
    loss, _ = kernel_loss_and_grad(
        smooth_lddt_fused, x, torch.ones(1, 2), truth, nuc, mask
    )
    torch.testing.assert_close(plain, loss, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ ball query


@pytest.mark.parametrize("n", [1, 7, 130])
def test_ball_query_lists_in_radius_pairs(n, device):
    _, truth, nuc, mask = make_structure(2, 1, n, seed=n, device=device)
    want = in_radius_reference(truth, nuc, mask).cpu()
    counts_ref = want.sum(-1)
    big = max(int(counts_ref.max()), 1)
    for k in (big, 4):
        nbr, counts = ball_query(truth, nuc, mask, max_neighbors=k, seed=11)
        nbr, counts = nbr.cpu(), counts.cpu()
        assert nbr.shape == (2, n, k) and nbr.dtype == torch.int32
        assert torch.equal(counts.long(), counts_ref)
        listed = (nbr >= 0).sum(-1)
        assert torch.equal(listed, counts_ref.clamp(max=k))
        # used slots first, no duplicates, all listed pairs in radius
        assert torch.all((nbr >= 0).int().diff(dim=-1) <= 0)
        for bb in range(2):
            for i in range(n):
                row = nbr[bb, i][nbr[bb, i] >= 0].long()
                assert row.unique().numel() == row.numel()
                assert torch.all(want[bb, i, row])
                if k == big:
                    assert torch.equal(
                        row.sort().values, want[bb, i].nonzero().flatten()
                    )


def test_ball_query_seed_reproducible(device):
    _, truth, nuc, mask = make_structure(1, 1, 130, seed=2, device=device)
    a = ball_query(truth, nuc, mask, max_neighbors=6, seed=5)
    b = ball_query(truth, nuc, mask, max_neighbors=6, seed=5)
    c = ball_query(truth, nuc, mask, max_neighbors=6, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("n", [1, 7, 40, 130])
def test_ball_query_exact_when_k_covers(n, device):
    b, s = (2, 3) if n < 100 else (1, 2)
    x, truth, nuc, mask = make_structure(b, s, n, seed=20 + n, device=device)
    k = max(int(in_radius_reference(truth, nuc, mask).sum(-1).max()), 1)
    w = torch.randn(b, s, generator=torch.Generator().manual_seed(n)).to(device)
    ref_loss, ref_grad = dense_loss_and_grad(x, truth, nuc, mask, w)
    for deterministic in (False, True):
        loss, grad = kernel_loss_and_grad(
            smooth_lddt_ball_query,
            x,
            w,
            truth,
            nuc,
            mask,
            max_neighbors=k,
            seed=3,
            deterministic=deterministic,
        )
        assert_close_rel(loss, ref_loss, 1e-5, f"loss (deterministic={deterministic})")
        assert_close_rel(grad, ref_grad, 1e-3, f"grad (deterministic={deterministic})")


@pytest.mark.parametrize("gap", [22.0, 60.0])
def test_ball_query_skipped_tiles_exact(gap, device):
    """Exact (K above every count) with the asymmetric nucleotide cutoff between the
    blobs (22 A) and with the far blob pairs skipped by the search (60 A)."""
    x, truth, nuc, mask = two_clusters(device, gap)
    if gap > 40:
        assert_far_tiles_skipped(
            truth, nuc, mask, SEARCH_BLOCK_ROWS, SEARCH_BLOCK_COLS, symmetric=False
        )
    w = torch.tensor([[0.3, 1.0]], device=device)
    ref_loss, ref_grad = dense_loss_and_grad(x, truth, nuc, mask, w)
    loss, grad = kernel_loss_and_grad(
        smooth_lddt_ball_query, x, w, truth, nuc, mask, max_neighbors=160, seed=0
    )
    assert_close_rel(loss, ref_loss, 1e-5, "loss")
    assert_close_rel(grad, ref_grad, 1e-3, "grad")


def test_ball_query_scoring_matches_torch_on_sampled_lists(device):
    x, truth, nuc, mask = make_structure(2, 2, 130, seed=4, device=device)
    nbr, counts = ball_query(truth, nuc, mask, max_neighbors=5, seed=9)
    assert int(counts.max()) > 5
    w = torch.randn(2, 2, generator=torch.Generator().manual_seed(4)).to(device)
    xr = x.detach().double().requires_grad_()
    want = smooth_lddt_from_neighbors_reference(xr, truth, mask, nbr, counts)
    (want_grad,) = torch.autograd.grad((want * w.double()).sum(), xr)
    for deterministic in (False, True):
        got, grad = kernel_loss_and_grad(
            smooth_lddt_ball_query,
            x,
            w,
            truth,
            nuc,
            mask,
            neighbors=(nbr, counts),
            deterministic=deterministic,
        )
        assert_close_rel(got, want, 1e-5, "loss on the same lists")
        assert_close_rel(grad, want_grad, 1e-4, "grad on the same lists")


def test_ball_query_deterministic_matches_atomics(device):
    x, truth, nuc, mask = make_structure(1, 2, 130, seed=8, device=device)
    w = torch.randn(1, 2)
    nbrs = ball_query(truth, nuc, mask, max_neighbors=8, seed=1)
    kwargs = {"neighbors": nbrs}
    l_atomic, g_atomic = kernel_loss_and_grad(
        smooth_lddt_ball_query, x, w, truth, nuc, mask, **kwargs
    )
    l_det, g_det = kernel_loss_and_grad(
        smooth_lddt_ball_query, x, w, truth, nuc, mask, deterministic=True, **kwargs
    )
    l_det2, g_det2 = kernel_loss_and_grad(
        smooth_lddt_ball_query, x, w, truth, nuc, mask, deterministic=True, **kwargs
    )
    assert torch.equal(l_atomic, l_det)
    torch.testing.assert_close(
        g_det, g_atomic, rtol=1e-5, atol=1e-6 * g_det.abs().max().item()
    )
    assert torch.equal(g_det, g_det2)


def test_ball_query_all_masked(device):
    x, truth, nuc, mask = make_structure(1, 2, 40, seed=1, device=device)
    mask = torch.zeros_like(mask)
    for deterministic in (False, True):
        loss, grad = kernel_loss_and_grad(
            smooth_lddt_ball_query,
            x,
            torch.ones(1, 2),
            truth,
            nuc,
            mask,
            max_neighbors=4,
            deterministic=deterministic,
        )
        assert torch.all(loss == 1) and torch.all(grad == 0)
    nbr, counts = ball_query(truth, nuc, mask, max_neighbors=4, seed=0)
    assert torch.all(nbr == -1) and torch.all(counts == 0)


def replicated_structure(device: str):
    """One 100-atom structure with a dense core and a sparse shell that carry different
    prediction errors, so per-row neighbour counts and mean scores are correlated and
    a wrongly weighted estimator is visibly biased."""
    g = torch.Generator().manual_seed(123)
    core = 4.0 * torch.randn(60, 3, generator=g)
    shell = torch.randn(40, 3, generator=g)
    shell = 12.0 * shell / shell.norm(dim=-1, keepdim=True)
    truth = torch.cat([core, shell])
    n = truth.shape[0]
    noise = torch.cat([torch.full((60, 1), 0.6), torch.full((40, 1), 2.5)])
    x = truth + noise * torch.randn(2, n, 3, generator=g)
    nuc = torch.zeros(n, dtype=torch.bool)
    nuc[::7] = True
    mask = torch.ones(n)
    mask[::11] = 0
    fields = {
        "x": x[None],
        "truth": truth[None, None],
        "nuc": nuc[None],
        "mask": mask[None, None],
    }
    return {name: t.to(device) for name, t in fields.items()}


SAMPLING_COPIES = 320


@pytest.fixture(scope="module")
def sampled_replicas():
    """Neighbour samples of ``SAMPLING_COPIES`` copies of one structure, one batch
    element each (each draws its own stream), K = 6.

    One 128 x 128 tile per copy: the interpreter's cost is per program and per loop
    iteration, so this is the cheapest way to many independent draws.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    one = replicated_structure(device)
    copies, k = SAMPLING_COPIES, 6
    plan = make_plan(one["truth"][:, 0], one["nuc"], one["mask"][:, 0], 128, 128, False)
    # The same plan for every copy (the structure is the same): build it once.
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    repeated = {
        name: t.repeat(copies, *[1] * (t.dim() - 1))
        for name, t in fields.items()
        if torch.is_tensor(t)
    }
    plan = dataclasses.replace(plan, **repeated)
    nbr, counts = ball_query_search(plan, k, 2024, 1e-8)
    return {k_: v.cpu() for k_, v in one.items()}, nbr.cpu().long(), counts.cpu(), k


def test_ball_query_is_unbiased(sampled_replicas):
    one, nbr, counts, k = sampled_replicas
    copies = nbr.shape[0]
    x, truth, mask = (one[key].cpu().double() for key in ("x", "truth", "mask"))
    nuc = one["nuc"].cpu()
    assert int(counts.min()) < k < int(counts.max())
    xr = x.clone().requires_grad_()
    dense = smooth_lddt_reference(xr, truth, nuc, mask, upcast=True)[0]
    (dense_grad,) = torch.autograd.grad(dense.sum(), xr)

    xs = x.expand(copies, -1, -1, -1).clone().requires_grad_()
    est = smooth_lddt_from_neighbors_reference(
        xs, truth.expand(copies, -1, -1, -1), mask.expand(copies, -1, -1), nbr, counts
    )
    (grad,) = torch.autograd.grad(est.sum(), xs)
    direction = torch.randn(
        x.shape[1:], generator=torch.Generator().manual_seed(0)
    ).double()

    def zscore(samples, target):
        mean = samples.mean(0)
        stderr = samples.std(0) / math.sqrt(samples.shape[0])
        return ((mean - target) / stderr).abs()

    # The estimator on the kernel's samples, per sample s, and a random projection of
    # its gradient: z-tests against the exact values (|z| < 4.5 fails by chance with
    # probability ~1e-5 per check). The kernel's scoring equals this estimator on the
    # same lists (test_ball_query_scoring_matches_torch_on_sampled_lists).
    est = est.detach()
    assert torch.all(zscore(est, dense.detach()) < 4.5), (est.mean(0), dense)
    proj = (grad * direction).sum(dim=(1, 2, 3))
    assert zscore(proj[:, None], (dense_grad[0] * direction).sum())[0] < 4.5

    # The test has power: ignoring the sampling weights (each listed pair counted
    # once, sum c m from the listed pairs) is biased, and must be caught.
    naive = smooth_lddt_from_neighbors_reference(
        x.expand(copies, -1, -1, -1),
        truth.expand(copies, -1, -1, -1),
        mask.expand(copies, -1, -1),
        nbr,
        counts.clamp(max=k),
    )
    assert torch.all(zscore(naive, dense.detach()) > 4.5), (naive.mean(0), dense)


def test_ball_query_sample_is_uniform(sampled_replicas):
    one, nbr, counts, k = sampled_replicas
    copies = nbr.shape[0]
    n = counts.shape[1]
    hits = torch.zeros(n, n + 1)
    slot_target = torch.where(nbr >= 0, nbr, n)  # empty slots -> extra column
    for row in range(n):
        hits[row].index_add_(0, slot_target[:, row].flatten(), torch.ones(copies * k))
    hits = hits[:, :n]
    rel = in_radius_reference(one["truth"], one["nuc"], one["mask"])[0].cpu()
    assert torch.all(counts == counts[0])
    assert torch.all(hits[~rel] == 0)
    cnt = counts[0].double()
    rows = cnt > k
    p = (k / cnt[rows])[:, None].expand(-1, n)[rel[rows]]
    observed = hits[rows][rel[rows]].double()
    z = (observed - copies * p) / torch.sqrt(copies * p * (1 - p))
    # Each candidate of each over-full row is kept with probability K / n_i: the
    # z-scores of the keep counts are ~N(0, 1). Check their spread and extremes.
    assert z.numel() > 500
    assert abs(z.mean().item()) < 0.1, z.mean()
    assert 0.85 < z.std().item() < 1.15, z.std()
    assert z.abs().max().item() < 5.0


# ----------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("backend", ["fused", "ball_query"])
def test_bf16_inputs(backend, device):
    x, truth, nuc, mask = make_structure(2, 2, 40, seed=31, device=device)
    x16 = x.bfloat16()
    w = torch.tensor([[1.0, 0.5], [-1.0, 2.0]], device=device)
    # the reference sees the same bf16-rounded positions, in float64
    ref_loss, ref_grad = dense_loss_and_grad(x16.double(), truth, nuc, mask, w)
    if backend == "fused":
        loss, grad = kernel_loss_and_grad(smooth_lddt_fused, x16, w, truth, nuc, mask)
    else:
        k = int(in_radius_reference(truth, nuc, mask).sum(-1).max())
        loss, grad = kernel_loss_and_grad(
            smooth_lddt_ball_query, x16, w, truth, nuc, mask, max_neighbors=k, seed=0
        )
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert_close_rel(loss, ref_loss, TOLERANCES[torch.bfloat16]["loss"], "bf16 loss")
    assert_close_rel(grad, ref_grad, TOLERANCES[torch.bfloat16]["grad"], "bf16 grad")
    # at most twice the error of plain torch in bf16 (the kit's torch reference, OF3's
    # dense math) plus a floor
    plain = smooth_lddt_reference(x16, truth.bfloat16(), nuc, mask)
    plain_err = (plain.double() - ref_loss).abs().max()
    assert (loss.double() - ref_loss).abs().max() <= 2 * plain_err + 1e-5
    # bf16 against fp32 positions, both through the kernel
    if backend == "fused":
        loss32, grad32 = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask)
    else:
        loss32, grad32 = kernel_loss_and_grad(
            smooth_lddt_ball_query, x, w, truth, nuc, mask, max_neighbors=k, seed=0
        )
    assert_close_rel(loss, loss32, BF16_VS_FP32["loss"], "bf16 vs fp32 loss")
    assert_close_rel(grad, grad32, BF16_VS_FP32["grad"], "bf16 vs fp32 grad")


def test_shape_checks():
    x, truth, nuc, mask = make_structure(1, 2, 7)
    with pytest.raises(ValueError):
        smooth_lddt_fused(x[0], truth, nuc, mask)
    with pytest.raises(ValueError):
        smooth_lddt_fused(x, truth[..., :5, :], nuc, mask)
    with pytest.raises(ValueError):
        smooth_lddt_ball_query(x, truth, nuc, mask[..., :3])
    with pytest.raises(ValueError):
        nbr, counts = ball_query(truth, nuc, mask, max_neighbors=2, seed=0)
        smooth_lddt_ball_query(x, truth, nuc, mask, neighbors=(nbr[:, :3], counts))
    # The loss's own search has ball_query's limits (it launched with K = 0 before)
    for search in (ball_query, functools.partial(smooth_lddt_ball_query, x)):
        with pytest.raises(ValueError, match="max_neighbors must be >= 1"):
            search(truth, nuc, mask, max_neighbors=0, seed=0)


# -------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 3329])
def test_gpu_fused_and_ball_query_large(n):
    x, truth, nuc, mask = make_structure(
        1, 2, n, seed=n, device="cuda", p_nuc=0.1, p_mask=0.95
    )
    w = torch.randn(1, 2, device="cuda")
    ref_loss, ref_grad = dense_loss_and_grad(x, truth, nuc, mask, w)
    loss, grad = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask)
    assert_close_rel(loss, ref_loss, 1e-5, "fused loss")
    # At N=3329 a pair sits on an inclusion cutoff that fp32 and fp64 decide
    # differently: OF3's own fp32 dense loss is then 7.8e-4 off the fp64
    # gradient. The project's rule: at most 2x OF3's fp32 error, or 1e-4.
    _, of3_grad = kernel_loss_and_grad(smooth_lddt_reference, x, w, truth, nuc, mask)
    grad_tol = max(1e-4, 2 * rel_err(of3_grad, ref_grad))
    assert_close_rel(grad, ref_grad, grad_tol, "fused grad")
    again = kernel_loss_and_grad(smooth_lddt_fused, x, w, truth, nuc, mask)
    assert torch.equal(again[0], loss) and torch.equal(again[1], grad)

    k = int(in_radius_reference(truth, nuc, mask).sum(-1).max())
    for deterministic in (False, True):
        loss, grad = kernel_loss_and_grad(
            smooth_lddt_ball_query,
            x,
            w,
            truth,
            nuc,
            mask,
            max_neighbors=k,
            seed=1,
            deterministic=deterministic,
        )
        assert_close_rel(loss, ref_loss, 1e-5, "ball-query loss")
        assert_close_rel(grad, ref_grad, 1e-3, "ball-query grad")


@pytest.mark.gpu
def test_gpu_ball_query_unbiased_large():
    x, truth, nuc, mask = make_structure(1, 1, 4000, seed=4, device="cuda", p_nuc=0.05)
    dense = smooth_lddt_reference(x, truth, nuc, mask, upcast=True)[0, 0].item()
    draws = torch.stack(
        [
            smooth_lddt_ball_query(x, truth, nuc, mask, max_neighbors=32, seed=s)[0, 0]
            for s in range(64)
        ]
    ).double()
    z = (draws.mean() - dense) / (draws.std() / 8)
    assert abs(z.item()) < 4.5
