"""tools/ship_autotune.py: which tuning run's choice ships for a key."""

import json
import os
from pathlib import Path

from tools import ship_autotune

KERNEL = "_evoflash_fwd_kernel"
KERNELS = ship_autotune.KERNELS
KEY = [1024, 256, 4, 32, True, 0, True, False, "torch.bfloat16"]


def _config(block_m: int, stages: int) -> dict:
    return {
        "kwargs": {"BLOCK_M": block_m, "BLOCK_N": 64, "S_GROUP": 1},
        "num_warps": 4,
        "num_stages": stages,
    }


def _run(directory: Path, name: str, timings: list, mtime: float, key=KEY) -> None:
    """One tuning run's file, as Triton's ``cache_results`` writes it."""
    path = directory / name / f"{KERNEL}.autotune.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "configs_timings": timings}))
    os.utime(path, (mtime, mtime))


def test_the_run_comparing_most_configs_wins_not_the_lowest_time(tmp_path):
    # An old run over two configs at a smaller N of the same bucket (lower times)
    # and a newer run over three: times from different runs are not compared.
    _run(
        tmp_path,
        "old",
        [[_config(64, 2), [1.0, 0.9, 1.1]], [_config(128, 2), [1.2, 1.1, 1.3]]],
        mtime=1000,
    )
    _run(
        tmp_path,
        "new",
        [
            [_config(64, 2), [3.3, 3.2, 3.4]],
            [_config(128, 2), [3.5, 3.4, 3.6]],
            [_config(64, 3), [2.9, 2.8, 3.0]],
        ],
        mtime=2000,
    )
    best = ship_autotune.collect(tmp_path)
    ms, entry = best[KERNEL][tuple(KEY)]
    assert (ms, entry) == (2.9, _config(64, 3))


def test_newest_run_among_equals_and_keys_apart(tmp_path):
    other_key = KEY[:-1] + ["torch.float32"]
    _run(tmp_path, "a", [[_config(64, 2), [1.0]], [_config(128, 2), [2.0]]], 1000)
    _run(tmp_path, "b", [[_config(64, 2), [3.0]], [_config(128, 2), [2.5]]], 2000)
    _run(tmp_path, "c", [[_config(64, 3), [0.5]]], 3000, key=other_key)
    best = ship_autotune.collect(tmp_path)
    assert best[KERNEL][tuple(KEY)] == (2.5, _config(128, 2))
    assert best[KERNEL][tuple(other_key)] == (0.5, _config(64, 3))
    assert all(not keys for name, keys in best.items() if name != KERNEL)


def test_the_table_records_the_lists_it_was_built_for(tmp_path, monkeypatch):
    from of3_megafold.kernels.evoflash.configs import lists_fingerprint

    _run(tmp_path / "runs", "a", [[_config(64, 3), [1.0]]], 1000)
    out = tmp_path / "table.json"
    monkeypatch.setattr(ship_autotune, "tuned_path", lambda gpu: out)
    monkeypatch.setattr("sys.argv", ["ship_autotune.py", str(tmp_path / "runs")])
    assert ship_autotune.main() == 0
    table = json.loads(out.read_text())
    assert table["lists"] == {name: lists_fingerprint(name) for name in KERNELS}
    assert table["kernels"][KERNEL] == [{"key": KEY, "ms": 1.0, **_config(64, 3)}]


def test_merge_keeps_the_shipped_keys_and_replaces_the_tuned_ones():
    from of3_megafold.kernels.evoflash.configs import lists_fingerprint

    other_key = KEY[:-1] + ["torch.float32"]
    shipped = {
        "lists": {KERNEL: lists_fingerprint(KERNEL)},
        "kernels": {KERNEL: [
            {"key": KEY, "ms": 5.0, **_config(128, 2)},
            {"key": other_key, "ms": 1.0, **_config(64, 2)},
        ]},
    }
    best = {KERNEL: {tuple(KEY): (4.0, _config(64, 3))}}
    merged = ship_autotune.merged(shipped, best)
    assert merged[KERNEL] == {
        tuple(KEY): (4.0, _config(64, 3)),
        tuple(other_key): (1.0, _config(64, 2)),
    }


def test_merge_drops_the_entries_of_a_kernel_whose_list_changed(capsys):
    from of3_megafold.kernels.evoflash.configs import lists_fingerprint

    other = next(name for name in KERNELS if name != KERNEL)
    shipped = {
        "lists": {KERNEL: "0" * 16, other: lists_fingerprint(other)},
        "kernels": {KERNEL: [{"key": KEY, "ms": 5.0, **_config(128, 2)}],
                    other: [{"key": KEY, "ms": 2.0, **_config(64, 2)}]},
    }
    merged = ship_autotune.merged(shipped, {})
    assert merged[KERNEL] == {}
    assert merged[other] == {tuple(KEY): (2.0, _config(64, 2))}
    assert f"{KERNEL}: the shipped entries were tuned over another config" in (
        capsys.readouterr().out)
    # a table from before per-kernel fingerprints keeps nothing
    legacy = ship_autotune.merged({**shipped, "lists": "c19daaf0704dcfd7"}, {})
    assert all(not keys for keys in legacy.values())
