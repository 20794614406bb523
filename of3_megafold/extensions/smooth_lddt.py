"""Smooth lDDT backends for OF3's diffusion loss (dense, ball_query or fused), and
its bond loss from the bonded atom pairs alone.

Keys, under ``model_update.custom.architecture.loss_module.diffusion``:

- ``smooth_lddt_backend``: ``dense`` (OF3's ``smooth_lddt_loss``, untouched),
  ``fused`` (exact, O(N) memory, Triton) or ``ball_query`` (at most ``top_k``
  sampled neighbours per atom within the cutoff; unbiased estimate, Triton);
- ``smooth_lddt_top_k``: neighbours kept per atom by ``ball_query``;
- ``smooth_lddt_seed``: seed of the neighbour sampling. ``null`` draws each step's
  seed from torch's default generator (seeded by OF3's ``experiment_settings.seed``,
  so a run is reproducible); an integer ``s`` uses ``s + call index``;
- ``bond_loss_backend``: ``dense`` (OF3's ``bond_loss``: every pairwise distance,
  ``[B, S, N_atom, N_atom, 3]``) or ``pairs`` (the same value from the bonded
  polymer-ligand atom pairs only, plain torch: ``_bond_pairs``). At 768 tokens
  OF3's dense bond loss is the training step's memory peak.

OF3 passes these keys to ``diffusion_loss(**cfg)``, which accepts ``**kwargs``. The
patch of ``diffusion_loss`` reads them for the duration of the call; the patch of
``smooth_lddt_loss`` dispatches to the chosen kernel. OF3's ``chunk_size`` (the
``train`` preset sets 4) chunks the sample dimension under activation
checkpointing to bound the dense ``[S, N, N]`` memory; the Triton backends and the
``pairs`` bond loss need no chunking, so for them ``run_low_mem_loss_fn`` calls the
loss once on all samples (logged once).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from of3_megafold import registry
from of3_megafold.kernels.backend import runs_on, triton_backend

logger = logging.getLogger(__name__)

NAME = "smooth_lddt"
BACKENDS = ("dense", "ball_query", "fused")
_SECTION = ("architecture", "loss_module", "diffusion")

BACKEND_KEY = registry.ConfigKey(
    (*_SECTION, "smooth_lddt_backend"),
    "dense",
    "Smooth lDDT loss backend: dense (OF3's, O(N^2) memory), fused (exact, O(N) "
    "memory, Triton) or ball_query (top_k sampled neighbours within the cutoff, "
    "unbiased estimate, Triton).",
    choices=BACKENDS,
)
TOP_K_KEY = registry.ConfigKey(
    (*_SECTION, "smooth_lddt_top_k"),
    256,
    "ball_query: neighbours kept per atom (uniform sample when more are in radius).",
)
BOND_BACKENDS = ("dense", "pairs")
BOND_KEY = registry.ConfigKey(
    (*_SECTION, "bond_loss_backend"),
    "dense",
    "Bond loss: dense (OF3's, every pairwise atom distance of every sample) or "
    "pairs (the same value from the bonded polymer-ligand atom pairs only).",
    choices=BOND_BACKENDS,
)
SEED_KEY = registry.ConfigKey(
    (*_SECTION, "smooth_lddt_seed"),
    None,
    "ball_query: sampling seed; null = drawn each step from torch's generator "
    "(reproducible under OF3's seed), an integer s = s + call index.",
)


@dataclass(frozen=True)
class _Settings:
    backend: str = BACKEND_KEY.default
    top_k: int = TOP_K_KEY.default
    seed: int | None = SEED_KEY.default
    bond: str = BOND_KEY.default


_STOCK = _Settings()
_CURRENT: contextvars.ContextVar[_Settings | None] = contextvars.ContextVar(
    "of3_megafold_smooth_lddt", default=None
)
_CALLS = itertools.count()


@functools.cache
def _log_chunk_bypass(loss: str, backend: str, chunk_size: int) -> None:
    logger.info(
        "%s backend %s: diffusion chunk_size=%s is not needed (no N_atom^2 "
        "tensors); the loss runs once on all samples",
        loss,
        backend,
        chunk_size,
    )


def _settings() -> _Settings:
    forced = registry.forced_variant(NAME)
    current = _CURRENT.get() or _STOCK
    if forced is not None:  # forced on (OF3's tests): both losses the kit's way
        return _Settings(forced, current.top_k, current.seed, "pairs")
    return current


def _atom_inputs(batch: dict, loss_token_mask):
    """Per-atom inputs of the kernels from OF3's batch (as ``smooth_lddt_loss``)."""
    from openfold3.core.utils.atomize_utils import broadcast_token_feat_to_atoms

    def to_atoms(token_feat):
        return broadcast_token_feat_to_atoms(
            token_mask=batch["token_mask"],
            num_atoms_per_token=batch["num_atoms_per_token"],
            token_feat=token_feat,
        )

    truth = batch["ground_truth"]["atom_positions"]
    is_nucleotide = to_atoms(batch["is_dna"] + batch["is_rna"])
    atom_mask = to_atoms(loss_token_mask) * batch["ground_truth"]["atom_resolved_mask"]
    return truth, is_nucleotide, atom_mask


