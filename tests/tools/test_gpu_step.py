"""tools/gpu_step.py as a CPU dry run on OF3's tiny config."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_dry_run_takes_a_fixed_recycle_count(tmp_path):
    out = tmp_path / "step.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpu_step",
            str(out),
            "--config",
            "tiny",
            "--providers",
            "stock",
            "--tokens",
            "16",
            "--launch-tokens",
            "none",
            "--no-max-crop",
            "--repeats",
            "1",
            "--num-recycles",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=True,
    )
    rows = json.loads(out.read_text())
    assert [(r["provider"], r["n_token"], r["recycles"]) for r in rows] == [
        ("stock", 16, 1)
    ]
