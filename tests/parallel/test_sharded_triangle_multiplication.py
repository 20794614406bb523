"""The fused triangle multiplication on sequence parallelism's shards, launched
kernel by kernel: accuracy and the overlap of its collectives.

On 2 and 3 gloo ranks (kernels interpreted on the CPU), each rank runs
``fused_triangle_multiplication`` on its rows (outgoing) or columns (incoming) of
``z`` with ``GroupExchange``. Its output and input-gradient shards, and its parameter
gradients summed over the ranks, meet the kernels' own rule against the fp64
oracle on the whole ``z`` (``tests/kernels/test_triangle_multiplication.py``).
Each collective is launched before the GEMM that does not need it and waited for
after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from of3_megafold.kernels.triangle_multiplication import function
from of3_megafold.parallel.comm import GroupExchange
from tests.kernels.test_triangle_multiplication import (
    FLOOR,
    NAMES,
    _inputs,
    _outputs,
)
from tests.parallel.launch import run_on_ranks

N, CZ, CH, LEAD = 6, 16, 16, (2,)


class _Recorded(GroupExchange):
    """``GroupExchange`` that logs each launch and wait with the number of batched
    GEMMs issued so far."""

    def __init__(self, group, log, gemms):
        super().__init__(group)
        self._log, self._gemms = log, gemms

    def _record(self, name, launched):
        self._log.append((f"start {name}", self._gemms[0]))
        wait = launched.wait

        def waited():
            self._log.append((f"wait {name}", self._gemms[0]))
            return wait()

        launched.wait = waited
        return launched

    def start_gather(self, t):
        return self._record("gather", super().start_gather(t))

    def start_reduce_scatter(self, t):
        return self._record("reduce_scatter", super().start_reduce_scatter(t))


def _shard(t, outgoing, rank, size):
    """This rank's rows (outgoing) or columns (incoming) of ``[*, N, N(, C)]``."""
    dim = (
        (-3 if outgoing else -2)
        if t.dim() == len(LEAD) + 3
        else (-2 if outgoing else -1)
    )
    return t.chunk(size, dim=dim)[rank].contiguous()


def _sharded_body(rank, world_size, outgoing, seed):
    group = dist.new_group(list(range(world_size)))
    z, mask, params, dout = _inputs(LEAD, N, CZ, CH, torch.bfloat16, "cpu", True, seed)
    want = _outputs(
        function.triangle_multiplication_reference,
        z.double(),
        mask,
        [p.double() for p in params],
        dout.double(),
        outgoing=outgoing,
        upcast=True,
    )
    of3 = _outputs(
        function.triangle_multiplication_reference,
        z,
        mask,
        params,
        dout,
        outgoing=outgoing,
    )

    gemms, log = [0], []
    bmm = torch.bmm

    def counted(*args, **kwargs):
        gemms[0] += 1
        return bmm(*args, **kwargs)

    torch.bmm = counted
    try:
        exchange = _Recorded(group, log, gemms)
        got = _outputs(
            function.fused_triangle_multiplication,
            *(_shard(t, outgoing, rank, world_size) for t in (z, mask)),
            params,
            _shard(dout, outgoing, rank, world_size),
            outgoing=outgoing,
            exchange=exchange,
        )
    finally:
        torch.bmm = bmm
    # forward: this rank's block before the gather completes, the others' after
    # it; backward: the gathered operand's gradient (one GEMM per rank's block)
    # before the gather completes, the other operand's gradient before the
    # reduce-scatter of the first does.
    assert log == [
        ("start gather", 0),
        ("wait gather", 1),
        ("start gather", world_size),
        ("start reduce_scatter", 2 * world_size),
        ("wait gather", 2 * world_size),
        ("wait reduce_scatter", 2 * world_size + 1),
    ], (log, seed)

    for grad in got[2:]:
        dist.all_reduce(grad, group=group)
    for i, (name, g, o, w) in enumerate(zip(NAMES, got, of3, want, strict=True)):
        if i < 2:  # the output and dz: this rank's shard
            o, w = (_shard(t, outgoing, rank, world_size) for t in (o, w))
        assert g.shape == w.shape, (name, g.shape, w.shape, seed)
        err = (g.double() - w).abs().max().item()
        err_of3 = (o.double() - w).abs().max().item()
        allowed = 2 * err_of3 + FLOOR[torch.bfloat16] * w.abs().max().item()
        assert err <= allowed, (name, rank, err, err_of3, allowed, seed)


@pytest.mark.usefixtures("interpreted_kernels")
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_update_matches_the_oracle_and_overlaps(ranks, outgoing, tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_sharded_body, ranks, tmp_path, outgoing, seed)