def kit_smooth_lddt_loss(x, batch: dict, loss_token_mask, eps: float, settings=None):
    """OF3's ``smooth_lddt_loss`` signature on the kit's Triton backends.

    Args:
        x: ``[B, S, N_atom, 3]`` predicted positions (``[B, N_atom, 3]`` is read as
            one sample).
        batch: OF3's feature dict (ground truth ``[B, 1, N_atom, 3]``).
        loss_token_mask: ``[B, 1, N_token]``.
        eps: OF3's eps.
        settings: backend choice; default the current call's.

    Returns:
        ``[B, S]`` (``[B]`` for 3-d ``x``) loss in ``x``'s float type.
    """
    from of3_megafold.kernels.smooth_lddt import (
        smooth_lddt_ball_query,
        smooth_lddt_fused,
    )

    settings = settings or _settings()
    truth, is_nucleotide, atom_mask = _atom_inputs(batch, loss_token_mask)
    single = x.dim() == 3
    if single:
        x = x.unsqueeze(1)
    truth = truth.reshape(x.shape[0], 1, *truth.shape[-2:])
    is_nucleotide = is_nucleotide.reshape(x.shape[0], -1)
    atom_mask = atom_mask.reshape(x.shape[0], -1)
    if settings.backend == "fused":
        loss = smooth_lddt_fused(x, truth, is_nucleotide, atom_mask, eps=eps)
    else:
        seed = None if settings.seed is None else settings.seed + next(_CALLS)
        loss = smooth_lddt_ball_query(
            x,
            truth,
            is_nucleotide,
            atom_mask,
            max_neighbors=settings.top_k,
            seed=seed,
            eps=eps,
        )
    loss = loss.to(x.dtype)
    return loss.squeeze(1) if single else loss


def _patch_smooth_lddt_loss(original):
    def smooth_lddt_loss(x, batch, loss_token_mask, eps):
        settings = _settings()
        if settings.backend != "dense":
            if runs_on(x):
                return kit_smooth_lddt_loss(x, batch, loss_token_mask, eps, settings)
            registry.log_device_fallback(NAME, x.device.type)  # CPU tensors, GPU box
        return original(x=x, batch=batch, loss_token_mask=loss_token_mask, eps=eps)

    return smooth_lddt_loss


def _patch_bond_loss(original):
    def bond_loss(x, batch, eps):
        if _settings().bond == "pairs":
            from ._bond_pairs import bonded_pair_bond_loss

            return bonded_pair_bond_loss(x, batch, eps)
        return original(x=x, batch=batch, eps=eps)

    return bond_loss


def _patch_diffusion_loss(original):
    def diffusion_loss(*args, **kwargs):
        settings = _Settings(*(kwargs.pop(key.path[-1], key.default) for key in (
            BACKEND_KEY, TOP_K_KEY, SEED_KEY, BOND_KEY)))
        token = _CURRENT.set(settings)
        try:
            return original(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return diffusion_loss


def _patch_run_low_mem_loss_fn(original):
    def run_low_mem_loss_fn(loss_fn, x, kwargs, chunk_size):
        from openfold3.core.loss import diffusion

        settings = _settings()
        if (loss_fn is diffusion.smooth_lddt_loss and settings.backend != "dense"
                and runs_on(x)):
            _log_chunk_bypass("smooth lDDT", settings.backend, chunk_size)
            return loss_fn(x=x, **kwargs)
        if loss_fn is diffusion.bond_loss and settings.bond == "pairs":
            _log_chunk_bypass("bond loss", settings.bond, chunk_size)
            return loss_fn(x=x, **kwargs)
        return original(loss_fn, x, kwargs, chunk_size)

    return run_low_mem_loss_fn


def _requested(config: Any) -> bool:
    return BACKEND_KEY.read(config) != "dense" or BOND_KEY.read(config) != "dense"


def _validate(config: Any) -> None:
    from of3_megafold.errors import KitConfigError

    top_k = TOP_K_KEY.read(config)
    if not isinstance(top_k, int) or top_k < 1:
        raise KitConfigError(
            f"{TOP_K_KEY.yaml_path}: {top_k!r} is not allowed; use an integer >= 1"
        )
    seed = SEED_KEY.read(config)
    if seed is not None and not isinstance(seed, int):
        raise KitConfigError(
            f"{SEED_KEY.yaml_path}: {seed!r} is not allowed; use null or an integer"
        )


_DIFFUSION = "openfold3.core.loss.diffusion"

EXTENSION = registry.register(
    registry.Extension(
        name=NAME,
        summary="Smooth lDDT and bond losses without the dense [S, N_atom, N_atom] "
        "tensors",
        keys=(BACKEND_KEY, TOP_K_KEY, SEED_KEY, BOND_KEY),
        requested=_requested,
        enable_update={
            "architecture": {
                "loss_module": {"diffusion": {"smooth_lddt_backend": "fused",
                                              "bond_loss_backend": "pairs"}}
            }
        },
        requires=("triton",),
        device_check=triton_backend,
        patches=(
            registry.Patch(f"{_DIFFUSION}:smooth_lddt_loss", _patch_smooth_lddt_loss),
            registry.Patch(f"{_DIFFUSION}:bond_loss", _patch_bond_loss),
            registry.Patch(f"{_DIFFUSION}:diffusion_loss", _patch_diffusion_loss),
            registry.Patch(
                "openfold3.core.loss.loss_module:diffusion_loss", _patch_diffusion_loss
            ),
            registry.Patch(
                f"{_DIFFUSION}:run_low_mem_loss_fn", _patch_run_low_mem_loss_fn
            ),
        ),
        validate=_validate,
        variants=("fused", "ball_query"),
        docs="docs/extensions/smooth_lddt.md",
    )
)
