"""EvoPipe's feature store: the deterministic part of OF3's structure pipeline, once.

For every structure in an OF3 dataset cache, OF3's training ``__getitem__`` repeats
the same work before it draws anything at random (``process_target_structure_of3``):
read the preprocessed structure, mark its components from the cache's chain metadata,
tokenize. :func:`build_feature_store` runs those steps once per structure with OF3's
own functions and pickles the tokenized ``AtomArray``; the dataset adapter in
:mod:`of3_megafold.data.dataset` loads it and runs only what follows (cropping and
everything after it), so a sample is the same as stock OF3's for the same random state.

The costliest step of a sample is random: a fresh RDKit ETKDG conformer for every
component in the crop (standard residues included; about 60% of ``__getitem__`` on
the demo set). With ``conformers=P > 0`` the store also holds, for every reference
molecule, P conformers generated once by OF3's own ``multistrategy_compute_conformer``
(same strategies and timeouts, seeds 0..P-1), and the adapter draws one of them
uniformly (Python's ``random``, as OF3 draws its ETKDG seeds) instead of generating a
new one. That changes the sampling: a pool of P conformers per molecule instead of a
new one each time; a failed generation keeps OF3's fallback conformer, as in OF3.

Store layout (a directory)::

    manifest.json           format version, openfold3 / kit versions, the structure
                            format, the dataset cache's SHA-256, the PDB IDs, P, and
                            every file's size and SHA-256
    structures/<pdb>.pkl    the tokenized AtomArray of one structure
    conformers.pkl          (P > 0) {(canonical SMILES, atom names): pool}

The store is built in a sibling staging directory ``.<store>.partial-<pid>`` and moved
into place in one ``os.replace``: an interrupted or failed build leaves no store (and
any previous store untouched until the new one is complete). One writer at a time
holds an exclusive lock on ``.<store>.lock`` beside the store (deleted when it is
done); a second fails at once.
The next writer removes the staging directory of a writer that was killed outright
(SIGKILL, power loss), once that process is gone.

Every open of the store (:meth:`FeatureStore.open`) checks each file's size against
the manifest, and on request its SHA-256; :func:`verify_feature_store` checks both
(``of3-megafold precompute --verify``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from of3_megafold._files import replace_directory
from of3_megafold.errors import KitError, unwritable_cause

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
STRUCTURES = "structures"
CONFORMERS = "conformers.pkl"
VERIFY_MODES = ("sizes", "checksums")
"""What :meth:`FeatureStore.open` checks of every file: its size (a stat per
file), or also its SHA-256 (reads the whole store)."""


class FeatureStoreError(KitError, RuntimeError):
    """A feature store is missing, stale, incomplete or cannot be built."""


def _stamp() -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "openfold3": version("openfold3"),
        "of3_megafold": version("of3-megafold"),
    }


def file_sha256(path: Path) -> str:
    """SHA-256 of one file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dataset_cache_digest(path: Path | str) -> str:
    """SHA-256 of a dataset cache: the JSON file, or every file of an LMDB directory
    (names and bytes, in sorted order)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = (
        sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    )
    for file in files:
        digest.update(
            str(file.relative_to(path) if path.is_dir() else file.name).encode()
        )
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def tokenized_structure(
    structures_dir: Path, pdb_id: str, structure_format: str, chain_metadata: Any
):
    """The deterministic head of OF3's ``process_target_structure_of3``: parse the
    preprocessed structure, drop the legacy ``sym_id = -1`` annotation as OF3 does,
    mark the components from the cache's chain metadata, tokenize."""
    import numpy as np
    from openfold3.core.data.io.structure.cif import parse_target_structure
    from openfold3.core.data.primitives.structure.component import (
        assign_component_ids_from_metadata,
    )
    from openfold3.core.data.primitives.structure.tokenization import (
        tokenize_atom_array,
    )

    atom_array = parse_target_structure(Path(structures_dir), pdb_id, structure_format)
    if "sym_id" in atom_array.get_annotation_categories() and np.any(
        atom_array.sym_id == -1
    ):
        atom_array.del_annotation("sym_id")
    assign_component_ids_from_metadata(atom_array, chain_metadata)
    tokenize_atom_array(atom_array=atom_array)
    return atom_array


