"""Sync-free indexing: OF3's helpers against the kit's, element for element, and a
training step's host-synchronising ops counted with the key on and off.

On the CPU nothing synchronises, but the ops that do on the GPU are the same:
``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), ``nonzero`` and
``repeat_interleave`` without an output size. A dispatch mode records where in
OpenFold3 each is called from.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from of3_megafold import registry
from of3_megafold.extensions import sync_free_indexing

NAME = "sync_free_indexing"
FLAG = "use_sync_free_indexing"


def _of3(module: str, name: str):
    """OF3's own function, under any patch the kit installed."""
    import importlib

    fn = getattr(importlib.import_module(f"openfold3.core.utils.{module}"), name)
    return getattr(fn, "__wrapped__", fn)


def _batch(seed: int, batch: int = 2, n_token: int = 13):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 6, (batch, n_token), generator=generator).int()
    mask = (torch.rand(batch, n_token, generator=generator) > 0.25).float()
    mask[:, 0] = 1.0
    return mask, counts, generator


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_broadcasts_equal_of3s_values_and_gradients(kit, seed):
    of3 = _of3("atomize_utils", "broadcast_token_feat_to_atoms")
    mask, counts, generator = _batch(seed)
    n_token = mask.shape[-1]
    cases = [
        # integer token feature, token dim last
        dict(token_feat=torch.arange(n_token).repeat(2, 1)),
        # channels after the token dim
        dict(token_feat=torch.randn(2, n_token, 7, generator=generator), token_dim=-2),
        # every token padded to a fixed atom count (OF3's heads)
        dict(token_feat=mask, max_num_atoms_per_token=6),
    ]
    # OF3's diffusion batch: a singleton sample dim on the masks and counts, the
    # samples on the features
    sampled = dict(
        token_feat=torch.randn(2, 3, n_token, 5, generator=generator),
        token_dim=-2,
        token_mask=mask[:, None],
        num_atoms_per_token=counts[:, None],
    )
    for case in [*cases, sampled]:
        feat = case.pop("token_feat")
        case_mask = case.pop("token_mask", mask)
        case_counts = case.pop("num_atoms_per_token", counts)
        leaf = feat.clone().requires_grad_(feat.is_floating_point())
        expected = of3(case_mask, case_counts, leaf, **case)
        kit_leaf = feat.clone().requires_grad_(feat.is_floating_point())
        got = sync_free_indexing.broadcast_token_feat_to_atoms(
            case_mask, case_counts, kit_leaf, **case
        )
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)
        if leaf.requires_grad:
            weight = torch.randn(expected.shape, generator=generator)
            (expected * weight).sum().backward()
            (got * weight).sum().backward()
            assert torch.equal(kit_leaf.grad, leaf.grad)


def test_broadcast_layouts_are_reused_until_the_counts_change(kit):
    of3 = _of3("atomize_utils", "broadcast_token_feat_to_atoms")
    cache = sync_free_indexing._LAYOUTS
    mask, counts, generator = _batch(3)
    feat = torch.randn(2, mask.shape[-1], 4, generator=generator)
    misses = cache.misses
    for _ in range(3):
        sync_free_indexing.broadcast_token_feat_to_atoms(mask, counts, feat, -2)
    assert cache.misses == misses + 1
    counts[0, 1] += 2  # in place: a new layout
    got = sync_free_indexing.broadcast_token_feat_to_atoms(mask, counts, feat, -2)
    assert cache.misses == misses + 2
    assert torch.equal(got, of3(mask, counts, feat, -2))


@pytest.mark.parametrize("atom_name", ["CA", "C1'", "CB", "N"])
def test_atom_index_offsets_equal_of3s(kit, atom_name):
    of3 = _of3("atomize_utils", "get_token_atom_index_offset")
    generator = torch.Generator().manual_seed(4)
    restype = torch.nn.functional.one_hot(
        torch.randint(0, 32, (2, 11), generator=generator), 32
    ).float()
    for got, expected in zip(
        sync_free_indexing.get_token_atom_index_offset(atom_name, restype),
        of3(atom_name, restype),
        strict=True,
    ):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


def test_cyclic_offsets_skip_only_masks_without_cyclic_tokens(kit):
    from openfold3.core.utils import relpos

    registry.FORCED.variants[NAME] = ""
    try:
        pos = torch.arange(9)[None]
        asym = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
        offset = pos[..., None] - pos[..., None, :]
        linear = torch.zeros(1, 9, dtype=torch.bool)
        assert relpos.apply_cyclic_offsets(offset, pos, linear, asym) is offset
        cyclic = linear.clone()
        cyclic[0, 5:] = True  # the second chain is cyclic
        expected = _of3("relpos", "apply_cyclic_offsets")(offset, pos, cyclic, asym)
        got = relpos.apply_cyclic_offsets(offset, pos, cyclic, asym)
        assert not torch.equal(expected, offset)
        assert torch.equal(got, expected)
    finally:
        registry.FORCED.variants.pop(NAME, None)


class _SyncingOps(TorchDispatchMode):
    """Where in OpenFold3 (the innermost openfold3 frame: file:line and function)
    ops that stop the host on a GPU are called: ``.item()`` and friends,
    ``nonzero``, ``repeat_interleave`` without an output size."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        syncs = name in ("_local_scalar_dense", "nonzero") or (
            name == "repeat_interleave"
            and kwargs.get("output_size") is None
            and len(args) < 3
        )
        if syncs:
            frames = [f for f in traceback.extract_stack() if "openfold3" in f.filename]
            if frames:
                where = frames[-1]
                path = where.filename.split("openfold3/")[-1]
                self.sites[(f"{path}:{where.lineno}", where.name)] += 1
        return func(*args, **kwargs)


def _step_sites(on: bool) -> tuple[collections.Counter, float, float]:
    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    update = {"settings": {"memory": {"train": {FLAG: on}}}}
    harness = TrainingStepHarness("tiny", "stock", "cpu", num_recycles=1, update=update)
    batch = random_training_batch(24, 8, 2, harness.device)
    with _SyncingOps() as mode:
        result = harness.step(batch)
    return mode.sites, result.loss, result.grad_norm


HELPERS = (
    "broadcast_token_feat_to_atoms",
    "get_token_atom_index_offset",
    "apply_cyclic_offsets",
)


def test_a_training_step_keeps_its_losses_and_loses_the_helpers_syncs(kit):
    off, loss_off, norm_off = _step_sites(on=False)
    on, loss_on, norm_on = _step_sites(on=True)
    assert (loss_on, norm_on) == (loss_off, norm_off)

    def in_helpers(sites):
        return sum(n for (_, function), n in sites.items() if function in HELPERS)

    # OF3's helpers stop the host at every call; the kit's stop it once per batch
    # tensor, from the caller's frame (the kit's module is not OpenFold3's)
    assert in_helpers(off) >= 40, off
    assert in_helpers(on) == 0, on
    fills = sum(off.values()) - sum(on.values())
    assert fills >= in_helpers(off) - 8, (on, off)
