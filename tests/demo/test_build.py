"""The demo set: what it holds, and that its build is atomic and versioned."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from of3_megafold.demo import build
from of3_megafold.demo.build import (
    DemoSourceMissingError,
    demo_dir_name,
    demo_stamp,
    ensure_demo_dataset,
    read_stamp,
)


def test_demo_set_is_a_complete_of3_training_set(demo_dataset):
    from biotite.structure.io.pdbx import CIFFile
    from openfold3.core.data.io.dataset_cache import read_datacache
    from openfold3.core.data.primitives.caches.format import ClusteredDatasetCache

    assert demo_dataset.name == demo_dir_name()
    assert read_stamp(demo_dataset) == demo_stamp()

    cache = read_datacache(demo_dataset / build.DATASET_CACHE_FILE)
    assert isinstance(cache, ClusteredDatasetCache)
    shipped = sorted(p.stem for p in build.find_demo_sources().mmcifs)
    assert sorted(cache.structure_data) == shipped  # all 15 survive preprocessing

    ccd = CIFFile.read(str(demo_dataset / build.CCD_FILE))
    for pdb_id, entry in cache.structure_data.items():
        assert (
            demo_dataset / build.STRUCTURES_DIR / pdb_id / f"{pdb_id}.npz"
        ).is_file()
        for chain in entry.chains.values():
            assert chain.cluster_size >= 1
            if chain.reference_mol_id is not None:
                sdf = (
                    demo_dataset
                    / build.REFERENCE_MOLS_DIR
                    / f"{chain.reference_mol_id}.sdf"
                )
                assert sdf.is_file()
            if chain.molecule_type.upper() in ("PROTEIN", "RNA"):
                msa_dir = (
                    demo_dataset
                    / build.ALIGNMENTS_DIR
                    / chain.alignment_representative_id
                )
                assert any(msa_dir.glob("*.a3m")) or any(msa_dir.glob("*.sto"))
            else:
                assert chain.alignment_representative_id is None
        for interface in entry.interfaces.values():
            assert interface.cluster_size >= 1

    # 2q2k's protein chains use the MSAs shipped for them, with real hits.
    reps = {
        c.alignment_representative_id
        for c in cache.structure_data["2q2k"].chains.values()
        if c.molecule_type.upper() == "PROTEIN"
    }
    assert reps and reps <= set(build.SHIPPED_MSA_ENTRIES)
    hits = demo_dataset / build.ALIGNMENTS_DIR / reps.pop() / "uniref90_hits.sto"
    assert hits.read_text().count("\n") > 10
    # The residues of every structure are in the written components.cif.
    assert {"ALA", "GLY", "HOH", "DA", "MSE"} <= set(ccd.keys())


def test_a_built_set_is_reused(demo_dataset, monkeypatch):
    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt a set whose stamp matches")

    monkeypatch.setattr(build, "_build_into", must_not_build)
    assert ensure_demo_dataset(demo_dataset.parent, progress=False) == demo_dataset


def test_interrupted_build_leaves_nothing_and_next_build_succeeds(
    tmp_path, monkeypatch
):
    target = tmp_path / demo_dir_name()
    # A build killed outright (no cleanup ran) left its staging dir behind.
    abandoned = tmp_path / f"{build._BUILD_PREFIX}{target.name}-999999999-x"
    (abandoned / "structure_files").mkdir(parents=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the last step, after preprocessing

    monkeypatch.setattr(build, "_write_dataset_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_dataset(tmp_path, progress=False)
    assert not target.exists()
    # Staging dirs removed, ours and the abandoned one; only the lock file stays.
    assert [p.name for p in tmp_path.iterdir()] == [".build.lock"]

    monkeypatch.undo()
    assert ensure_demo_dataset(tmp_path, progress=False) == target
    assert read_stamp(target) == demo_stamp()
    assert (target / build.DATASET_CACHE_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.lock", target.name]


def test_version_change_triggers_rebuild(tmp_path, monkeypatch):
    """A set stamped by other versions is replaced; one with ours is kept.

    The builder is stubbed (a real build is covered above): this checks the
    decision to rebuild and the swap of the old set for the new one.
    """
    builds = []

    def stub_build(staging: Path, sources, *, progress):
        builds.append(staging)
        (staging / "built-by-test").write_text(str(len(builds)))
        return {"structures": 0, "chains": 0, "build_seconds": 0.0, "source": ""}

    monkeypatch.setattr(build, "_build_into", stub_build)
    target = ensure_demo_dataset(tmp_path, progress=False)
    assert len(builds) == 1

    ensure_demo_dataset(tmp_path, progress=False)
    assert len(builds) == 1

    stamp_file = target / build.STAMP_FILE
    old = json.loads(stamp_file.read_text())
    old["stamp"]["openfold3"] = "0.4.1"
    stamp_file.write_text(json.dumps(old))
    (target / "left-by-old-version").write_text("")

    assert ensure_demo_dataset(tmp_path, progress=False) == target
    assert len(builds) == 2
    assert read_stamp(target) == demo_stamp()
    assert (target / "built-by-test").read_text() == "2"
    assert not (target / "left-by-old-version").exists()

    ensure_demo_dataset(tmp_path, force=True, progress=False)
    assert len(builds) == 3


def test_concurrent_builds_build_once(tmp_path, monkeypatch):
    builds = []

    def slow_stub_build(staging: Path, sources, *, progress):
        builds.append(staging)
        time.sleep(0.5)
        return {"structures": 0, "chains": 0, "build_seconds": 0.5, "source": ""}

    monkeypatch.setattr(build, "_build_into", slow_stub_build)
    with ThreadPoolExecutor(2) as pool:
        targets = list(
            pool.map(lambda _: ensure_demo_dataset(tmp_path, progress=False), [0, 1])
        )
    assert targets[0] == targets[1]
    assert len(builds) == 1


def test_cache_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path / "elsewhere"))
    assert build.default_cache_root() == tmp_path / "elsewhere"


def test_missing_test_data_names_what_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "mmcifs").mkdir()
    monkeypatch.setenv(build.SOURCE_ENV_VAR, str(tmp_path))
    with pytest.raises(DemoSourceMissingError) as error:
        ensure_demo_dataset(tmp_path / "cache", progress=False)
    message = str(error.value)
    assert str(tmp_path / "mmcifs") in message
    assert str(tmp_path / "alignments" / "2q2k_A") in message
    assert "pip install --force-reinstall" in message
    assert build.SOURCE_ENV_VAR in message
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


def test_missing_biotite_ccd_names_the_fix(tmp_path, monkeypatch):
    from biotite.structure.info import ccd

    def no_ccd():
        raise RuntimeError("Internal CCD not found.")

    monkeypatch.setattr(ccd, "get_ccd", no_ccd)
    with pytest.raises(DemoSourceMissingError, match="biotite.setup_ccd"):
        ensure_demo_dataset(tmp_path, progress=False)


def _unwritable_caches(tmp_path: Path) -> dict[str, Path]:
    """Cache roots no process can write, root included: a regular file, a path
    under one, a path in /proc."""
    regular = tmp_path / "a-file"
    regular.write_text("")
    return {
        "regular file": regular,
        "under a regular file": regular / "cache",
        "/proc": Path("/proc/of3-megafold-cache"),
    }


@pytest.mark.parametrize("case", ["regular file", "under a regular file", "/proc"])
def test_an_unwritable_cache_is_one_error_naming_path_cause_and_fix(
    tmp_path, monkeypatch, case
):
    root = _unwritable_caches(tmp_path)[case]
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(root))
    with pytest.raises(build.DemoCacheError) as error:
        ensure_demo_dataset(progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert str(root) in message
    assert f"${build.CACHE_ENV_VAR}" in message  # where the path came from
    assert f"set {build.CACHE_ENV_VAR} to a writable directory" in message
    if case != "/proc":
        assert f"{tmp_path / 'a-file'} is a regular file" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_read_only_cache_is_one_error(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("chmod does not stop root from writing (the other cases do)")
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(build.DemoCacheError, match="Permission denied"):
            ensure_demo_dataset(root, progress=False)
    finally:
        root.chmod(0o700)
    assert list(root.iterdir()) == []


def test_a_finished_set_in_a_read_only_cache_is_still_used(demo_dataset, monkeypatch):
    """Only building needs a writable cache: reusing a set writes nothing."""

    def no_writes(*args, **kwargs):
        raise AssertionError("tried to lock or write the cache")

    monkeypatch.setattr(build, "_build_lock", no_writes)
    assert ensure_demo_dataset(demo_dataset.parent, progress=False) == demo_dataset