def atom_names(mol: Any) -> list[str]:
    """A reference molecule's atom names in its atom order, uniquified as OF3 does
    (``get_processed_reference_conformer``): how atoms are matched across orders."""
    from openfold3.core.data.primitives.structure.labels import uniquify_ids

    return uniquify_ids([atom.GetProp("annot_atom_name") for atom in mol.GetAtoms()])


def conformer_key(mol: Any) -> tuple[str, tuple[str, ...]]:
    """How the pool finds a molecule again: its canonical SMILES and its sorted
    atom names, which survive OF3's atom renumbering."""
    from rdkit import Chem

    return Chem.MolToSmiles(mol), tuple(sorted(atom_names(mol)))


# OF3's per-strategy timeouts in get_processed_reference_conformer (0.5.0).
_CONFORMER_TIMEOUTS = {
    "default": 10.0,
    "small_ring_torsions": 10.0,
    "random_init": 10.0,
}


@dataclass(frozen=True)
class ConformerPool:
    """P conformers of one molecule, by uniquified atom name.

    Attributes:
        names: ``[n]`` atom names (uniquified, the stored molecule's order).
        coords: ``[P, n, 3]`` float64 (a failed generation: all NaN).
        strategies: ``[P]`` OF3 strategy that produced each, ``None`` if it failed.
    """

    names: tuple[str, ...]
    coords: Any
    strategies: tuple[str | None, ...]


def _conformer_pool(mol: Any, start_from: str, size: int) -> ConformerPool:
    import random

    import numpy as np
    from func_timeout import FunctionTimedOut
    from openfold3.core.data.primitives.structure.conformer import (
        ConformerGenerationError,
        multistrategy_compute_conformer,
    )

    names = tuple(atom_names(mol))
    coords = np.full((size, len(names), 3), np.nan)
    strategies: list[str | None] = []
    state = random.getstate()
    try:
        for index in range(size):
            random.seed(index)  # OF3 draws each ETKDG seed from Python's random
            try:
                result = multistrategy_compute_conformer(
                    mol, remove_hs=True, start_from=start_from,
                    timeouts=_CONFORMER_TIMEOUTS,
                )  # fmt: skip
            except (ConformerGenerationError, FunctionTimedOut):
                strategies.append(None)  # OF3 keeps the fallback conformer there
                continue
            out = result.mol
            positions = out.GetConformer(result.conf_id).GetPositions()
            where = {name: i for i, name in enumerate(atom_names(out))}
            coords[index] = positions[[where[name] for name in names]]
            strategies.append(result.strategy)
    finally:
        random.setstate(state)
    return ConformerPool(names, coords, tuple(strategies))


def _build_conformer_pools(
    cache: Any, reference_mol_dir: Path, size: int, progress: bool
) -> dict:
    from openfold3.core.data.io.structure.mol import read_single_annotated_sdf
    from tqdm.auto import tqdm

    pools = {}
    for ref_mol_id in tqdm(
        sorted(cache.reference_molecule_data),
        desc=f"EvoPipe: {size} conformers per reference molecule",
        disable=not progress,
    ):
        meta = cache.reference_molecule_data[ref_mol_id]
        if meta.conformer_gen_strategy == "use_fallback":
            continue  # OF3 never generates one for these
        path = reference_mol_dir / f"{ref_mol_id}.sdf"
        try:
            mol = read_single_annotated_sdf(path)
            pools[conformer_key(mol)] = _conformer_pool(
                mol, meta.conformer_gen_strategy, size
            )
        except Exception as error:
            raise FeatureStoreError(
                f"cannot precompute conformers of {ref_mol_id} ({path}): "
                f"{type(error).__name__}: {error}"
            ) from error
    return pools


