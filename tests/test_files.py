"""of3_megafold._files.replace_directory: the swap the demo and EvoPipe builders
finish with."""

import os

import pytest

from of3_megafold._files import replace_directory


def _dir(path, text):
    path.mkdir()
    (path / "f.txt").write_text(text)
    return path


def test_replaces_an_existing_directory(tmp_path):
    target = _dir(tmp_path / "store", "old")
    replace_directory(_dir(tmp_path / "staging", "new"), target, ".store.old-")
    assert (target / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_fills_a_missing_target(tmp_path):
    target = tmp_path / "store"
    replace_directory(_dir(tmp_path / "staging", "new"), target, ".store.old-")
    assert (target / "f.txt").read_text() == "new"


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = _dir(tmp_path / "store", "old")
    staging = _dir(tmp_path / "staging", "new")
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(src) == os.fspath(staging):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk gone"):
        replace_directory(staging, target, ".store.old-")
    assert (target / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staging", "store"]
