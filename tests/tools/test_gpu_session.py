"""tools/gpu_session.sh: valid bash, and every tool a step runs is in the tree."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "tools" / "gpu_session.sh"


def test_parses_as_bash():
    done = subprocess.run(["bash", "-n", str(SESSION)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_step_module_exists():
    modules = set(re.findall(r"-m (tools\.[A-Za-z0-9_]+)", SESSION.read_text()))
    assert "tools.gpu_step_sp" in modules  # the lookup finds steps
    missing = sorted(
        m for m in modules if not (ROOT / (m.replace(".", "/") + ".py")).is_file()
    )
    assert not missing, missing


def test_no_step_runs_a_script_by_path():
    # tools are modules (`python -m tools.<name>`), run from the repository root
    assert not re.findall(r"python3? (?:scripts|tools)/\S+\.py", SESSION.read_text())
