"""Autograd collectives over a sequence-parallel (SP) group.

Gradient convention
-------------------
Every rank's gradients are averaged over the **whole world** by ordinary data
parallelism (DDP, DeepSpeed), SP ranks included. For that average to be the true
data-parallel gradient:

- a *replicated* tensor (the same value on every SP rank, e.g. the single
  representation ``s``) carries its **true** gradient on every rank;
- inside the *sharded* region (each SP rank holds a different slice, e.g. rows of
  the pair representation ``z``) activation gradients are carried **multiplied by
  the SP size P**.

Then a parameter used only in sharded compute receives ``P x`` its partial gradient
on each rank; the world average ``(1/W) sum_r P g_r`` over ``W = P x DP`` ranks is the
mean over SP groups of ``sum_{r in group} g_r``, the true per-sample gradient,
averaged over data parallelism. A parameter used in replicated compute receives the
full gradient on each rank, which averages to itself. Each function below keeps the
convention at its boundary:

==========================  ======================  ==============================
function                    forward                 backward
==========================  ======================  ==============================
``scatter_to_sp``           replicated -> shard     all-gather, divide by P
``gather_from_sp``          shard -> replicated     local slice, multiply by P
``gather_for_local_use``    shard -> full, used     reduce-scatter (sum)
                            for local rows only
``start_gather_for_local``  the same, launched      the same
``_use`` + ``.wait()``      now, completed later
``swap_shard_axis``         all_to_all              inverse all_to_all
``average_over_sp``         identity                all-reduce mean
==========================  ======================  ==============================

``group=None`` means "no sequence parallelism": every function is the identity (in
both directions), so a single-process run is stock. A sharded axis must be divisible
by the group size; :class:`of3_megafold.parallel.shards.TokenShards` pads at the
stack entry.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _local_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the "
            f"sequence-parallel size {size}; pad it first"
        )
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(group_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: Group):
    """Send the i-th chunk along ``split_dim`` to rank i; concatenate what arrives
    along ``cat_dim`` in rank order."""
    sends = [p.contiguous() for p in x.chunk(group_size(group), dim=split_dim)]
    receives = [torch.empty_like(p) for p in sends]
    dist.all_to_all(receives, sends, group=group)
    return torch.cat(receives, dim=cat_dim)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        full = _all_gather(grad, ctx.dim, ctx.group)
        return full / group_size(ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        local = _local_slice(grad, ctx.dim, ctx.group)
        return local * group_size(ctx.group), None, None


class _GatherForLocalUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _SwapShardAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, from_dim, to_dim, group):
        ctx.from_dim, ctx.to_dim, ctx.group = from_dim, to_dim, group
        return _all_to_all(x, split_dim=to_dim, cat_dim=from_dim, group=group)

    @staticmethod
    def backward(ctx, grad):
        back = _all_to_all(
            grad, split_dim=ctx.from_dim, cat_dim=ctx.to_dim, group=ctx.group
        )
        return back, None, None, None


class _AverageOverSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / group_size(ctx.group), None


def scatter_to_sp(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Replicated ``x`` -> this rank's slice along ``dim`` (enters the sharded region).

    Args:
        x: ``[..., N, ...]`` the same on every rank of ``group``; ``N`` (at ``dim``)
            divisible by the group size P.
        dim: the axis to shard.
        group: the SP group, or ``None`` for the identity.

    Returns:
        ``[..., N / P, ...]``, the ``sp_rank``-th contiguous slice. Backward
        all-gathers the slices' gradients and divides by P.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToSP.apply(x, dim, group)


def gather_from_sp(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's slice -> the full tensor, used identically on every rank (leaves
    the sharded region).

    Args:
        x: ``[..., N / P, ...]`` this rank's slice along ``dim``.

    Returns:
        ``[..., N, ...]`` in rank order. Backward takes the local slice of the (true,
        replicated) gradient and multiplies it by P.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, dim, group)


def gather_for_local_use(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's slice -> the full tensor, which each rank uses for its *own* rows
    only (the ``b`` operand of the outgoing triangle multiplication, the triangle
    attention bias).

    Args:
        x: ``[..., N / P, ...]`` this rank's slice along ``dim``.

    Returns:
        ``[..., N, ...]``. Backward reduce-scatters: each slice's gradient is the sum
        of every rank's partial contribution to it.
    """
    if group_size(group) == 1:
        return x
    return _GatherForLocalUse.apply(x, dim, group)


