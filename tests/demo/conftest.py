"""One demo set, built once per test session, shared by the demo tests."""

from pathlib import Path

import pytest

from of3_megafold.demo.build import ensure_demo_dataset


@pytest.fixture(autouse=True)
def kit_active():
    """``runner_yamls/demo.yml`` carries the kit's keys: the kit must be active."""
    from of3_megafold import activate

    activate()


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    """A demo set built from the installed openfold3's test data, in a tmp dir."""
    return ensure_demo_dataset(tmp_path_factory.mktemp("demo-cache"), progress=False)
