"""The smooth lDDT extension inside OF3's diffusion loss, against OF3's dense path."""

import copy

import pytest
import torch

from of3_megafold import activate, deactivate, registry
from of3_megafold.errors import KitConfigError


@pytest.fixture
def kernel_calls(monkeypatch, interpreted_kernels):
    """Calls of the kit's smooth lDDT (a list, one per call)."""
    from of3_megafold.extensions import smooth_lddt as extension

    calls = []
    kit_loss = extension.kit_smooth_lddt_loss

    def counted(*args, **kwargs):
        calls.append(1)
        return kit_loss(*args, **kwargs)

    monkeypatch.setattr(extension, "kit_smooth_lddt_loss", counted)
    return calls


def _batch_and_x(n_sample=3, seed=0):
    from openfold3.tests.test_diffusion_loss import TestDiffusionLoss

    torch.manual_seed(seed)
    batch = TestDiffusionLoss().setup_features()
    # Spread the atoms so both cutoffs (15 A, 30 A for nucleotide rows) matter.
    batch["ground_truth"]["atom_positions"] *= 12.0
    truth = batch["ground_truth"]["atom_positions"]
    x = truth.repeat(1, n_sample, 1, 1) + torch.randn(1, n_sample, truth.shape[-2], 3)
    return batch, x.double().requires_grad_(True)


def _diffusion_cfg(backend=None, chunk_size=None, **extra):
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    custom = {
        "architecture": {"loss_module": {"diffusion": {"chunk_size": chunk_size}}}
    }
    section = custom["architecture"]["loss_module"]["diffusion"]
    if backend is not None:
        section.update(smooth_lddt_backend=backend)
    section.update(extra)
    config = OF3ProjectEntry().get_model_config_with_update(ModelUpdate(custom=custom))
    return dict(config.architecture.loss_module.diffusion)


def _loss(batch, x, cfg):
    from openfold3.core.loss.loss_module import diffusion_loss

    t = torch.full((1,), 4.0, dtype=x.dtype)
    batch = copy.deepcopy(batch)
    total, breakdown = diffusion_loss(batch=batch, x=x, t=t, **cfg)
    (grad,) = torch.autograd.grad(total, x)
    return total.detach(), breakdown["smooth_lddt_loss"].detach(), grad


