"""Build the demo training set: a tiny, real OF3 training set from the OF3 wheel.

``openfold3`` ships 15 mmCIF files and the MSAs of one entry (2q2k) with its tests
(``openfold3/tests/test_data``). :func:`ensure_demo_dataset` turns them into a
training set that OF3's own ``WeightedPDBDataset`` reads, with no download:

1. ``components.cif``: the components of those mmCIFs, from biotite's bundled
   CCD (:mod:`of3_megafold.demo.ccd`).
2. OF3's structure preprocessing (``preprocess_cif_dir_of3``): cleaned structures
   as ``structure_files/<pdb>/<pdb>.npz``, reference molecules as
   ``reference_mols/<id>.sdf`` and ``metadata.json``.
3. ``alignments/<representative>/``: the shipped 2q2k MSAs for the chains whose
   sequence they were computed for; a query-only ``colabfold_main.a3m`` (OF3's
   own convention for chains without hits) for every other protein/RNA sequence.
4. ``dataset_cache.json``: a ``ClusteredDatasetCache`` written from the
   preprocessing metadata. OF3's cache builder clusters polymer chains with mmseqs
   (40 % identity); the demo clusters them by identical sequence, ligands by
   reference molecule, interfaces by their pair of chain clusters, so the AF3
   sampling weights (``1 / cluster size``) keep the 49 identical chains of the EM
   structure 3zee from drowning out the rest.

The build is atomic: it happens in a temporary sibling directory that is renamed
into place only when complete, so an interrupted build leaves nothing behind at the
target and the next call starts over. The finished set carries a stamp with the
OpenFold3, kit and biotite versions; a set whose stamp differs is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from of3_megafold._files import replace_directory
from of3_megafold.errors import KitError, unwritable_cause

logger = logging.getLogger(__name__)

DEMO_FORMAT_VERSION = 1
"""Bump when the recipe below changes, so existing sets are rebuilt."""

CACHE_ENV_VAR = "OF3_MEGAFOLD_CACHE"
"""Overrides the cache root (default: the platform's user cache directory)."""

SOURCE_ENV_VAR = "OF3_MEGAFOLD_DEMO_SOURCE"
"""Points at an OF3 ``tests/test_data`` directory when the wheel lacks one."""

DATASET_NAME = "of3-megafold-demo"
STAMP_FILE = "demo_stamp.json"
CCD_FILE = "components.cif"
STRUCTURES_DIR = "structure_files"
REFERENCE_MOLS_DIR = "reference_mols"
ALIGNMENTS_DIR = "alignments"
DATASET_CACHE_FILE = "dataset_cache.json"
PREPROCESSING_METADATA_FILE = "metadata.json"

SHIPPED_MSA_ENTRIES = ("2q2k_A", "2q2k_B")
"""MSA directories under ``test_data/alignments`` used as representatives."""

QUERY_ONLY_MSA_NAME = "colabfold_main"
"""File stem OF3's MSA server uses for query-only alignments; it is in OF3's
default ``aln_order`` and ``max_seq_counts``, so the default MSA settings read it."""

_BUILD_PREFIX = ".building-"


class DemoSourceMissingError(KitError, FileNotFoundError):
    """The OpenFold3 install lacks the test data the demo set is built from."""


class DemoBuildError(KitError, RuntimeError):
    """The demo set could not be built from the shipped test data."""


class DemoCacheError(KitError, OSError):
    """The cache the demo set is built into cannot be written."""


def cache_error(root: Path, error: OSError) -> DemoCacheError:
    """One line naming the cache root, why it cannot be written, and the fix."""
    cause = unwritable_cause(root, error)
    if root != default_cache_root():
        source = "the cache_dir passed in"
    elif os.environ.get(CACHE_ENV_VAR):
        source = f"${CACHE_ENV_VAR}"
    else:
        source = "the default cache"
    return DemoCacheError(
        f"cannot build the demo data set in {root} ({source}): {cause}. Fix: set "
        f"{CACHE_ENV_VAR} to a writable directory, e.g. "
        f"`export {CACHE_ENV_VAR}=$HOME/.cache/of3-megafold`"
    )


@dataclass(frozen=True)
class DemoSources:
    """The shipped files the demo set is built from."""

    test_data: Path
    mmcifs: tuple[Path, ...]
    msa_dirs: tuple[Path, ...]


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def demo_stamp() -> dict[str, str | int]:
    """What a built set must match to be reused: library versions and format."""
    from of3_megafold import __version__ as kit_version

    return {
        "format": DEMO_FORMAT_VERSION,
        "openfold3": _installed_version("openfold3"),
        "of3_megafold": kit_version,
        "biotite": _installed_version("biotite"),
    }


def default_cache_root() -> Path:
    """``$OF3_MEGAFOLD_CACHE``, else the user cache dir (``~/.cache/of3-megafold``)."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("of3-megafold", appauthor=False))


def demo_dir_name(stamp: dict[str, str | int] | None = None) -> str:
    """Directory name for these versions, e.g. ``demo-of3_0.5.0-kit_0.1.0-v1``."""
    stamp = demo_stamp() if stamp is None else stamp
    return (
        f"demo-of3_{stamp['openfold3']}-kit_{stamp['of3_megafold']}-v{stamp['format']}"
    )


def find_demo_sources() -> DemoSources:
    """Locate the mmCIFs and MSAs shipped in ``openfold3/tests/test_data``.

    Also checks that biotite's bundled CCD, the source of ``components.cif``, is
    there.

    Raises:
        DemoSourceMissingError: naming each missing piece and how to get it.
    """
    override = os.environ.get(SOURCE_ENV_VAR)
    if override:
        test_data = Path(override).expanduser()
        where = f"${SOURCE_ENV_VAR}={override}"
    else:
        import openfold3

        test_data = Path(openfold3.__file__).parent / "tests" / "test_data"
        where = (
            f"openfold3 {_installed_version('openfold3')} at {test_data.parent.parent}"
        )

    mmcif_dir = test_data / "mmcifs"
    mmcifs = tuple(sorted(mmcif_dir.glob("*.cif"))) if mmcif_dir.is_dir() else ()
    msa_dirs = tuple(test_data / "alignments" / entry for entry in SHIPPED_MSA_ENTRIES)

    missing = []
    if not mmcifs:
        missing.append(f"{mmcif_dir}/*.cif")
    missing += [str(d) for d in msa_dirs if not _msa_files(d)]
    if missing:
        raise DemoSourceMissingError(
            "The demo training set is built from the test data that the openfold3 "
            f"wheel ships, but {where} lacks:\n  "
            + "\n  ".join(missing)
            + "\nSome repacked wheels drop openfold3/tests. Fix: reinstall the "
            "official wheel (`pip install --force-reinstall --no-deps "
            f"openfold3=={_installed_version('openfold3')}`), or point "
            f"${SOURCE_ENV_VAR} at tests/test_data of an OpenFold3 source checkout "
            "of the same version."
        )
    _check_biotite_ccd()
    return DemoSources(test_data=test_data, mmcifs=mmcifs, msa_dirs=msa_dirs)


def _check_biotite_ccd() -> None:
    """Raise if biotite's bundled CCD subset (``components.bcif``) is missing."""
    from biotite.structure.info.ccd import get_ccd

    try:
        get_ccd()
    except RuntimeError as error:
        version = _installed_version("biotite")
        raise DemoSourceMissingError(
            "The demo's components.cif is written from the CCD subset that biotite "
            f"bundles, but biotite {version} has none ({error}). Some repacked "
            "wheels drop it (biotite/structure/info/components.bcif, ~60 MB). Fix: "
            f"reinstall the official wheel (`pip install --force-reinstall --no-deps "
            f"biotite=={version}`), or run `python -m biotite.setup_ccd` (downloads "
            "the CCD)."
        ) from error


def read_stamp(dataset_dir: Path) -> dict | None:
    """The stamp of a finished set, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((dataset_dir / STAMP_FILE).read_text())["stamp"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure_demo_dataset(
    cache_dir: Path | None = None, *, force: bool = False, progress: bool = True
) -> Path:
    """Build the demo training set once, then return its directory.

    Args:
        cache_dir: cache root; the set goes to ``cache_dir / demo_dir_name()``.
            Default :func:`default_cache_root` (``$OF3_MEGAFOLD_CACHE`` or
            ``~/.cache/of3-megafold``).
        force: rebuild even if a set with a matching stamp exists.
        progress: show progress bars (ours over the build steps, OF3's over the
            structures it preprocesses).

    Returns:
        The dataset directory. :func:`demo_dataset_paths` gives the runner-YAML
        ``dataset_paths`` entry for it.

    Raises:
        DemoSourceMissingError: the OpenFold3 install lacks its test data.
        DemoCacheError: the cache root cannot be created or written (a read-only
            mount, a regular file on the path, ``/proc``); a finished set there is
            still reused read-only.
        DemoBuildError: preprocessing produced no usable structure.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    stamp = demo_stamp()
    target = root / demo_dir_name(stamp)

    if not force and read_stamp(target) == stamp:
        return target

    sources = find_demo_sources()
    with _build_lock(root):
        # Another process may have finished the same build while we waited.
        if not force and read_stamp(target) == stamp:
            return target
        _remove_abandoned_builds(root, target.name)
        try:
            staging = Path(
                tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{target.name}-", dir=root)
            )
        except OSError as error:
            raise cache_error(root, error) from error
        try:
            summary = _build_into(staging, sources, progress=progress)
            (staging / STAMP_FILE).write_text(
                json.dumps({"stamp": stamp, "summary": summary}, indent=2) + "\n"
            )
            replace_directory(staging, target, f"{_BUILD_PREFIX}{target.name}-")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if progress:
        tqdm.write(
            f"Demo training set: {summary['structures']} structures, "
            f"{summary['chains']} chains, built in {summary['build_seconds']:.0f} s "
            f"-> {target}"
        )
    return target


def demo_dataset_paths(dataset_dir: Path) -> dict[str, str | None]:
    """The runner-YAML ``dataset_paths.<name>`` entry for a built demo set.

    Field names are those of OF3's ``TrainingDatasetPaths``.
    """
    dataset_dir = Path(dataset_dir)
    return {
        "dataset_cache_file": str(dataset_dir / DATASET_CACHE_FILE),
        "alignments_directory": str(dataset_dir / ALIGNMENTS_DIR),
        "alignment_db_directory": None,
        "alignment_array_directory": None,
        "target_structures_directory": str(dataset_dir / STRUCTURES_DIR),
        "target_structure_file_format": "npz",
        "reference_molecule_directory": str(dataset_dir / REFERENCE_MOLS_DIR),
        "template_cache_directory": None,
        "template_structures_directory": None,
        "template_structure_array_directory": None,
        "template_file_format": None,
        "ccd_file": str(dataset_dir / CCD_FILE),
    }


@contextlib.contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    """Create the cache root and hold an exclusive lock on it: one build at a time,
    per host.

    Concurrent runs (two demos started at once) then build once; the second finds
    the first one's finished set.

    Raises:
        DemoCacheError: the root cannot be created or the lock file written.
    """
    import fcntl

    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".build.lock", "w")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise cache_error(root, error) from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_abandoned_builds(root: Path, name: str) -> None:
    """Delete staging dirs of builds killed outright (SIGKILL, power loss).

    Called under the build lock, so no such directory belongs to a live build.
    """
    for staging in root.glob(f"{_BUILD_PREFIX}{name}-*"):
        shutil.rmtree(staging, ignore_errors=True)


