"""tools/pack_device_wheels.py: repacked wheels keep a RECORD pip accepts; the
snapshots and the two folders come out of the downloaded wheels (no download here)."""

import base64
import hashlib
import json
import zipfile
from pathlib import Path

from tools import pack_device_wheels

RECORD = "openfold3-0.5.0.dist-info/RECORD"


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(RECORD, "stale\n")
    return path


def _openfold3(directory: Path) -> Path:
    return _wheel(
        directory / "openfold3-0.5.0-py3-none-any.whl",
        {
            "openfold3/__init__.py": b"",
            "openfold3/tests/test_kernels.py": b"def test(): pass\n",
            "openfold3/tests/test_data/big.cif": b"x" * 1000,
            "openfold3/tests/test_data/snapshots/test_tri/nvidia/a.npz": b"npz",
            "openfold3-0.5.0.dist-info/METADATA": b"Name: openfold3\n",
        },
    )


def _records(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(RECORD).decode().splitlines()
        rows = dict(line.rsplit(",", 2)[0:2] for line in lines)
        for name, digest in rows.items():
            if name == RECORD:
                assert digest == ""
                continue
            expected = (
                base64.urlsafe_b64encode(hashlib.sha256(zf.read(name)).digest())
                .rstrip(b"=")
                .decode()
            )
            assert digest == f"sha256={expected}", name
        assert sorted(rows) == sorted(zf.namelist())
    return rows


def test_repack_drops_members_and_rewrites_the_record(tmp_path):
    wheel = _openfold3(tmp_path)
    dropped = pack_device_wheels.repack(wheel, pack_device_wheels.DROPPED["openfold3-"])
    assert dropped == 2
    rows = _records(wheel)
    assert "openfold3/tests/test_kernels.py" in rows  # OF3's tests stay
    assert not any("test_data" in name for name in rows)
    assert not list(tmp_path.glob("*.part"))


def test_biotite_loses_only_the_ccd():
    drop = pack_device_wheels.DROPPED["biotite-"]
    assert drop("biotite/structure/info/components.bcif")
    assert not drop("biotite/structure/info/atoms.py")


def test_pack_fills_both_folders(tmp_path):
    wheels = tmp_path / "download"
    wheels.mkdir()
    _openfold3(wheels)
    _wheel(
        wheels / "gemmi-0.7.5-cp312-cp312-manylinux_2_28_x86_64.whl",
        {"gemmi/__init__.py": b""},
    )
    root = tmp_path / "checkout"
    (root / ".whl").mkdir(parents=True)
    (root / ".whl" / "old-1.0-py3-none-any.whl").write_bytes(b"old")
    pack_device_wheels.pack(wheels, root)
    assert sorted(p.name for p in (root / ".whl").iterdir()) == [
        "gemmi-0.7.5-cp312-cp312-manylinux_2_28_x86_64.whl",
        "openfold3-0.5.0-py3-none-any.whl",
    ]
    assert (
        root / ".of3-snapshots" / "test_tri" / "nvidia" / "a.npz"
    ).read_bytes() == b"npz"
    _records(root / ".whl" / "openfold3-0.5.0-py3-none-any.whl")


def test_wheels_are_pinned_where_the_docs_say():
    pinned = dict(w.split("==") for w in pack_device_wheels.WHEELS if "==" in w)
    assert pinned["openfold3"] == "0.5.0" and pinned["biotite"] == "1.8.0"
    assert pinned["pydantic-core"] == "2.50.5"  # what pydantic 2.14.4 requires


def test_demo_set_is_stamped_with_the_carried_biotite(tmp_path, monkeypatch):
    """The GPU machine reuses a set whose stamp matches its own biotite, so the
    stamp names the carried wheel's, not this machine's."""
    from of3_megafold.demo import build

    def ensure(cache, progress):
        demo = cache / "demo-x"
        demo.mkdir(parents=True)
        stamp = {"stamp": {"biotite": "1.6.0", "openfold3": "0.5.0"}, "summary": {}}
        (demo / build.STAMP_FILE).write_text(json.dumps(stamp))
        return demo

    monkeypatch.setattr(build, "ensure_demo_dataset", ensure)
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    (wheels / "biotite-1.8.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (tmp_path / ".demo-cache" / "stale").mkdir(parents=True)
    demo = pack_device_wheels.build_demo_set(tmp_path, wheels)
    stamp = json.loads((demo / build.STAMP_FILE).read_text())["stamp"]
    assert stamp == {"biotite": "1.8.0", "openfold3": "0.5.0"}
    assert sorted(p.name for p in (tmp_path / ".demo-cache").iterdir()) == ["demo-x"]
