"""Every tool is a module of the ``tools`` package: it imports from the repository
root without editing ``sys.path`` and has a ``main`` for ``python -m tools.<name>``."""

import importlib
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
NAMES = sorted(p.stem for p in TOOLS.glob("*.py") if p.stem != "__init__")


def test_the_set_is_found():
    assert {"gpu_step", "ship_autotune", "pack_device_wheels"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_imports_with_a_main(name):
    source = (TOOLS / f"{name}.py").read_text()
    assert "sys.path" not in source
    assert 'if __name__ == "__main__":' in source
    module = importlib.import_module(f"tools.{name}")
    assert callable(module.main)