def _msa_files(msa_dir: Path) -> list[Path]:
    """The ``.a3m``/``.sto`` alignments in a directory (none if it is missing)."""
    if not msa_dir.is_dir():
        return []
    return sorted(p for p in msa_dir.iterdir() if p.suffix in (".a3m", ".sto"))


@contextlib.contextmanager
def _quiet_of3_progress(enabled: bool) -> Iterator[None]:
    """Silence the progress bars OF3's preprocessing draws, when asked to."""
    if enabled:
        yield
        return
    from openfold3.core.data.pipelines.preprocessing import structure

    original = structure.tqdm
    structure.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        structure.tqdm = original


def _build_into(staging: Path, sources: DemoSources, *, progress: bool) -> dict:
    """Run every build step into ``staging``; return a summary for the stamp."""
    start = time.perf_counter()
    steps = tqdm(
        total=4,
        desc="Building demo set",
        unit="step",
        disable=not progress,
        leave=False,
    )
    with steps:
        steps.set_postfix_str("components.cif from biotite's CCD")
        _write_ccd(staging, sources)
        steps.update()

        steps.set_postfix_str(f"OF3 preprocessing of {len(sources.mmcifs)} mmCIFs")
        structure_metadata = _preprocess_structures(staging, sources, progress)
        steps.update()

        steps.set_postfix_str("alignments")
        chain_sequences = _chain_sequences(staging, structure_metadata)
        chain_to_rep = _write_alignments(
            staging, sources, structure_metadata, chain_sequences
        )
        steps.update()

        steps.set_postfix_str("dataset cache")
        n_structures, n_chains = _write_dataset_cache(
            staging, chain_sequences, chain_to_rep
        )
        steps.update()

    return {
        "structures": n_structures,
        "chains": n_chains,
        "build_seconds": round(time.perf_counter() - start, 1),
        "source": str(sources.test_data),
    }


