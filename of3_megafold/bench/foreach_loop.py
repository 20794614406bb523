"""Host time of OF3's EMA update and per-sample clipping, stock against the
``foreach_loop`` extension, on one module's tensors.

A function, not a ``bench`` command: call it on a built model (the full OF3 model on
a GPU) to time what ``settings.memory.train.use_foreach_loop`` replaces::

    from of3_megafold.bench.foreach_loop import time_foreach_loop
    print(time_foreach_loop(model))
"""

from __future__ import annotations

import types
from typing import Any

import torch

from of3_megafold.bench.common import wall_ms_per_call
from of3_megafold.extensions import foreach_loop


def _of3_function(owner: type, name: str) -> Any:
    """OF3's own ``owner.name``, below any wrapper the kit installed."""
    function = getattr(owner, name)
    while function.__module__.startswith("of3_megafold."):
        function = function.__wrapped__
    return function


def time_foreach_loop(
    module: torch.nn.Module,
    *,
    calls: int = 10,
    decay: float = 0.999,
    clip: float = 10.0,
) -> dict[str, float]:
    """Mean wall time per call (ms, device synchronised around the timed calls) of

    - ``ema_stock``: OF3's ``ExponentialMovingAverage`` update of every state-dict
      tensor of ``module`` (its per-tensor loop);
    - ``ema_foreach``: :func:`foreach_loop.ema_update_` on the same tensors;
    - ``clip_stock``: OF3's ``PerSampleGradManager.clip_and_accumulate`` (global
      norm, clip, accumulate) on every trainable parameter's gradient;
    - ``clip_foreach``: :func:`foreach_loop.clip_and_accumulate` on the same.

    Parameters without a gradient get a random one (``module``'s gradients are
    overwritten by the clipping). ``module``'s parameters are left unchanged.
    """
    from openfold3.core.utils.exponential_moving_average import (
        ExponentialMovingAverage,
    )
    from openfold3.core.utils.grad_manager import PerSampleGradManager

    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.randn_like(p)
    ema = ExponentialMovingAverage(module, decay)
    ema.init_params(module)
    manager = PerSampleGradManager(gradient_clip_val=clip)
    manager.setup(module, types.SimpleNamespace(global_step=0), None)
    stock_clip = _of3_function(PerSampleGradManager, "clip_and_accumulate")

    def ema_stock() -> None:
        ema._update_state_dict_(module.state_dict(), ema.params)

    def ema_foreach() -> None:
        state = module.state_dict()
        foreach_loop.ema_update_(*foreach_loop.ema_pairs(state, ema.params), decay)

    def clip_stock() -> None:
        with torch.no_grad():
            stock_clip(manager)

    def clip_foreach() -> None:
        foreach_loop.clip_and_accumulate(manager)

    return {
        fn.__name__: wall_ms_per_call(fn, calls)
        for fn in (ema_stock, ema_foreach, clip_stock, clip_foreach)
    }
