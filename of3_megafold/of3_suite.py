"""Run OpenFold3's own test suite with the kit active (``of3-megafold test-of3``).

OF3's tests write snapshot and cache files next to themselves, so they run against
an installed copy the user may write to; a read-only install is copied to a
scratch directory first. The tests that need the network (``TestSetupOpenFold``,
``test_setup_biotite_ccd``) are deselected; ``--skip-ccd-update`` avoids the CCD
download. Each run is a fresh Python process, so the Triton interpreter can be
switched on (no GPU) before any kernel is defined.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NETWORK_TESTS = ("TestSetupOpenFold", "test_setup_biotite_ccd")
"""OF3 tests that download data: never run here."""

CI_SUBSET = (
    "test_diffusion_loss.py",
    "test_primitives.py",
    "test_triangular_attention.py",
    "test_triangular_multiplicative_update.py",
    "test_msa.py",
    "test_msa_module.py",
    "test_pair_transition.py",
    "test_pairformer.py",
    "test_diffusion_transformer.py",
    "test_sequence_local_atom_attention.py",
    "test_kernels.py",
    "test_entry_points.py",
    "test_atomize_utils.py",
    "test_confidence_loss.py",
    "core/utils/test_relpos.py",
)
"""The files that exercise what the kit replaces, and OF3's config entry points."""


def _installed_package() -> Path:
    spec = importlib.util.find_spec("openfold3")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("openfold3 is not installed; pip install openfold3")
    return Path(spec.origin).parent


def writable_tests_dir() -> tuple[Path, dict[str, str]]:
    """OF3's ``tests`` directory in a copy the suite may write to, plus env vars.

    Returns the installed directory when it is writable, else a copy of the whole
    ``openfold3`` package under the temp directory, put first on ``PYTHONPATH``.
    """
    package = _installed_package()
    tests = package / "tests"
    if not (tests / "test_data").is_dir():
        raise FileNotFoundError(
            f"{tests / 'test_data'} is missing: this openfold3 install has no test "
            "data (some repacked wheels drop it); reinstall openfold3 from PyPI"
        )
    if os.access(tests, os.W_OK):
        return tests, {}
    scratch = Path(tempfile.gettempdir()) / "of3-megafold-of3-suite"
    copy = scratch / "openfold3"
    if not copy.exists():
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    pythonpath = os.pathsep.join(
        filter(None, [str(scratch), os.environ.get("PYTHONPATH")])
    )
    return copy / "tests", {"PYTHONPATH": pythonpath}


def of3_suite_command(
    extensions: str = "none", files: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> list[str]:
    """The pytest command line for OF3's suite with the kit's plugin."""
    deselect = " and ".join(f"not {name}" for name in NETWORK_TESTS)
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "of3_megafold.testing",
        f"--of3-megafold-extensions={extensions}",
        "--skip-ccd-update",
        "-p",
        "no:cacheprovider",
        "-k",
        deselect,
        *files,
        *extra,
    ]


def run_of3_suite(
    extensions: str = "none", files: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> int:
    """Run OF3's suite (or ``files`` of it); returns pytest's exit status."""
    tests, env = writable_tests_dir()
    command = of3_suite_command(extensions, files, extra)
    return subprocess.call(command, cwd=tests, env={**os.environ, **env})