def _write_ccd(staging: Path, sources: DemoSources) -> None:
    from of3_megafold.demo.ccd import component_ids_in_mmcifs, write_components_cif

    write_components_cif(component_ids_in_mmcifs(sources.mmcifs), staging / CCD_FILE)


def _preprocess_structures(
    staging: Path, sources: DemoSources, progress: bool
) -> dict[str, dict]:
    """OF3's preprocessing of the shipped mmCIFs; returns its successful entries."""
    from openfold3.core.data.pipelines.preprocessing.structure import (
        preprocess_cif_dir_of3,
    )

    # OF3 walks a directory tree; give it links to exactly the shipped mmCIFs.
    cif_dir = staging / "_mmcifs"
    cif_dir.mkdir()
    for cif in sources.mmcifs:
        (cif_dir / cif.name).symlink_to(cif.resolve())

    with _quiet_of3_progress(progress):
        preprocess_cif_dir_of3(
            cif_dir=cif_dir,
            ccd_path=staging / CCD_FILE,
            biotite_ccd_path=None,
            out_dir=staging,
            num_workers=0,
            output_formats=("npz",),
        )
    shutil.rmtree(cif_dir)

    structure_data = json.loads((staging / PREPROCESSING_METADATA_FILE).read_text())[
        "structure_data"
    ]
    failed = {
        pdb_id: entry.get("status")
        for pdb_id, entry in structure_data.items()
        if entry.get("status") != "success"
    }
    if failed:
        logger.warning("OF3 preprocessing did not keep: %s", failed)
    if len(failed) == len(structure_data):
        raise DemoBuildError(
            f"OF3 preprocessing kept none of the {len(structure_data)} shipped "
            f"structures ({failed}); see the warnings logged above."
        )
    return {k: v for k, v in structure_data.items() if k not in failed}