class _StartGatherForLocalUse(torch.autograd.Function):
    """``gather_for_local_use`` split in two: the forward launches the all-gather
    and returns the P parts it is filling; :meth:`PendingGather.wait` completes it.
    The backward is the same reduce-scatter."""

    @staticmethod
    def forward(ctx, x, dim, group, pending):
        ctx.dim, ctx.group = dim, group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        pending.work = dist.all_gather(parts, x, group=group, async_op=True)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        grad = torch.cat(grads, dim=ctx.dim)
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None


class PendingGather:
    """An all-gather in flight (:func:`start_gather_for_local_use`).

    Its parts must not be read before :meth:`wait`; compute that does not need
    them can run meanwhile.
    """

    def __init__(self, x: torch.Tensor, dim: int, group: Group) -> None:
        self.work = None
        self._dim = dim
        if group_size(group) == 1:
            self._parts = (x,)
        else:
            self._parts = _StartGatherForLocalUse.apply(x, dim, group, self)

    def wait(self) -> torch.Tensor:
        """The gathered tensor, as :func:`gather_for_local_use` returns it."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if len(self._parts) == 1:
            return self._parts[0]
        return torch.cat(self._parts, dim=self._dim)


def start_gather_for_local_use(
    x: torch.Tensor, dim: int, group: Group
) -> PendingGather:
    """:func:`gather_for_local_use`, asynchronous: launch it now, ``.wait()`` for
    the result. The values and gradients are those of the synchronous call; the
    difference is that compute issued between the two overlaps the transfer."""
    return PendingGather(x, dim, group)


class _Launched:
    """An asynchronous collective's work handle and the tensor(s) it fills."""

    def __init__(self, work, result) -> None:
        self._work, self._result = work, result

    def wait(self):
        self._work.wait()
        return self._result


class GroupExchange:
    """The collectives a sharded fused kernel launches inside its own autograd
    function (``of3_megafold.kernels.triangle_multiplication``'s ``ShardExchange``):
    asynchronous all-gather and reduce-scatter along dim 0 over ``group``, into
    and out of single tensors, with no autograd of their own."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = group_rank(group), group_size(group)

    def start_gather(self, t: torch.Tensor) -> _Launched:
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        work = _ALL_GATHER_SINGLE(out, t, group=self.group, async_op=True)
        return _Launched(work, out)

    def start_reduce_scatter(self, t: torch.Tensor) -> _Launched:
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        work = _REDUCE_SCATTER_SINGLE(out, t, group=self.group, async_op=True)
        return _Launched(work, out)


# Single-tensor collectives along dim 0: torch 2.13 names them ``*_single``; earlier
# releases ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, same arguments.
_ALL_GATHER_SINGLE = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_REDUCE_SCATTER_SINGLE = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def swap_shard_axis(
    x: torch.Tensor, from_dim: int, to_dim: int, group: Group
) -> torch.Tensor:
    """Re-shard with one ``all_to_all``: sharded along ``from_dim`` -> along ``to_dim``.

    For the pair representation, ``swap_shard_axis(z_rows, -3, -2)`` turns a row shard
    ``[B, N/P, N, C]`` into a column shard ``[B, N, N/P, C]`` holding the same values
    ``z[:, :, cols_of_rank]``; ``swap_shard_axis(z_cols, -2, -3)`` goes back. Each rank
    sends and receives ``(P - 1) / P`` of its shard. Backward is the inverse swap.
    """
    if group_size(group) == 1:
        return x
    return _SwapShardAxis.apply(x, from_dim, to_dim, group)


def average_over_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduce-mean of the gradient over ``group``.

    Where a replicated tensor feeds computations that differ per SP rank (keys and
    values of the single-rep attention for each rank's query rows, diffusion samples
    split across ranks), each rank's gradient is ``P x`` a partial one; their mean is
    the true gradient, replicated again.
    """
    if group_size(group) == 1:
        return x
    return _AverageOverSP.apply(x, group)
