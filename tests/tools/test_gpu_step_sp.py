"""tools/gpu_step_sp.py as a CPU dry run: two gloo ranks, OF3's tiny config."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", "2", "-m", "tools.gpu_step_sp", str(out),
        "--config", "tiny", "--provider", "stock", "--n-msa", "4", "--n-templ", "1",
        "--repeats", "1", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, check=False,
        cwd=ROOT,
    )


def test_two_ranks_write_one_row_per_size(tmp_path):
    out = tmp_path / "step_sp.json"
    done = _launch(out, "--tokens", "9,16")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["provider"], r["n_token"], r["sp_size"]) for r in rows] == [
        ("stock+sp2", 9, 2),
        ("stock+sp2", 16, 2),
    ]
    for row in rows:
        assert row["mode"] == "step_sp" and row["split_diffusion"] is True
        assert row["recycles"] == 1 and row["ms"] > 0
        assert row["peak_gib"] is None  # no CUDA memory to report on the CPU
        assert math.isfinite(row["loss"]["loss"]) and row["loss"]["loss"] > 0


def test_replicated_diffusion_is_recorded(tmp_path):
    out = tmp_path / "step_sp.json"
    done = _launch(out, "--tokens", "9", "--replicate-diffusion")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["split_diffusion"] is False


def test_memory_windows_report_per_rank(tmp_path):
    out = tmp_path / "step_sp.json"
    done = _launch(out, "--tokens", "9", "--memory-windows", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"step_sp.memory-9-rank{rank}.txt").read_text().splitlines()
        assert lines[0].startswith("peak 0.00 GiB over ")  # no CUDA allocator here
        assert len(lines) == 6
        # the sharded pairformer's blocks and the loss module fired their hooks
        windows = int(lines[0].split(" over ")[1].split()[0])
        assert windows > 50
