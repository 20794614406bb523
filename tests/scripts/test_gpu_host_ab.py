"""scripts/gpu_host_ab.py on the CPU: its options and the old-commit copy (the
timing itself needs CUDA)."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_host_ab.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_host_ab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unknown_variants_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--variants", "kit,bogus"])
    assert exit_info.value.code == 2
    assert "unknown variants ['bogus']" in capsys.readouterr().err


def test_prepare_copies_the_kit_under_another_name(tmp_path, monkeypatch):
    root = SCRIPT.parents[1]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("not a git checkout")
    script = _script()
    monkeypatch.setattr(script, "OLD", tmp_path)
    script.main(["--prepare", "HEAD"])
    copied = tmp_path / "of3mf_old"
    assert (tmp_path / "COMMIT").read_text().strip() == "HEAD"
    core = (copied / "bench" / "attention_core.py").read_text()
    assert "of3_megafold" not in core and "of3mf_old" in core
    assert (copied / "kernels" / "evoflash" / "tuned").is_dir()
