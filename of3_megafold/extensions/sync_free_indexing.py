"""Sync-free indexing: OF3's token-to-atom broadcasts, per-residue atom tables and
cyclic-chain check without a host synchronisation at every call.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_sync_free_indexing``
(default false).

A training step of OF3 on the GPU stops the host to wait for the GPU some 380 times
(``torch.cuda.set_sync_debug_mode`` at 384 tokens, docs/benchmarks.md). Each stop
drains the queue of kernels the host had issued ahead, so the GPU's work and the
host's no longer overlap. Most stops come from three helpers that recompute a fact
about the batch at every call:

- ``broadcast_token_feat_to_atoms`` (about 50 calls a step: atom attention, the
  diffusion and confidence losses, the heads) takes the atom count from a tensor
  (``max_num_atoms``, an ``int``) and calls ``repeat_interleave`` without an output
  size: two or three stops per call;
- ``get_token_atom_index_offset`` (about 40 calls: representative atoms of the
  heads and losses) copies a per-residue table from a Python list to the GPU;
- ``apply_cyclic_offsets`` (every relative-position encoding: the input embedder,
  the diffusion conditioning of every diffusion-module call) asks
  ``cyclic_mask.any()``.

With a key on, the layout of a broadcast (the gather index of atoms into tokens and
the atom count) is computed once per ``token_mask`` and ``num_atoms_per_token``
tensor, feature batch shape and padding, and reused (:class:`TensorCache`: per
tensor object and version, so an in-place change recomputes it); the broadcast is
then OF3's masking and padding followed by ``index_select`` with that index, which
is how torch computes ``repeat_interleave`` itself, forward and backward. The atom
tables are kept on each device once. Whether a cyclic mask has any cyclic token is
cached the same way; a batch with cyclic chains runs OF3's function. Results are
OF3's, element for element.

The helpers are functions, not modules, so no module carries the key: they run the
kit's version while a live ``OpenFold3`` model has the key on for its current mode
(train or eval); the losses, which OF3 builds outside the model, follow it.
Data-pipeline modules that import the helpers keep OF3's (they run on CPU tensors
in the data workers).

Measured on one H200 at 384 tokens: 377 stops per training step with the key off,
81 with it on; the step's time moves within its noise
(docs/extensions/sync_free_indexing.md).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from of3_megafold import registry
from of3_megafold.runtime.tensor_cache import TensorCache

NAME = "sync_free_indexing"
FLAG = "use_sync_free_indexing"

_LAYOUTS = TensorCache()
"""Broadcast layouts: (gather index, atom count) per mask, counts and shape."""

_CYCLIC = TensorCache()
"""Whether a cyclic mask has any cyclic token, per mask."""

_MODELS: weakref.WeakSet = weakref.WeakSet()
"""Every ``OpenFold3`` model built while the kit is active."""


def enabled() -> bool:
    """Whether the helpers run the kit's versions now: forced, or a live model has
    the key on for its current mode."""
    if registry.forced_variant(NAME) is not None:
        return True
    return any(registry.module_flag(model, FLAG) for model in list(_MODELS))


def _broadcast_layout(
    token_mask: torch.Tensor,
    num_atoms_per_token: torch.Tensor,
    feat_batch_dims: torch.Size,
    max_num_atoms_per_token: int | None,
) -> tuple[torch.Tensor, int]:
    """OF3's per-token repeat counts, as the gather index they define and the atom
    count per batch row (one host synchronisation).

    Args:
        token_mask: ``[*, N_token]``.
        num_atoms_per_token: ``[*, N_token]`` atom counts.
        feat_batch_dims: the feature's dims before its token dim, ``*`` first.
        max_num_atoms_per_token: pad every token to this many atoms, or None.

    Returns:
        ``index``: ``[prod(feat_batch_dims) * n_atoms]`` int64 positions in OF3's
        flattened, padded token features (``[prod(feat_batch_dims) * (T + 1)]``,
        ``T`` the number of tokens after padding); ``n_atoms``, an ``int``.
    """
    n_token = token_mask.shape[-1]
    batch_dims = token_mask.shape[:-1]
    counts = num_atoms_per_token * token_mask.int()
    if max_num_atoms_per_token is not None:
        counts = torch.stack(
            [counts, max_num_atoms_per_token - counts], dim=-1
        ).reshape((*batch_dims, 2 * n_token))
    n_atoms = int(torch.max(torch.sum(counts, dim=-1)))
    counts = torch.concat(
        [counts, n_atoms - torch.sum(counts, dim=-1, keepdim=True)], dim=-1
    )
    if batch_dims != feat_batch_dims:  # OF3's repeat over the sample dim
        counts = counts.repeat(
            *((1,) * len(batch_dims[:-1]) + (feat_batch_dims[-1],) + (1,))
        )
    counts = counts.reshape(-1).int()
    rows = torch.arange(counts.numel(), device=counts.device)
    index = torch.repeat_interleave(
        rows, counts, output_size=math.prod(feat_batch_dims) * n_atoms
    )
    return index, n_atoms


def broadcast_token_feat_to_atoms(
    token_mask: torch.Tensor,
    num_atoms_per_token: torch.Tensor,
    token_feat: torch.Tensor,
    token_dim: int | None = -1,
    max_num_atoms_per_token: int | None = None,
) -> torch.Tensor:
    """OF3's ``broadcast_token_feat_to_atoms`` with its layout cached per batch.

    Args:
        token_mask: ``[*, N_token]`` token mask.
        num_atoms_per_token: ``[*, N_token]`` atoms per token.
        token_feat: ``[*', N_token, *feat]``, ``*'`` equal to ``*`` or ``*`` with a
            sample dim appended; the token dim at ``token_dim``.
        token_dim: the token dim of ``token_feat``.
        max_num_atoms_per_token: pad every token to this many atoms, or None.

    Returns:
        ``[*', N_atom, *feat]`` (``N_token * max_num_atoms_per_token`` atoms with
        padding), OF3's values and gradients.
    """
    n_token = token_mask.shape[-1]
    batch_dims = token_mask.shape[:-1]
    feat_batch_dims = token_feat.shape[:token_dim]
    feat_dims = token_feat.shape[token_dim:][1:]
    index, n_atoms = _LAYOUTS.get(
        (token_mask, num_atoms_per_token),
        (feat_batch_dims, max_num_atoms_per_token, token_feat.device),
        lambda: _broadcast_layout(
            token_mask, num_atoms_per_token, feat_batch_dims, max_num_atoms_per_token
        ),
    )
    # OF3's masking and padding of the features, then its repeat as a gather
    token_feat = token_feat * token_mask.reshape(
        (*batch_dims, n_token, *((1,) * len(feat_dims)))
    )
    if max_num_atoms_per_token is not None:
        token_feat = torch.stack(
            [token_feat, torch.zeros_like(token_feat)], dim=token_dim
        ).reshape((*batch_dims, 2 * n_token, *feat_dims))
    padded = torch.concat(
        [
            token_feat,
            torch.zeros(
                (*feat_batch_dims, 1, *feat_dims),
                dtype=token_feat.dtype,
                device=token_feat.device,
            ),
        ],
        dim=token_dim,
    ).reshape(-1, *feat_dims)
    atom_feat = torch.index_select(padded, 0, index)
    return atom_feat.reshape((*feat_batch_dims, n_atoms, *feat_dims))


@functools.cache
def _atom_table(atom_name: str, field: str, device: torch.device) -> torch.Tensor:
    """OF3's ``atom_name_to_index_by_restype[atom_name][field]`` as fp32 on
    ``device``, as ``get_token_atom_index_offset`` makes it at every call."""
    from openfold3.core.data.resources.token_atom_constants import (
        atom_name_to_index_by_restype,
    )

    values = atom_name_to_index_by_restype[atom_name][field]
    return torch.tensor(values, device=device).float()


def get_token_atom_index_offset(
    atom_name: str, restype: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OF3's ``get_token_atom_index_offset`` with its tables kept per device.

    Args:
        atom_name: the atom (``"CA"``, ``"C1'"``, ...).
        restype: ``[*, N_token, 32]`` one-hot residue types.

    Returns:
        ``[*, N_token]`` int64 atom offsets within each residue, and ``[*, N_token]``
        int64 masks of residues that have the atom.
    """
    restype = restype.float()
    offset = torch.einsum(
        "...k,k->...", restype, _atom_table(atom_name, "index", restype.device)
    ).long()
    mask = torch.einsum(
        "...k,k->...", restype, _atom_table(atom_name, "mask", restype.device)
    ).long()
    return offset, mask


def any_cyclic(cyclic_mask: torch.Tensor) -> bool:
    """``bool(cyclic_mask.any())``, once per mask tensor and version."""
    return _CYCLIC.get((cyclic_mask,), None, lambda: bool(cyclic_mask.any()))


def _patch_broadcast(original):
    def broadcast(
        token_mask,
        num_atoms_per_token,
        token_feat,
        token_dim=-1,
        max_num_atoms_per_token=None,
    ):
        run = broadcast_token_feat_to_atoms if enabled() else original
        return run(
            token_mask,
            num_atoms_per_token,
            token_feat,
            token_dim,
            max_num_atoms_per_token,
        )

    return broadcast


def _patch_atom_index_offset(original):
    def atom_index_offset(atom_name, restype):
        run = get_token_atom_index_offset if enabled() else original
        return run(atom_name, restype)

    return atom_index_offset


def _patch_cyclic_offsets(original):
    def apply_cyclic_offsets(offset, pos, cyclic_mask, asym_id):
        if cyclic_mask is not None and enabled() and not any_cyclic(cyclic_mask):
            return offset
        return original(
            offset=offset, pos=pos, cyclic_mask=cyclic_mask, asym_id=asym_id
        )

    return apply_cyclic_offsets


def _patch_model_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _MODELS.add(self)

    return __init__


_ATOMIZE = "openfold3.core.utils.atomize_utils"
# the model's and the losses' modules that import the helpers by name; the data
# pipeline's are left to OF3
_BROADCAST_USERS = (
    _ATOMIZE,
    "openfold3.core.model.heads.head_modules",
    "openfold3.core.model.layers.sequence_local_atom_attention",
    "openfold3.core.loss.diffusion",
    "openfold3.core.loss.confidence",
    "openfold3.core.metrics.quality",
    "openfold3.core.metrics.sample_ranking",
    "openfold3.core.utils.permutation_alignment",
)
_ATOM_INDEX_OFFSET_USERS = (_ATOMIZE, "openfold3.core.loss.confidence")

EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="compute OF3's token-to-atom broadcast layout, per-residue atom tables "
        "and cyclic-chain check once per batch tensor instead of at every call "
        "(host synchronisations; OF3's values)",
        summary="OF3's token-to-atom broadcasts, atom tables and cyclic-chain check "
        "without a host synchronisation at every call",
        patches=(
            *(
                registry.Patch(
                    f"{module}:broadcast_token_feat_to_atoms", _patch_broadcast
                )
                for module in _BROADCAST_USERS
            ),
            *(
                registry.Patch(
                    f"{module}:get_token_atom_index_offset", _patch_atom_index_offset
                )
                for module in _ATOM_INDEX_OFFSET_USERS
            ),
            registry.Patch(
                "openfold3.core.utils.relpos:apply_cyclic_offsets",
                _patch_cyclic_offsets,
            ),
            registry.Patch(
                "openfold3.projects.of3_all_atom.model:OpenFold3.__init__",
                _patch_model_init,
            ),
        ),
    )
)
