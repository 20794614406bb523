"""Foreach loop: OF3's per-step EMA update and per-sample gradient clipping as
``torch._foreach_*`` ops over tensor lists.

Key: ``model_update.custom.settings.memory.train.use_foreach_loop`` (default false).

OF3's training loop walks its parameter tensors one by one in Python, several
times per optimizer step:

- ``ExponentialMovingAverage.update`` (after every optimizer step) runs three
  kernels per state-dict tensor: ``diff = stored - new; diff *= 1 - decay;
  stored -= diff``;
- ``PerSampleGradManager.clip_and_accumulate`` (after every sample's backward, with
  OF3's default per-sample clipping) takes the norm of every gradient, scales
  every gradient by the clip factor and adds every gradient to its accumulator.

With the key on, each of these is a few foreach ops per (device, dtype) group of
tensors, with the same arithmetic per element in the same order: the EMA's
``stored - (stored - new) * (1 - decay)``, the global norm as OF3's
``vector_norm(stack([vector_norm(g.float()) for g in grads]))`` (per-tensor norms in
fp32, stacked in parameter order), ``grad * clip_coef`` and ``accumulator + grad``.
Entries the EMA cannot average (integer or bool buffers) raise the same
``RuntimeError`` as in OF3's loop. OF3's ``submodules_to_update`` filter, its
warning when it matches nothing, its gradient-norm metrics and its outlier log
(with its ``.item()``) are kept.

Adam is not patched: OF3 builds ``torch.optim.Adam`` without ``foreach``/``fused``,
and torch then takes its foreach path whenever every parameter is on CUDA
(``torch.optim.optimizer._default_to_fused_or_foreach``); ``fused=True`` gives a
different rounding and is not used.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from of3_megafold import registry

NAME = "foreach_loop"
FLAG = "use_foreach_loop"
KEY = registry.ConfigKey(
    ("settings", "memory", "train", FLAG),
    False,
    "train: OF3's EMA update and per-sample gradient clipping as torch foreach "
    "ops over the tensor lists (same arithmetic per element; fewer host-issued "
    "kernels)",
)


def group_indices(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` by (device, dtype), groups in order of first
    appearance: a foreach op takes its fast path on one device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


@torch.no_grad()
def ema_update_(
    stored: Sequence[torch.Tensor], new: Sequence[torch.Tensor], decay: float
) -> None:
    """``stored[i] -= (stored[i] - new[i]) * (1 - decay)`` in place for every ``i``
    (OF3's three ops, in its order), grouped by ``stored``'s device and dtype.

    Args:
        stored: EMA tensors, any shapes, updated in place.
        new: the model's tensors, ``new[i]`` the shape of ``stored[i]``.
        decay: the EMA decay.
    """
    for index in group_indices(stored).values():
        ema = [stored[i] for i in index]
        diff = torch._foreach_sub(ema, [new[i] for i in index])
        torch._foreach_mul_(diff, 1 - decay)
        torch._foreach_sub_(ema, diff)


@torch.no_grad()
def global_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` as OF3's ``compute_global_norm`` takes it: each
    tensor's norm in fp32, then the norm of those norms stacked in ``grads``'s
    order. ``grads`` non-empty, on one device; returns a 0-dim fp32 tensor."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    for index in group_indices(grads).values():
        group = torch._foreach_norm([grads[i] for i in index], 2, dtype=torch.float32)
        for i, norm in zip(index, group, strict=True):
            norms[i] = norm
    return torch.linalg.vector_norm(torch.stack(norms), ord=2)


@torch.no_grad()
def scale_(grads: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """``g *= factor`` for every gradient, ``factor`` (0-dim) cast to each group's
    dtype as OF3's ``p.grad.mul_(clip_coef.to(p.dtype))``."""
    for (_, dtype), index in group_indices(grads).items():
        torch._foreach_mul_([grads[i] for i in index], factor.to(dtype))


@torch.no_grad()
def accumulate_(
    accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> None:
    """``accumulators[i] += grads[i]`` for every ``i``, grouped by device and dtype."""
    for index in group_indices(accumulators).values():
        torch._foreach_add_([accumulators[i] for i in index],
                            [grads[i] for i in index])


def _enabled(model: Any) -> bool:
    """Forced on, or ``model``'s ``settings.memory.train.use_foreach_loop`` is on
    (whatever the model's mode: both patched steps belong to training)."""
    if registry.forced_variant(NAME) is not None:
        return True
    memory = getattr(model, registry.MEMORY_ATTR, None)
    return memory is not None and bool(memory.train.get(FLAG, False))


def ema_pairs(
    update: Mapping[str, Any], stored: Mapping[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(stored, new) tensor pairs of OF3's ``_update_state_dict_(update, stored)``,
    in its order, nested mappings walked as it walks them."""
    ema, new = [], []
    for key, value in update.items():
        if isinstance(value, torch.Tensor):
            ema.append(stored[key])
            new.append(value)
        else:
            more = ema_pairs(value, stored[key])
            ema += more[0]
            new += more[1]
    return ema, new


def ema_update(ema: Any, model: torch.nn.Module) -> None:
    """OF3's ``ExponentialMovingAverage.update(model)`` on ``ema`` (an OF3
    ``ExponentialMovingAverage``) with :func:`ema_update_`: the same
    ``submodules_to_update`` filter and warning."""
    state = model.state_dict()
    if ema.submodules_to_update is not None:
        prefixes = ema.submodules_to_update
        state = OrderedDict(
            (key, value) for key, value in state.items()
            if any(key == p or key.startswith(f"{p}.") for p in prefixes)
        )
        if not state:
            warnings.warn(
                "ExponentialMovingAverage: No parameters found for the specified "
                f"submodules_to_update: {prefixes}.",
                stacklevel=3,
            )
            return
    ema_update_(*ema_pairs(state, ema.params), ema.decay)


def clip_and_accumulate(
    manager: Any, logging_info: dict | None = None, disabled_params: set | None = None
) -> None:
    """OF3's ``PerSampleGradManager.clip_and_accumulate`` on ``manager`` with
    :func:`global_norm`, :func:`scale_` and :func:`accumulate_`: the same metrics,
    outlier log, participation counts and sample count."""
    disabled = disabled_params or set()
    names = [name for name, p in manager._params_to_update.items()
             if name not in disabled and p.grad is not None]
    grads = [manager._params_to_update[name].grad for name in names]
    with torch.no_grad():
        if grads:
            _clip_and_accumulate(manager, names, grads, logging_info)
    manager.accum_count += 1


def _clip_and_accumulate(
    manager: Any, names: list[str], grads: list[torch.Tensor], logging_info: Any
) -> None:
    """OF3's ``_clip_grads`` and accumulation loop for the gradients ``grads`` of
    the parameters ``names`` (non-empty)."""
    norm = global_norm(grads)
    if manager.log_grad_norm:
        manager.avg_unclipped_norm_metric.update(norm)
        manager.max_unclipped_norm_metric.update(norm)
    if manager.max_grad_norm is not None:
        manager.log_outlier_samples(logging_info=logging_info,
                                    global_norm=norm.item())
        # as OF3's: torch.maximum rather than a host-side comparison
        limit = manager._max_norm_tensor
        scale_(grads, limit / torch.maximum(norm, limit))
    accumulate_([manager.grad_accumulator[name] for name in names], grads)
    counts = manager.parameter_participation_counts
    for name in names:
        counts[name] = counts.get(name, 0) + 1


def _patch_ema_update(original):
    def update(self, model: torch.nn.Module) -> None:
        if not _enabled(model):
            return original(self, model)
        return ema_update(self, model)

    return update


def _patch_clip_and_accumulate(original):
    def patched(
        self, logging_info: dict | None = None, disabled_params: set | None = None
    ) -> None:
        if not _enabled(self._model):
            return original(self, logging_info=logging_info,
                            disabled_params=disabled_params)
        return clip_and_accumulate(self, logging_info, disabled_params)

    return patched


EXTENSION = registry.register(
    registry.Extension(
        name=NAME,
        summary="OF3's EMA update and per-sample gradient clipping as foreach ops "
        "over the tensor lists (host time of every optimizer step)",
        keys=(KEY,),
        requested=registry.any_key_on((KEY,)),
        enable_update={"settings": {"memory": {"train": {FLAG: True}}}},
        docs=f"docs/extensions/{NAME}.md",
        patches=(
            registry.Patch(
                "openfold3.core.utils.exponential_moving_average:"
                "ExponentialMovingAverage.update",
                _patch_ema_update,
            ),
            registry.Patch(
                "openfold3.core.utils.grad_manager:"
                "PerSampleGradManager.clip_and_accumulate",
                _patch_clip_and_accumulate,
            ),
        ),
    )
)
