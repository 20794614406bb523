"""The SP collectives, forward and backward, against single-process autograd.

Each check computes a loss that involves every rank's shard through a nonlinearity,
once on P gloo processes through the collective and once in one process on the full
tensor, and compares values and gradients (float64). Per the gradient convention of
:mod:`of3_megafold.parallel.comm`, a rank's local loss in the sharded region is
back-propagated with weight P, and gradients of sharded tensors come back P x true.
"""

import pytest
import torch
import torch.distributed as dist

from of3_megafold.errors import KitConfigError
from of3_megafold.parallel import comm, groups
from tests.parallel.launch import run_on_ranks


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=what)


def _check_scatter(rank, p, group, rand):
    full = rand(2, 3 * p, 5)
    weights = rand(p, 2, 3, 5)
    x = full.clone().requires_grad_()
    local = comm.scatter_to_sp(x, 1, group)
    (p * (local.tanh() * weights[rank]).sum()).backward()

    ref = full.clone().requires_grad_()
    shards = zip(ref.chunk(p, 1), weights, strict=True)
    sum((s.tanh() * w).sum() for s, w in shards).backward()
    _close(local, full.chunk(p, 1)[rank], "scatter_to_sp forward")
    _close(x.grad, ref.grad, "scatter_to_sp backward")


def _check_gather(rank, p, group, rand):
    full = rand(3, 7, 5 * p)
    grad_out = rand(3, 7, 5 * p)
    x = full.chunk(p, -1)[rank].clone().requires_grad_()
    y = comm.gather_from_sp(x, -1, group)
    (y.sin() * grad_out).sum().backward()

    ref = full.clone().requires_grad_()
    (ref.sin() * grad_out).sum().backward()
    _close(y, full, "gather_from_sp forward")
    _close(x.grad, p * ref.grad.chunk(p, -1)[rank], "gather_from_sp backward")


def _check_gather_for_local_use(rank, p, group, rand):
    full = rand(2, 3 * p, 7)
    weights = rand(p, 2, 3 * p, 7)
    x = full.chunk(p, 1)[rank].clone().requires_grad_()
    y = comm.gather_for_local_use(x, 1, group)
    (p * (y.tanh() * weights[rank]).sum()).backward()

    ref = full.clone().requires_grad_()
    sum((ref.tanh() * w).sum() for w in weights).backward()
    _close(y, full, "gather_for_local_use forward")
    _close(x.grad, p * ref.grad.chunk(p, 1)[rank], "gather_for_local_use backward")


def _check_async_gather_is_the_gather(rank, p, group, rand):
    """The split gather gives the synchronous one's bits, forward and backward,
    with compute issued while it is in flight."""
    full = rand(2, 3 * p, 7)
    weights = rand(p, 2, 3 * p, 7)
    results = []
    for start in (True, False):
        x = full.chunk(p, 1)[rank].clone().requires_grad_()
        if start:
            pending = comm.start_gather_for_local_use(x, 1, group)
            independent = (x * 2).exp().sum()  # runs while the gather is in flight
            y = pending.wait()
        else:
            independent = (x * 2).exp().sum()
            y = comm.gather_for_local_use(x, 1, group)
        (p * (y.tanh() * weights[rank]).sum() + independent).backward()
        results.append((y.detach(), x.grad))
    (y_async, grad_async), (y_sync, grad_sync) = results
    assert torch.equal(y_async, y_sync), "async gather forward"
    assert torch.equal(grad_async, grad_sync), "async gather backward"


def _check_swap(rank, p, group, rand):
    full = rand(2, 3 * p, 2 * p, 5)
    weights = rand(p, 2, 3 * p, 2, 5)
    rows = full.chunk(p, -3)[rank].clone().requires_grad_()
    cols = comm.swap_shard_axis(rows, -3, -2, group)
    _close(cols, full.chunk(p, -2)[rank], "swap_shard_axis forward")
    _close(comm.swap_shard_axis(cols, -2, -3, group), rows, "swap back")
    (p * (cols.sin() * weights[rank]).sum()).backward()

    ref = full.clone().requires_grad_()
    shards = zip(ref.chunk(p, -2), weights, strict=True)
    sum((c.sin() * w).sum() for c, w in shards).backward()
    _close(rows.grad, p * ref.grad.chunk(p, -3)[rank], "swap_shard_axis backward")


def _check_average(rank, p, group, rand):
    full = rand(4, 5)
    weights = rand(p, 4, 5)
    x = full.clone().requires_grad_()
    y = comm.average_over_sp(x, group)
    (y * weights[rank]).tanh().sum().backward()

    ref = full.clone().requires_grad_()
    (sum((ref * w).tanh().sum() for w in weights) / p).backward()
    _close(y, full, "average_over_sp forward")
    _close(x.grad, ref.grad, "average_over_sp backward")


def _collectives_body(rank, world_size, seed):
    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    for check in (
        _check_scatter,
        _check_gather,
        _check_gather_for_local_use,
        _check_async_gather_is_the_gather,
        _check_swap,
        _check_average,
    ):
        check(rank, world_size, group, rand)
    with pytest.raises(ValueError, match="not divisible"):
        comm.scatter_to_sp(rand(2, 3 * world_size + 1), 1, group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_single_process(tmp_path, world_size):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_collectives_body, world_size, tmp_path, seed)


def test_no_group_is_identity():
    x = torch.randn(3, 4, requires_grad=True)
    for op in (comm.scatter_to_sp, comm.gather_from_sp, comm.gather_for_local_use):
        assert op(x, 0, None) is x
    assert comm.swap_shard_axis(x, 0, 1, None) is x
    assert comm.average_over_sp(x, None) is x
    assert comm.start_gather_for_local_use(x, 0, None).wait() is x


def _groups_body(rank, world_size):
    layout = groups.init_sequence_parallel(2)
    assert groups.sp_size() == 2 and groups.sp_group() is layout.sp_group
    assert comm.group_rank(groups.sp_group()) == rank % 2
    # The group is this rank and its neighbour: consecutive ranks.
    members = torch.tensor([float(rank)])
    dist.all_reduce(members, group=groups.sp_group())
    first = rank - rank % 2
    assert members.item() == first + first + 1
    with pytest.raises(KitConfigError, match="does not divide the world size 4"):
        groups.init_sequence_parallel(3)
    groups.reset_sequence_parallel()


def test_groups_of_consecutive_ranks(tmp_path):
    run_on_ranks(_groups_body, 4, tmp_path)


def test_sequence_parallel_needs_distributed():
    with pytest.raises(KitConfigError, match="needs torch.distributed"):
        groups.init_sequence_parallel(2)
    assert groups.init_sequence_parallel(1).sp_group is None
    assert groups.sp_size() == 1 and groups.sp_group() is None
