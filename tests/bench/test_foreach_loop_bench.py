"""The foreach-loop timing helper runs OF3's and the kit's paths on a module."""

import pytest
import torch

from of3_megafold.bench import foreach_loop as bench


@pytest.fixture
def kit_active():
    """The kit active, so OF3's clipping is patched and the helper must unwrap it."""
    from of3_megafold import activate

    activate()
    yield


def test_times_each_path_and_keeps_the_parameters(kit_active):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    before = [p.detach().clone() for p in module.parameters()]
    times = bench.time_foreach_loop(module, calls=2)
    assert set(times) == {"ema_stock", "ema_foreach", "clip_stock", "clip_foreach"}
    assert all(ms > 0 for ms in times.values())
    for p, q in zip(module.parameters(), before, strict=True):
        assert torch.equal(p, q)
        assert p.grad is not None


def test_stock_clipping_is_of3s_own_function(kit_active):
    from openfold3.core.utils.grad_manager import PerSampleGradManager

    stock = bench._of3_function(PerSampleGradManager, "clip_and_accumulate")
    assert stock.__module__ == "openfold3.core.utils.grad_manager"
    assert PerSampleGradManager.clip_and_accumulate is not stock
