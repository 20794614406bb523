"""The demo tests run with the kit active (``demo_dataset`` is in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def kit_active():
    """``runner_yamls/demo.yml`` carries the kit's keys: the kit must be active."""
    from of3_megafold import activate

    activate()
