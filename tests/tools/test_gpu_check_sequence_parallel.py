"""The GPU sequence-parallel check script, dry-run on CPU (gloo, small dims)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_dry_run_reports_small_errors():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_check_sequence_parallel",
            "--cpu",
            "--ranks",
            "2",
            "--tokens",
            "9",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    errors = re.findall(
        r"(outputs|input grads|param grads \(world avg\)) "
        r"([0-9.e+-]+)",
        result.stdout,
    )
    assert [name for name, _ in errors] == [
        "outputs",
        "input grads",
        "param grads (world avg)",
    ], result.stdout
    assert all(float(value) < 1e-4 for _, value in errors), result.stdout
    assert "sharded over 2" in result.stdout
