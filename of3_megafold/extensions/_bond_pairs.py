"""OF3's bond loss (AF3 eq. 5) from the bonded atom pairs alone.

OF3's ``bond_loss`` forms every pairwise distance, ``[B, S, N_atom, N_atom, 3]``, to
keep the few polymer-ligand bonds. Under OF3's ``train`` preset (diffusion loss in
chunks of 4 samples under activation checkpointing) that chunk is the training
step's memory peak at 768 tokens (docs/extensions/smooth_lddt.md).
Here the bonded pairs are listed from the token-level bond mask first,
then only their distances are formed: ``[B, S, P]`` for ``P`` bonded atom pairs.
"""

from __future__ import annotations

import torch


def _bonded_atom_pairs(token_bond_mask: torch.Tensor, atoms_per_token: torch.Tensor):
    """Atom index pairs ``(i, j)`` of every nonzero ``token_bond_mask[t, u]``: each
    atom of token ``t`` with each atom of token ``u``, atoms numbered token by token.

    Args:
        token_bond_mask: ``[N_token, N_token]``, zero for masked tokens.
        atoms_per_token: ``[N_token]`` atom counts (zero for masked tokens).

    Returns:
        Two ``[P]`` int64 tensors.
    """
    counts = atoms_per_token.long()
    starts = torch.cumsum(counts, 0) - counts
    t, u = torch.nonzero(token_bond_mask, as_tuple=True)
    n_t, n_u = counts[t], counts[u]
    per_pair = n_t * n_u
    pair = torch.repeat_interleave(torch.arange(t.numel(), device=t.device), per_pair)
    first = torch.cumsum(per_pair, 0) - per_pair
    k = torch.arange(pair.numel(), device=t.device) - first[pair]
    i = starts[t][pair] + torch.div(k, n_u[pair], rounding_mode="floor")
    j = starts[u][pair] + k % n_u[pair]
    return i, j


def bonded_pair_bond_loss(x: torch.Tensor, batch: dict, eps: float) -> torch.Tensor:
    """OF3's ``bond_loss(x, batch, eps)``, the same value without ``N_atom^2`` tensors.

    Args:
        x: ``[B, S, N_atom, 3]`` predicted positions (``[B, N_atom, 3]``: one sample).
        batch: OF3's feature dict, token features ``[B, 1, N_token]``, ground truth
            ``[B, 1, N_atom, 3]`` (a ``[B, ...]`` batch without the sample dim too).
        eps: OF3's eps, inside the square root and the denominator.

    Returns:
        ``[B, S]`` (``[B]`` for 3-d ``x``): the mean squared error of the bonded
        distances, 0 where there is no resolved polymer-ligand bond.
    """
    single = x.dim() == 3
    if single:
        x = x.unsqueeze(1)
    n_batch = x.shape[0]

    def per_batch(t: torch.Tensor, trailing: int) -> torch.Tensor:
        return t.reshape(n_batch, *t.shape[t.dim() - trailing:])

    token_mask = per_batch(batch["token_mask"], 1)
    atoms_per_token = per_batch(batch["num_atoms_per_token"], 1) * token_mask.int()
    is_polymer = per_batch(batch["is_protein"] + batch["is_dna"] + batch["is_rna"], 1)
    is_ligand = per_batch(batch["is_ligand"], 1)
    token_bonds = per_batch(batch["token_bonds"], 2)
    truth = per_batch(batch["ground_truth"]["atom_positions"], 2)
    resolved = per_batch(batch["ground_truth"]["atom_resolved_mask"], 1)
    losses = []
    for b in range(n_batch):
        tm = token_mask[b]
        bond_mask = (token_bonds[b] * is_ligand[b][:, None] * is_polymer[b][None, :]
                     * tm[:, None] * tm[None, :])
        i, j = _bonded_atom_pairs(bond_mask, atoms_per_token[b])
        keep = (resolved[b][i] * resolved[b][j]) != 0
        i, j = i[keep], j[keep]
        d = torch.sqrt(eps + ((x[b][:, i] - x[b][:, j]) ** 2).sum(-1))  # [S, P]
        d_true = torch.sqrt(eps + ((truth[b][i] - truth[b][j]) ** 2).sum(-1))  # [P]
        losses.append(((d - d_true) ** 2).sum(-1) / (i.numel() + eps))
    loss = torch.stack(losses)
    return loss.squeeze(1) if single else loss