@pytest.mark.parametrize("backend", ["fused", "ball_query"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_backend_matches_dense_inside_diffusion_loss(
    kit, kernel_calls, backend, chunk_size
):
    batch, x = _batch_and_x()
    x32 = x.detach().float().requires_grad_(True)
    dense = _loss(batch, x32, _diffusion_cfg(chunk_size=chunk_size))
    assert kernel_calls == []
    # K = 64 >= every atom's in-radius count (55 atoms): ball_query is exact here.
    extra = {"smooth_lddt_top_k": 64} if backend == "ball_query" else {}
    kit_result = _loss(batch, x32, _diffusion_cfg(backend, chunk_size, **extra))
    assert kernel_calls == [1]  # the kit's loss ran, once, whatever the chunking
    assert dense[1] > 0
    torch.testing.assert_close(kit_result[1], dense[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kit_result[0], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kit_result[2], dense[2], rtol=1e-4, atol=1e-6)


def test_dense_backend_is_ofs_function(kit):
    from openfold3.core.loss import diffusion

    original = diffusion.smooth_lddt_loss.__wrapped__
    batch, x = _batch_and_x()
    mask = torch.ones_like(batch["is_protein"])
    expected = original(x=x, batch=batch, loss_token_mask=mask, eps=1e-8)
    got = diffusion.smooth_lddt_loss(x=x, batch=batch, loss_token_mask=mask, eps=1e-8)
    assert torch.equal(got, expected)


def test_forced_backend_applies_without_config(kit, kernel_calls):
    from openfold3.core.loss import diffusion

    batch, x = _batch_and_x()
    mask = torch.ones_like(batch["is_protein"])
    x32 = x.detach().float()
    dense = diffusion.smooth_lddt_loss(
        x=x32, batch=batch, loss_token_mask=mask, eps=1e-8
    )
    activate(force=["smooth_lddt"])
    assert registry.forced_variant("smooth_lddt") == "fused"
    assert kernel_calls == []
    fused = diffusion.smooth_lddt_loss(
        x=x32, batch=batch, loss_token_mask=mask, eps=1e-8
    )
    assert kernel_calls == [1]
    torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-6)


def test_bad_values_are_rejected(kit):
    with pytest.raises(KitConfigError, match="'dense', 'ball_query', 'fused'"):
        _diffusion_cfg("bal_query")
    with pytest.raises(KitConfigError, match="smooth_lddt_top_k"):
        _diffusion_cfg("ball_query", smooth_lddt_top_k=0)


def test_deactivate_restores_ofs_functions():
    from openfold3.core.loss import diffusion, loss_module

    activate()
    assert hasattr(diffusion.smooth_lddt_loss, "__wrapped__")
    deactivate()
    assert not hasattr(diffusion.smooth_lddt_loss, "__wrapped__")
    assert not hasattr(loss_module.diffusion_loss, "__wrapped__")
    activate()


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_cpu_tensors_take_dense_path_without_the_interpreter(
    kit, monkeypatch, chunk_size
):
    """On a GPU machine without the interpreter the kernels cannot take CPU tensors
    (OF3's CPU tests run there too): a kit backend falls back to OF3's dense loss,
    chunking included."""
    from of3_megafold.extensions import smooth_lddt

    batch, x = _batch_and_x()
    x32 = x.detach().float().requires_grad_(True)
    dense = _loss(batch, x32, _diffusion_cfg(chunk_size=chunk_size))
    cfg = _diffusion_cfg("fused", chunk_size)  # checked while the kernels can run
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def kernel_called(*args, **kwargs):
        raise AssertionError("a kernel backend ran on CPU tensors")

    monkeypatch.setattr(smooth_lddt, "kit_smooth_lddt_loss", kernel_called)
    fallback = _loss(batch, x32, cfg)
    for got, want in zip(fallback, dense, strict=True):
        assert torch.equal(got, want)


def _bond_batch(seed=0):
    """OF3's diffusion-loss test batch (3 one-atom ligand tokens bonded to every
    polymer token: 156 atom pairs) with a few atoms unresolved."""
    batch, x = _batch_and_x(seed=seed)
    resolved = batch["ground_truth"]["atom_resolved_mask"]
    resolved[..., [1, 7, 40]] = 0.0
    return batch, x


@pytest.mark.parametrize("layout", ["sampled", "one_sample"])
def test_bond_pairs_match_ofs_dense_bond_loss(kit, layout):
    from openfold3.core.loss import diffusion

    from of3_megafold.extensions._bond_pairs import bonded_pair_bond_loss

    dense_fn = diffusion.bond_loss.__wrapped__
    batch, x = _bond_batch()
    if layout == "one_sample":  # [B, N_atom, 3] and the batch without a sample dim
        x = x[:, 0].detach().requires_grad_(True)
        batch = {k: (v.squeeze(1) if torch.is_tensor(v) else
                     {kk: vv.squeeze(1) for kk, vv in v.items()})
                 for k, v in batch.items()}
    dense = dense_fn(x=x, batch=batch, eps=1e-8)
    pairs = bonded_pair_bond_loss(x, batch, 1e-8)
    assert pairs.shape == dense.shape and (dense > 0).all()
    torch.testing.assert_close(pairs, dense, rtol=1e-10, atol=1e-12)
    (g_dense,) = torch.autograd.grad(dense.sum(), x)
    (g_pairs,) = torch.autograd.grad(bonded_pair_bond_loss(x, batch, 1e-8).sum(), x)
    assert g_dense.abs().max() > 0
    torch.testing.assert_close(g_pairs, g_dense, rtol=1e-10, atol=1e-12)


def test_bond_pairs_without_bonds_is_zero(kit):
    from of3_megafold.extensions._bond_pairs import bonded_pair_bond_loss

    batch, x = _bond_batch()
    batch["is_ligand"] = torch.zeros_like(batch["is_ligand"])
    loss = bonded_pair_bond_loss(x, batch, 1e-8)
    assert loss.shape == x.shape[:2] and (loss == 0).all()


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_bond_backend_inside_diffusion_loss(kit, monkeypatch, chunk_size):
    from of3_megafold.extensions import _bond_pairs

    calls = []
    pair_loss = _bond_pairs.bonded_pair_bond_loss
    monkeypatch.setattr(_bond_pairs, "bonded_pair_bond_loss",
                        lambda *a: calls.append(1) or pair_loss(*a))
    batch, x = _bond_batch()
    x = x.detach().float().requires_grad_(True)  # OF3's rigid alignment: fp32

    def bond(cfg):
        from openfold3.core.loss.loss_module import diffusion_loss

        t = torch.full((1,), 4.0, dtype=x.dtype)
        total, breakdown = diffusion_loss(batch=copy.deepcopy(batch), x=x, t=t, **cfg)
        (grad,) = torch.autograd.grad(total, x)
        return total.detach(), breakdown["bond_loss"].detach(), grad

    dense = bond(_diffusion_cfg(chunk_size=chunk_size))
    assert calls == []
    pairs = bond(_diffusion_cfg(chunk_size=chunk_size, bond_loss_backend="pairs"))
    assert calls == [1]  # once, whatever the chunking
    assert dense[1] > 0
    for got, want in zip(pairs, dense, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(KitConfigError, match="'dense', 'pairs'"):
        _diffusion_cfg(bond_loss_backend="sparse")