def build_feature_store(
    dataset_cache_file: Path | str,
    structures_dir: Path | str,
    out_dir: Path | str,
    structure_format: str = "npz",
    *,
    conformers: int = 0,
    reference_mol_dir: Path | str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Precompute the tokenized structure of every entry of a dataset cache.

    Args:
        dataset_cache_file: OF3's training dataset cache (JSON file or LMDB dir), as
            in the runner YAML's ``dataset_paths.<name>.dataset_cache_file``.
        structures_dir: ``target_structures_directory`` (``<pdb>/<pdb>.<format>``).
        out_dir: where the store goes; must not exist unless ``force``.
        structure_format: ``target_structure_file_format`` (``npz`` or ``pkl``).
        conformers: P, the conformer pool size per reference molecule; 0 (default)
            keeps OF3's fresh conformer per sample (samples then equal stock OF3's).
        reference_mol_dir: ``reference_molecule_directory``; needed when P > 0.
        force: replace an existing store (only once the new one is complete).
        progress: show a progress bar.

    Returns:
        ``out_dir``.

    Raises:
        FeatureStoreError: ``out_dir`` exists (without ``force``), another
            process is writing it, the dataset cache cannot be read, or a
            structure cannot be read or tokenized (the message names it; nothing
            is written).
    """
    from openfold3.core.data.io.dataset_cache import read_datacache

    out_dir = Path(out_dir)
    if conformers < 0:
        raise FeatureStoreError(f"conformers must be >= 0, got {conformers}")
    if conformers and reference_mol_dir is None:
        raise FeatureStoreError(
            "a conformer pool needs the reference molecules: pass "
            "--reference-mols (dataset_paths.<name>.reference_molecule_directory)"
        )
    if out_dir.exists() and not force:
        raise FeatureStoreError(
            f"{out_dir} already exists; pass --force to rebuild it, or choose another "
            "directory"
        )
    try:
        cache = read_datacache(dataset_cache_file)
        pdb_ids = sorted(cache.structure_data)
    except Exception as err:  # OF3's reader fails in many ways on a foreign file
        raise FeatureStoreError(
            f"{dataset_cache_file}: not an OF3 training dataset cache "
            f"({type(err).__name__}{f': {err}' if str(err) else ''})"
        ) from err
    with _writer_lock(out_dir):
        if out_dir.exists() and not force:  # again: a writer may just have finished
            raise FeatureStoreError(
                f"{out_dir} already exists; pass --force to rebuild it, or choose "
                "another directory"
            )
        _remove_dead_partials(out_dir)
        _write_store(
            cache, pdb_ids, Path(dataset_cache_file), Path(structures_dir), out_dir,
            structure_format, conformers, reference_mol_dir, progress,
        )  # fmt: skip
    return out_dir


def _write_store(
    cache: Any,
    pdb_ids: list[str],
    dataset_cache_file: Path,
    structures_dir: Path,
    out_dir: Path,
    structure_format: str,
    conformers: int,
    reference_mol_dir: Path | str | None,
    progress: bool,
) -> None:
    """Build the store in ``.<out>.partial-<pid>`` and move it into place."""
    from tqdm.auto import tqdm

    staging = _partial_dir(out_dir, os.getpid())
    shutil.rmtree(staging, ignore_errors=True)
    (staging / STRUCTURES).mkdir(parents=True)
    try:
        for pdb_id in tqdm(
            pdb_ids, desc="EvoPipe: tokenizing structures", disable=not progress
        ):
            try:
                atom_array = tokenized_structure(
                    Path(structures_dir),
                    pdb_id,
                    structure_format,
                    cache.structure_data[pdb_id].chains,
                )
            except Exception as error:
                raise FeatureStoreError(
                    f"cannot precompute {pdb_id} from {structures_dir}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            with open(staging / STRUCTURES / f"{pdb_id}.pkl", "wb") as handle:
                pickle.dump(atom_array, handle, protocol=pickle.HIGHEST_PROTOCOL)
        if conformers:
            pools = _build_conformer_pools(
                cache, Path(reference_mol_dir), conformers, progress
            )
            with open(staging / CONFORMERS, "wb") as handle:
                pickle.dump(pools, handle, protocol=pickle.HIGHEST_PROTOCOL)
        manifest = {
            **_stamp(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "structure_format": structure_format,
            "dataset_cache_sha256": dataset_cache_digest(dataset_cache_file),
            "pdb_ids": pdb_ids,
            "conformers": conformers,
            "files": _file_records(staging),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        replace_directory(staging, out_dir, f".{out_dir.name}.old-")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _file_records(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes": size, "sha256": digest}}`` of every file."""
    return {
        path.relative_to(root).as_posix(): {
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        for path in sorted(p for p in root.rglob("*") if p.is_file())
    }


def _partial_dir(out_dir: Path, pid: int) -> Path:
    return out_dir.with_name(f".{out_dir.name}.partial-{pid}")


def _lock_path(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.lock")


@contextlib.contextmanager
def _writer_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive, non-blocking ``flock`` on ``.<out>.lock`` beside the store.

    The kernel drops the lock when its holder exits, however it exits. The holder
    deletes the file before it lets go; a writer that opened the file just before
    that finds, once it has the lock, that the path no longer names its file, and
    gives way as if the lock were held (the usual lock-file check).

    Raises:
        FeatureStoreError: another process holds the lock, or the directory that
            is to hold the store cannot be created.
    """
    import fcntl

    lock_path = _lock_path(out_dir)
    busy = FeatureStoreError(
        f"another `of3-megafold precompute` is writing {out_dir} (it holds "
        f"{lock_path}); wait for it to finish, or choose another --out"
    )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise FeatureStoreError(
            f"cannot create the feature store {out_dir}: "
            f"{unwritable_cause(out_dir.parent, error)}; choose a writable --out"
        ) from error
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(handle.fileno()).st_ino:
            raise busy
        try:
            yield
        finally:
            lock_path.unlink()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_dead_partials(out_dir: Path) -> None:
    """Delete ``.<out>.partial-<pid>`` directories whose writer process is gone.

    Called under the writer lock, so no live writer of this store owns one; the pid
    check also spares a directory that is not ours to judge (a pid in use).
    """
    prefix = _partial_dir(out_dir, 0).name[:-1]
    for partial in out_dir.parent.glob(f"{prefix}*"):
        pid = partial.name[len(prefix) :]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def verify_feature_store(root: Path | str, checksums: bool = True) -> list[str]:
    """Check every file the manifest of the store at ``root`` lists.

    Args:
        root: the store directory.
        checksums: also compare each file's SHA-256 (reads the whole store);
            otherwise sizes only.

    Returns:
        One line per damaged file (missing, wrong size, wrong checksum), naming it;
        empty when the store is intact.

    Raises:
        FeatureStoreError: ``root`` holds no readable manifest, or one without
            file records (built by an older kit: rebuild it).
    """
    root = Path(root)
    records = _read_manifest(root).get("files")
    if not isinstance(records, dict):
        raise FeatureStoreError(
            f"the manifest of {root} lists no file sizes or checksums; "
            f"{_rebuild_hint(root)}"
        )
    problems = []
    for relative, record in records.items():
        path = root / relative
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if size != record["bytes"]:
            problems.append(
                f"{path}: {size} bytes, the manifest says {record['bytes']}"
            )
        elif checksums and file_sha256(path) != record["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest's")
    return problems


def _rebuild_hint(root: Path) -> str:
    return (
        f"rebuild it with `of3-megafold precompute --dataset-cache ... --structures "
        f"... --out {root} --force`"
    )


def _read_manifest(root: Path) -> dict[str, Any]:
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise FeatureStoreError(f"no feature store at {root}: {_rebuild_hint(root)}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FeatureStoreError(
            f"{manifest_path} is not valid JSON ({error}); {_rebuild_hint(root)}"
        ) from error
    if not isinstance(manifest, dict):
        raise FeatureStoreError(
            f"{manifest_path} is not a manifest; {_rebuild_hint(root)}"
        )
    return manifest


@dataclass(frozen=True)
class FeatureStore:
    """A built store, opened and checked against the installed versions.

    Use :meth:`open`; :meth:`structure` loads one entry.
    """

    root: Path
    manifest: dict[str, Any]
    pools: dict | None = None

    @classmethod
    def open(
        cls,
        root: Path | str,
        dataset_cache_file: Path | str | None = None,
        verify: str = "sizes",
    ) -> FeatureStore:
        """Open the store at ``root`` and check every file it lists.

        Args:
            root: the store directory.
            dataset_cache_file: when given, the store must have been built from it.
            verify: ``sizes`` (every file's size against the manifest) or
                ``checksums`` (also its SHA-256: catches a flipped byte).

        Raises:
            FeatureStoreError: no complete store there, it was built by another
                openfold3 / kit format, (with ``dataset_cache_file``) from a
                different dataset cache, or a file is missing or damaged. The
                message names it and says how to rebuild the store.
        """
        root = Path(root)
        if verify not in VERIFY_MODES:
            raise FeatureStoreError(
                f"feature store verification must be one of {VERIFY_MODES}, "
                f"got {verify!r}"
            )
        manifest = _read_manifest(root)
        stamp = _stamp()
        stale = {
            key: (manifest.get(key), value)
            for key, value in stamp.items()
            if key != "of3_megafold" and manifest.get(key) != value
        }
        if stale:
            found = ", ".join(
                f"{k} {old!r} (installed: {new!r})" for k, (old, new) in stale.items()
            )
            raise FeatureStoreError(
                f"feature store {root} was built with {found}; {_rebuild_hint(root)}"
            )
        if dataset_cache_file is not None:
            digest = dataset_cache_digest(dataset_cache_file)
            if manifest.get("dataset_cache_sha256") != digest:
                raise FeatureStoreError(
                    f"feature store {root} was built from another dataset cache than "
                    f"{dataset_cache_file} (SHA-256 differs); {_rebuild_hint(root)}"
                )
        damaged = verify_feature_store(root, checksums=verify == "checksums")
        if damaged:
            more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
            raise FeatureStoreError(
                f"feature store {root} is damaged: {damaged[0]}{more}; "
                f"`of3-megafold precompute --verify {root}` lists every damaged "
                f"entry; {_rebuild_hint(root)}"
            )
        pools = None
        if manifest.get("conformers"):
            try:
                with open(root / CONFORMERS, "rb") as handle:
                    pools = pickle.load(handle)
            except (OSError, pickle.UnpicklingError, EOFError) as err:
                raise FeatureStoreError(
                    f"the conformer pool of {root} cannot be read "
                    f"({type(err).__name__}: {err}); {_rebuild_hint(root)}"
                ) from err
        return cls(root, manifest, pools)

    def structure(self, pdb_id: str):
        """The tokenized ``AtomArray`` of ``pdb_id`` (a fresh object on every call).

        The bytes read must have the size the manifest records (checked for free
        here; :meth:`open` checked every entry already, this catches a file that
        changed since).
        """
        relative = f"{STRUCTURES}/{pdb_id}.pkl"
        path = self.root / relative

        def damaged(detail: str) -> FeatureStoreError:
            return FeatureStoreError(
                f"entry {pdb_id} of the feature store {self.root} is damaged "
                f"({detail}); {_rebuild_hint(self.root)}"
            )

        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise FeatureStoreError(
                f"{pdb_id} is not in the feature store {self.root} (built for "
                f"{len(self.manifest.get('pdb_ids', []))} structures); rebuild it for "
                "this dataset cache with `of3-megafold precompute ... --force`"
            ) from None
        expected = self.manifest["files"].get(relative, {}).get("bytes")
        if len(data) != expected:
            raise damaged(f"{len(data)} bytes, the manifest says {expected}")
        try:
            return pickle.loads(data)
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
            raise damaged(f"{type(err).__name__}: {err}") from err
