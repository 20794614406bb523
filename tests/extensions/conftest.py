"""Extension tests build OF3's modules on the CPU; their kernel paths need the Triton
interpreter (CI and pixi's ``cpu`` environment set ``TRITON_INTERPRET=1``)."""

import pytest


@pytest.fixture
def kit():
    """The kit active with nothing forced, before and after the test (a test that
    forces an extension cannot leak it into the next)."""
    from of3_megafold import activate

    activate()
    yield
    activate()


@pytest.fixture
def device_fallback_messages(caplog):
    """What ``registry.log_device_fallback`` says from here on (its once-per-extension
    memory cleared first): call the fixture's value for the messages so far."""
    from of3_megafold import registry

    registry.log_device_fallback.cache_clear()
    caplog.set_level("INFO", logger="of3_megafold.registry")
    return lambda: [
        r.getMessage() for r in caplog.records if "run OF3's own path" in r.getMessage()
    ]