def _msa_query(msa_dir: Path) -> str:
    """The query sequence (first row, gaps removed) of an MSA directory."""
    from openfold3.core.data.io.sequence.msa import parse_msas_direct

    files = _msa_files(msa_dir)
    msas = parse_msas_direct(files, max_seq_counts={p.stem: 1 for p in files})
    first = msas[sorted(msas)[0]]
    return "".join(first.msa[0]).replace("-", "")


def _chain_sequences(staging: Path, structure_metadata: dict[str, dict]) -> dict:
    """``{"<pdb>_<chain>": sequence}`` for every polymer chain, as OF3 wrote them."""
    from openfold3.core.data.io.sequence.fasta import get_chain_id_to_seq_from_fasta

    sequences = {}
    for pdb_id in structure_metadata:
        fasta = staging / STRUCTURES_DIR / pdb_id / f"{pdb_id}.fasta"
        for chain_id, sequence in get_chain_id_to_seq_from_fasta(fasta).items():
            sequences[f"{pdb_id}_{chain_id}"] = sequence
    return sequences


def _write_alignments(
    staging: Path,
    sources: DemoSources,
    structure_metadata: dict[str, dict],
    chain_sequences: dict[str, str],
) -> dict[str, str]:
    """Write one alignment directory per distinct protein/RNA sequence.

    Returns:
        ``{"<pdb>_<chain>": representative_id}`` for every protein/RNA chain.
    """
    from openfold3.projects.of3_all_atom.config.dataset_config_components import (
        MSASettings,
    )

    alignments = staging / ALIGNMENTS_DIR
    alignments.mkdir()
    # Only the files OF3's default MSA settings read (the 20 MB template hits
    # file next to them is not one of them).
    wanted_stems = set(MSASettings().max_seq_counts)

    rep_for_sequence: dict[str, str] = {}
    for msa_dir in sources.msa_dirs:
        query = _msa_query(msa_dir)
        if query in rep_for_sequence:
            continue
        rep_for_sequence[query] = msa_dir.name
        (alignments / msa_dir.name).mkdir()
        for msa_file in _msa_files(msa_dir):
            if msa_file.stem in wanted_stems:
                shutil.copyfile(msa_file, alignments / msa_dir.name / msa_file.name)

    chain_to_rep: dict[str, str] = {}
    for pdb_id, entry in sorted(structure_metadata.items()):
        for chain_id, chain in sorted(entry["chains"].items()):
            if chain["molecule_type"] not in ("PROTEIN", "RNA"):
                continue
            key = f"{pdb_id}_{chain_id}"
            sequence = chain_sequences[key]
            rep = rep_for_sequence.get(sequence)
            if rep is None:
                rep = key
                rep_for_sequence[sequence] = rep
                (alignments / rep).mkdir()
                (alignments / rep / f"{QUERY_ONLY_MSA_NAME}.a3m").write_text(
                    f">query\n{sequence}\n"
                )
            chain_to_rep[key] = rep
    return chain_to_rep


