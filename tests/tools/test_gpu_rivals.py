"""tools/gpu_rivals.py as a CPU dry run (each benchmark's interpreter smoke case),
and the size overrides it passes to the benchmarks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from of3_megafold.bench import attention_core, transition

ROOT = Path(__file__).resolve().parents[2]


def test_size_overrides_pick_the_cases():
    cases = attention_core._cases(False, True, {"triangle": (300,), "diffusion": ()})
    assert [(c["case"], c["shape"]) for c in cases] == [
        ("triangle", (1, 300, 300, 4, 32))
    ]
    cases = transition._cases(False, True, {"pair": (100,), "single": ()})
    assert [c["shape"] for c in cases] == [(1, 100, 100, 128)]


def test_transition_dry_run_writes_rows(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "tools.gpu_rivals", str(tmp_path)]
        + ["--what", "transition"],
        check=True,
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    rows = json.loads((tmp_path / "transition.json").read_text())
    assert [r["provider"] for r in rows] == ["of3-eager", "kit"]
    assert all(r["ms"] > 0 for r in rows)
