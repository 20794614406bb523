"""Build the git-ignored folders that travel to the GPU machine, from PyPI.

    python -m tools.pack_device_wheels [--root .]

The GPU machine has torch and Triton but no package registry (docs/benchmarks.md,
"Re-running them"), and a call carries at most 64 MiB. This writes, replacing them:

- ``.whl/``: what OF3 needs beyond torch and Triton, as cp312 manylinux x86_64
  wheels (the GPU machine's Python; ~51 MiB), with openfold3 repacked without
  ``tests/test_data`` and biotite without ``structure/info/components.bcif``;
- ``.of3-snapshots/``: OF3's regression snapshots (``tests/test_data/snapshots`` of
  the full openfold3 wheel), which ``gpu_session.sh``'s ``of3-tests`` step puts back;
- ``.demo-cache/``: the demo training set (``bench train``'s data), built here: the
  GPU machine cannot build it, having neither OF3's test data nor biotite's CCD
  (both dropped above). ``gpu_session.sh`` points ``$OF3_MEGAFOLD_CACHE`` at it.

Nothing is replaced unless every download succeeded.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

# The pinned versions the GPU machine runs; docs/benchmarks.md says why each is pinned.
WHEELS = (
    "openfold3==0.5.0",
    "biotite==1.8.0",
    "rdkit==2025.9.6",
    "pdbeccdutils==1.0.4",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "typing-extensions==4.16.0",
    "gemmi",
    "lmdb",
    "biotraj",
    "ml-collections",
    "memory-profiler",
    "annotated-types",
    "typing-inspection",
    "pytest-regressions",
    "pytest-datadir",
    "platformdirs",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
SNAPSHOTS = "openfold3/tests/test_data/snapshots/"
# Per wheel-name prefix: the members the GPU runs never read.
DROPPED: dict[str, Callable[[str], bool]] = {
    "openfold3-": lambda name: name.startswith("openfold3/tests/test_data/"),
    "biotite-": lambda name: name.endswith("structure/info/components.bcif"),
}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{name},sha256={digest.decode()},{len(data)}"


def repack(wheel: Path, drop: Callable[[str], bool]) -> int:
    """Rewrite ``wheel`` in place without the members ``drop`` selects, its
    ``RECORD`` rewritten to match (pip checks it). Returns how many were dropped."""
    packed = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as zin:
        names = zin.namelist()
        kept = [name for name in names if not drop(name)]
        record = next(name for name in kept if name.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as zout:
            lines = []
            for name in kept:
                if name != record:
                    data = zin.read(name)
                    lines.append(_record_line(name, data))
                    zout.writestr(name, data)
            zout.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    packed.replace(wheel)
    return len(names) - len(kept)


def extract_snapshots(wheel: Path, out: Path) -> int:
    """Write the members under :data:`SNAPSHOTS` of the openfold3 ``wheel`` into
    ``out`` (relative to that folder). Returns how many files were written."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(SNAPSHOTS) and not name.endswith("/"):
                target = out / name[len(SNAPSHOTS) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
                count += 1
    return count


def download(dest: Path) -> None:
    """The :data:`WHEELS` for CPython 3.12 on manylinux x86_64, into ``dest``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--abi",
            "cp312",
            *platforms,
            *WHEELS,
        ],
        check=True,
    )


def pack(wheels: Path, root: Path) -> None:
    """From downloaded ``wheels``: snapshots, repacks, then both folders of ``root``
    replaced."""
    snapshots = wheels / "snapshots"
    (openfold3,) = wheels.glob("openfold3-*.whl")
    extract_snapshots(openfold3, snapshots)
    for wheel in sorted(wheels.glob("*.whl")):
        for prefix, drop in DROPPED.items():
            if wheel.name.startswith(prefix):
                print(f"{wheel.name}: {repack(wheel, drop)} members dropped")
    staged = wheels / "whl"
    staged.mkdir()
    for wheel in wheels.glob("*.whl"):
        wheel.rename(staged / wheel.name)
    for name, source in ((".of3-snapshots", snapshots), (".whl", staged)):
        shutil.rmtree(root / name, ignore_errors=True)
        shutil.move(str(source), root / name)  # across filesystems: /tmp -> root
    size = sum(p.stat().st_size for p in (root / ".whl").iterdir()) / 2**20
    print(f"{root / '.whl'}: {size:.0f} MiB; {root / '.of3-snapshots'}")


def build_demo_set(root: Path, wheels: Path) -> Path:
    """The demo training set in ``root/.demo-cache`` (replaced), built with this
    machine's openfold3 and biotite, its stamp naming the biotite of ``wheels``
    (``.whl/``) so that the GPU machine reuses it instead of rebuilding it. Its
    components then come from this machine's biotite CCD, the same for every
    provider a benchmark compares."""
    from of3_megafold.demo.build import STAMP_FILE, ensure_demo_dataset

    (biotite,) = wheels.glob("biotite-*.whl")
    cache = root / ".demo-cache"
    shutil.rmtree(cache, ignore_errors=True)
    demo = ensure_demo_dataset(cache, progress=False)
    stamp_file = demo / STAMP_FILE
    stamp = json.loads(stamp_file.read_text())
    stamp["stamp"]["biotite"] = biotite.name.split("-")[1]
    stamp_file.write_text(json.dumps(stamp, indent=2))
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="checkout to write .whl/ and .of3-snapshots/ into",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        download(Path(work))
        pack(Path(work), args.root)
    print(f"demo set: {build_demo_set(args.root, args.root / '.whl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
