"""The GPU check of the sharded triangle multiplication's schedule, on the CPU: the
replayed collectives give each rank what the group would, so the sharded update
matches the unsharded kernel; with a collective's result left out it does not."""

import pytest

from tools import gpu_check_sharded_triangle_multiplication as tool


@pytest.mark.usefixtures("interpreted_kernels")
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_replayed_group_matches_the_unsharded_kernel(outgoing):
    errors = tool.check(8, 2, outgoing, "cpu", seed=3)
    assert set(errors) == set(tool.NAMES)
    for name, (sharded, unsharded) in errors.items():
        assert sharded <= 2 * unsharded + tool.FLOOR, (name, sharded, unsharded)


@pytest.mark.usefixtures("interpreted_kernels")
def test_a_missing_reduce_scatter_is_caught(monkeypatch):
    """The reduce-scatter's result replaced by zeros (the ranks' sum of the
    gathered operand's gradient lost): the check reports it."""
    real = tool.Replay.__init__

    def no_scatters(self, rank, size, gathers=(), scatters=(), **kwargs):
        real(self, rank, size, gathers, (), **kwargs)

    monkeypatch.setattr(tool.Replay, "__init__", no_scatters)
    errors = tool.check(8, 2, True, "cpu", seed=3)
    sharded, unsharded = errors["dz"]
    assert sharded > 2 * unsharded + tool.FLOOR, errors
