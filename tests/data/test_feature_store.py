"""EvoPipe: the feature store and the dataset adapter, on the demo set (CPU)."""

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from of3_megafold.data.dataset import training_dataset
from of3_megafold.data.feature_store import (
    FeatureStore,
    FeatureStoreError,
    build_feature_store,
    file_sha256,
    verify_feature_store,
)
from of3_megafold.demo.build import demo_dataset_paths
from of3_megafold.errors import user_message


@pytest.fixture(scope="module")
def paths(demo_dataset):
    return demo_dataset_paths(demo_dataset)


def _build(paths, out, **kwargs):
    return build_feature_store(
        paths["dataset_cache_file"],
        paths["target_structures_directory"],
        out,
        "npz",
        reference_mol_dir=paths["reference_molecule_directory"],
        progress=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def exact_store(paths, tmp_path_factory):
    return _build(paths, tmp_path_factory.mktemp("evopipe") / "store")


@pytest.fixture(scope="module")
def pooled_store(paths, tmp_path_factory):
    return _build(paths, tmp_path_factory.mktemp("evopipe") / "store", conformers=3)


def _dataset(paths, dataset_class, **config):
    return training_dataset(paths, dataset_class, 48, **config)


def _sample(dataset, index: int, seed: int) -> dict:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return dataset[index]


def _assert_same_layout(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert (value.shape, value.dtype) == (b[key].shape, b[key].dtype), key


INDICES = (0, 7, 31, 101, 199)


def test_store_samples_equal_stock_samples(paths, exact_store):
    stock = _dataset(paths, "WeightedPDBDataset")
    kit = _dataset(paths, "EvoPipeWeightedPDBDataset", feature_store=exact_store)
    assert len(kit) == len(stock)
    for seed, index in enumerate(INDICES):
        want, got = _sample(stock, index, seed), _sample(kit, index, seed)
        _assert_same_layout(want, got)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[key]), key
            elif isinstance(value, dict):
                for name, tensor in value.items():
                    assert torch.equal(tensor, got[key][name]), (key, name)
            else:
                assert value == got[key], key


def test_pooled_conformers_keep_the_features_and_come_from_the_pool(
    paths, pooled_store
):
    from openfold3.core.data.primitives.structure import conformer as of3_conformer

    stock = _dataset(paths, "WeightedPDBDataset")
    kit = _dataset(paths, "EvoPipeWeightedPDBDataset", feature_store=pooled_store)
    store = kit.feature_store
    assert store.pools and all(len(p.strategies) == 3 for p in store.pools.values())

    generated = {"stock": 0, "kit": 0}
    original = of3_conformer._compute_conformer
    current = ["stock"]

    def counting(*args, **kwargs):
        generated[current[0]] += 1
        return original(*args, **kwargs)

    of3_conformer._compute_conformer = counting
    try:
        for seed, index in enumerate(INDICES):
            current[0] = "stock"
            want = _sample(stock, index, seed)
            current[0] = "kit"
            got = _sample(kit, index, seed)
            _assert_same_layout(want, got)
            assert torch.isfinite(got["ref_pos"]).all()
    finally:
        of3_conformer._compute_conformer = original
    # Stock OF3 runs ETKDG for every component in every crop; with the pool, every
    # molecule of the demo set is known and none is generated.
    assert generated["stock"] > 0
    assert generated["kit"] == 0


def test_pooled_conformer_is_a_pool_member_under_any_atom_order(paths, pooled_store):
    from openfold3.core.data.io.structure.mol import read_single_annotated_sdf
    from openfold3.core.data.primitives.structure.labels import uniquify_ids
    from rdkit import Chem

    from of3_megafold.data.dataset import pooled_conformer
    from of3_megafold.data.feature_store import conformer_key

    store = FeatureStore.open(pooled_store)
    mol = read_single_annotated_sdf(paths["reference_molecule_directory"] + "/ARG.sdf")
    pool = store.pools[conformer_key(mol)]
    order = list(reversed(range(mol.GetNumAtoms())))
    shuffled = Chem.RenumberAtoms(mol, order)
    assert conformer_key(shuffled) == conformer_key(mol)
    random.seed(5)
    index = random.randrange(3)
    random.seed(5)
    result = pooled_conformer(pool, shuffled)
    positions = result.mol.GetConformer(result.conf_id).GetPositions()
    names = uniquify_ids([a.GetProp("annot_atom_name") for a in shuffled.GetAtoms()])
    where = {name: i for i, name in enumerate(pool.names)}
    expected = pool.coords[index][[where[n] for n in names]]
    np.testing.assert_allclose(positions, expected)
    assert result.strategy == pool.strategies[index]


def test_a_bad_structure_is_named_and_nothing_is_written(paths, tmp_path):
    structures = tmp_path / "structures"
    shutil.copytree(paths["target_structures_directory"], structures)
    victim = sorted(structures.iterdir())[3]
    (victim / f"{victim.name}.npz").write_bytes(b"not an npz")
    out = tmp_path / "store"
    with pytest.raises(FeatureStoreError, match=victim.name):
        build_feature_store(
            paths["dataset_cache_file"], structures, out, progress=False
        )
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["structures"]  # no staging left


@pytest.mark.parametrize("text", ["", "garbage\n", '{"structure_data": 1}'])
def test_a_foreign_dataset_cache_is_named_and_nothing_is_written(paths, tmp_path, text):
    cache = tmp_path / "cache.json"
    cache.write_text(text)
    out = tmp_path / "store"
    with pytest.raises(FeatureStoreError, match="cache.json: not an OF3 training"):
        build_feature_store(
            cache, paths["target_structures_directory"], out, progress=False
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_an_existing_store_is_replaced_only_with_force(paths, tmp_path):
    out = _build(paths, tmp_path / "store")
    with pytest.raises(FeatureStoreError, match="--force"):
        _build(paths, out)
    stamp = json.loads((out / "manifest.json").read_text())["created"]
    _build(paths, out, force=True, conformers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conformers"] == 1 and manifest["created"] >= stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_stale_or_foreign_stores_are_refused(paths, exact_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(exact_store, store)
    FeatureStore.open(store, paths["dataset_cache_file"])  # fine as built

    other_cache = tmp_path / "other_cache.json"
    other_cache.write_text(Path(paths["dataset_cache_file"]).read_text() + "\n")
    with pytest.raises(FeatureStoreError, match="another dataset cache"):
        FeatureStore.open(store, other_cache)

    manifest = json.loads((store / "manifest.json").read_text())
    manifest["openfold3"] = "0.0.1"
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match="openfold3 '0.0.1'.*precompute"):
        FeatureStore.open(store)

    with pytest.raises(FeatureStoreError, match="no feature store"):
        FeatureStore.open(tmp_path / "missing")

    pooled = tmp_path / "pooled"
    shutil.copytree(exact_store, pooled)
    manifest = json.loads((pooled / "manifest.json").read_text())
    manifest["conformers"] = 4  # claims a pool it does not have
    (pooled / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match="conformer pool .* cannot be read"):
        FeatureStore.open(pooled)
    with pytest.raises(FeatureStoreError, match="not in the feature store"):
        FeatureStore.open(exact_store).structure("9zzz")


def test_the_adapter_refuses_a_missing_store(paths, tmp_path):
    with pytest.raises(FeatureStoreError, match="no feature store"):
        _dataset(paths, "EvoPipeWeightedPDBDataset", feature_store=tmp_path / "missing")


def test_precompute_command(paths, tmp_path):
    from click.testing import CliRunner

    from of3_megafold.cli import main

    out = tmp_path / "store"
    args = [
        "precompute",
        "--dataset-cache", paths["dataset_cache_file"],
        "--structures", paths["target_structures_directory"],
        "--out", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "feature store written" in result.output
    assert FeatureStore.open(out).manifest["conformers"] == 0

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1 and "--force" in again.output
    pooled = CliRunner().invoke(main, [*args, "--force", "--conformers", "2"])
    assert pooled.exit_code == 1 and "--reference-mols" in pooled.output

    bare = CliRunner().invoke(main, ["precompute", "--out", str(out)])
    assert bare.exit_code == 2 and "needs --dataset-cache, --structures" in bare.output
    mixed = CliRunner().invoke(main, [*args, "--verify", str(out)])
    assert mixed.exit_code == 2 and "--verify checks a store" in mixed.output


def test_the_adapter_works_in_a_spawned_data_loader_worker(
    paths, pooled_store, tmp_path
):
    # A spawned worker starts a fresh interpreter: it unpickles the dataset (finding
    # the class through of3_megafold.data.dataset) and installs the store dispatch
    # itself, without the parent's activate().
    store = tmp_path / "store"
    shutil.copytree(pooled_store, store)
    kit = _dataset(paths, "EvoPipeWeightedPDBDataset", feature_store=store)
    pdb_id = kit.datapoint_cache.iloc[3]["pdb_id"]

    def load_one():
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(kit, [3]),
            batch_size=None,
            num_workers=1,
            multiprocessing_context="spawn",
        )
        (sample,) = list(loader)
        return sample

    sample = load_one()
    assert sample["pdb_id"] == pdb_id
    assert torch.isfinite(sample["ref_pos"]).all()
    # The worker really reads the store: with the entry broken, the sample fails.
    (store / "structures" / f"{pdb_id}.pkl").write_bytes(b"broken")
    with pytest.raises(FeatureStoreError, match=f"entry {pdb_id} .* is damaged") as err:
        load_one()
    # torch re-raises it with the worker's traceback in front; the CLI shows the
    # kit's own line only.
    assert "Original Traceback" in str(err.value)
    message = user_message(err.value)
    assert message.startswith(f"entry {pdb_id} of the feature store {store}")
    assert "\n" not in message and "--force" in message


def _damage(store: Path) -> dict[str, Path]:
    """Three kinds of damage to three entries: truncated, one byte flipped (same
    length), deleted."""
    entries = sorted((store / "structures").iterdir())
    truncated, flipped, deleted = entries[1], entries[4], entries[9]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    deleted.unlink()
    return {"truncated": truncated, "flipped": flipped, "deleted": deleted}


def test_the_manifest_records_every_file_with_its_checksum(exact_store):
    files = json.loads((exact_store / "manifest.json").read_text())["files"]
    entries = sorted(p for p in (exact_store / "structures").iterdir())
    assert sorted(files) == [f"structures/{p.name}" for p in entries]
    for path in entries:
        record = files[f"structures/{path.name}"]
        assert record == {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    assert verify_feature_store(exact_store) == []


def test_verify_names_each_damaged_entry(exact_store, tmp_path):
    from click.testing import CliRunner

    from of3_megafold.cli import main

    store = tmp_path / "store"
    shutil.copytree(exact_store, store)
    ok = CliRunner().invoke(main, ["precompute", "--verify", str(store)])
    assert ok.exit_code == 0, ok.output
    assert "every entry has its recorded size and SHA-256" in ok.output

    damaged = _damage(store)
    result = CliRunner().invoke(main, ["precompute", "--verify", str(store)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert f"{damaged['truncated']}: " in result.output
    assert f"{damaged['flipped']}: SHA-256 differs" in result.output
    assert f"{damaged['deleted']}: missing" in result.output
    assert len(lines) == 4 and lines[-1].startswith("Error: 3 damaged entries")
    # Sizes only: the flipped byte keeps the size and passes.
    assert len(verify_feature_store(store, checksums=False)) == 2


def test_the_dataset_checks_every_entry_before_training(paths, exact_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(exact_store, store)
    data = bytearray((store / "structures" / "2q2k.pkl").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (store / "structures" / "2q2k.pkl").write_bytes(bytes(data))
    dataset = "EvoPipeWeightedPDBDataset"
    _dataset(paths, dataset, feature_store=store)  # sizes agree: opens
    with pytest.raises(FeatureStoreError, match=r"2q2k\.pkl: SHA-256 differs"):
        _dataset(paths, dataset, feature_store=store, feature_store_verify="checksums")

    truncated = store / "structures" / "1ubq.pkl"
    truncated.write_bytes(truncated.read_bytes()[:10])
    with pytest.raises(FeatureStoreError) as error:
        _dataset(paths, dataset, feature_store=store)
    message = str(error.value)
    assert f"{truncated}: 10 bytes" in message and "\n" not in message
    assert f"precompute --verify {store}" in message


def test_a_second_writer_fails_at_once(paths, tmp_path):
    import fcntl

    out = tmp_path / "store"
    with open(tmp_path / ".store.lock", "a") as held:  # a first writer's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        for force in (False, True):
            with pytest.raises(FeatureStoreError, match="another .* is writing"):
                _build(paths, out, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store.lock"]  # the test's


def test_a_dead_writers_leftovers_are_removed(paths, tmp_path):
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f".store.partial-{finished.pid}"
    alive = tmp_path / f".store.partial-{os.getppid()}"
    for partial in (dead, alive):
        (partial / "structures").mkdir(parents=True)
        (partial / "structures" / "1abc.pkl").write_bytes(b"x" * 1000)
    (tmp_path / ".store.lock").write_text("")  # a killed writer's, no longer locked
    out = _build(paths, tmp_path / "store")
    assert not dead.exists()
    assert alive.exists()  # its process still runs: not ours to delete
    assert verify_feature_store(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "store"])


def test_an_out_that_cannot_be_created_is_one_error(paths, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("")
    with pytest.raises(FeatureStoreError, match="a-file is a regular file"):
        _build(paths, regular / "store")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]
