"""OF3's per-sample gradient clipping with the sample spread over an SP group.

OF3 clips each sample's gradient to ``clip_val`` before the data-parallel average
(``PerSampleGradManager``). Under sequence parallelism a rank's gradient is not
its sample's: by the convention of :mod:`of3_megafold.parallel.comm`, the
sample's gradient is the mean of the group's ranks' gradients. So before OF3
measures and clips, each rank's gradient is replaced by that mean (one
``all_reduce`` over the SP group, not the world); every rank of the group then
clips the same gradient with the same norm, and OF3's world average of the
clipped gradients (divided by the number of ranks, ``dp x sp``) is the mean of
the replicas' clipped sample gradients, as in one process per sample.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from of3_megafold.parallel.comm import Group, group_size


@torch.no_grad()
def average_gradients_over_sp(params: Mapping[str, torch.nn.Parameter], group: Group):
    """Set every parameter's ``.grad`` to its mean over the SP group (collective).

    A parameter without a gradient on some ranks counts as zero there; one with no
    gradient on any rank keeps ``None``.

    Args:
        params: name -> parameter, the same names in the same order on every rank.
        group: the SP group (``None`` or size 1: nothing to do).
    """
    size = group_size(group)
    if size == 1:
        return
    names = list(params)
    has_grad = torch.tensor(
        [params[n].grad is not None for n in names], dtype=torch.int32
    )
    device = next(iter(params.values())).device
    has_grad = has_grad.to(device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    present = [
        params[n] for n, flag in zip(names, has_grad.tolist(), strict=True) if flag
    ]
    if not present:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in present]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= size
    for param, mean in zip(present, _unflatten_dense_tensors(flat, grads), strict=True):
        if param.grad is None:
            param.grad = mean.clone()
        else:
            param.grad.copy_(mean)
