"""scripts/gpu_session.sh: valid bash, and every script a step runs is in the tree."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "scripts" / "gpu_session.sh"


def test_parses_as_bash():
    done = subprocess.run(["bash", "-n", str(SESSION)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_step_script_exists():
    scripts = set(re.findall(r"scripts/[A-Za-z0-9_]+\.py", SESSION.read_text()))
    assert "scripts/gpu_transition_ab.py" in scripts  # the lookup finds steps
    missing = sorted(s for s in scripts if not (ROOT / s).is_file())
    assert not missing, missing