def _write_dataset_cache(
    staging: Path, chain_sequences: dict[str, str], chain_to_rep: dict[str, str]
) -> tuple[int, int]:
    """Write ``dataset_cache.json`` (a ``ClusteredDatasetCache``) from the metadata.

    Clusters: polymer chains by identical sequence and molecule type, ligand chains
    by reference molecule, interfaces by the (unordered) pair of their chains'
    clusters. Cluster ids are named after their first member; sizes count members
    over the whole set, as OF3's ``add_cluster_data`` does.
    """
    from collections import Counter

    from openfold3.core.data.io.dataset_cache import write_datacache_to_json
    from openfold3.core.data.primitives.caches.filtering import (
        build_provisional_clustered_dataset_cache,
        filter_by_skipped_structures,
    )
    from openfold3.core.data.primitives.caches.format import PreprocessingDataCache

    preprocessing = PreprocessingDataCache.from_json(
        staging / PREPROCESSING_METADATA_FILE
    )
    preprocessing.structure_data = filter_by_skipped_structures(
        preprocessing.structure_data
    )
    cache = build_provisional_clustered_dataset_cache(preprocessing, DATASET_NAME)

    cluster_of_member: dict[tuple, str] = {}
    chain_cluster: dict[str, str] = {}
    for pdb_id, entry in sorted(cache.structure_data.items()):
        for chain_id, chain in sorted(entry.chains.items()):
            key = f"{pdb_id}_{chain_id}"
            if chain.reference_mol_id is not None:
                member = ("ligand", chain.reference_mol_id)
            elif key in chain_sequences:
                member = (str(chain.molecule_type), chain_sequences[key])
            else:
                member = ("entity", pdb_id, chain.entity_id)
            chain_cluster[key] = cluster_of_member.setdefault(member, key)

    def interface_cluster(pdb_id: str, interface_id: str) -> str:
        pair = sorted(chain_cluster[f"{pdb_id}_{c}"] for c in interface_id.split("_"))
        return "__".join(pair)

    chain_sizes = Counter(chain_cluster.values())
    interface_sizes = Counter(
        interface_cluster(pdb_id, interface_id)
        for pdb_id, entry in cache.structure_data.items()
        for interface_id in entry.interfaces
    )

    n_chains = 0
    for pdb_id, entry in cache.structure_data.items():
        for chain_id, chain in entry.chains.items():
            key = f"{pdb_id}_{chain_id}"
            chain.alignment_representative_id = chain_to_rep.get(key)
            chain.template_ids = []
            chain.cluster_id = chain_cluster[key]
            chain.cluster_size = chain_sizes[chain.cluster_id]
            n_chains += 1
        for interface_id, interface in entry.interfaces.items():
            interface.cluster_id = interface_cluster(pdb_id, interface_id)
            interface.cluster_size = interface_sizes[interface.cluster_id]

    write_datacache_to_json(cache, staging / DATASET_CACHE_FILE)
    return len(cache.structure_data), n_chains
