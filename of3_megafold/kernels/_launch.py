"""Launching autotuned Triton kernels with the autotuner's per-call host work done once.

Triton's ``Autotuner.run`` rebuilds, on every launch, a dict of all the kernel's
arguments, filters it against the argument names and reads every tensor's dtype to
form its key; ``Heuristics.run`` builds another such dict per heuristic. For kernels
with ~50 arguments (strides of five tensors) that host work is a few tens of
microseconds per launch, several launches per forward + backward: at small shapes it,
not the GPU, sets the time (docs/benchmarks.md, "host overhead").

:class:`TunedKernel` keeps the autotuner as it is for the first launch of every
tuning key (benchmarking, on-disk cache, compilation all happen there) and remembers
the configuration it chose; later launches with that key go straight to the JIT
function's ``run`` with the chosen configuration and the heuristics' values, which is
what the autotuner itself ends up calling.

A kernel may also come with shipped choices (``presets``: the fastest configuration
per tuning key, measured on a GPU model beforehand): a key found there is launched
with that configuration on its first launch too, without benchmarking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from triton import Config
from triton.runtime.autotuner import Autotuner, Heuristics


class TunedKernel:
    """``kernel[grid](**kwargs)`` for a ``triton.autotune``/``triton.heuristics``
    wrapped kernel, with the dispatch done once per tuning key.

    Args:
        kernel: the decorated kernel: ``autotune(heuristics(jit))``, ``autotune(jit)``,
            ``heuristics(jit)`` or a bare JIT function.
        fixed: meta-parameters (e.g. block sizes) for a kernel that is not autotuned:
            under the Triton interpreter, where nothing is tuned.
        presets: called once, at the first launch of an autotuned kernel: returns
            ``{tuning key: {"kwargs", "num_warps", "num_stages"}}``, keys with dtypes
            as strings (as Triton writes them). An entry that names none of the
            autotuner's configurations is ignored.

    The tuning key is what the autotuner uses: its key arguments' values and the
    dtypes of all tensor arguments. Arguments may be positional (in the kernel's
    parameter order) or named.
    """

    def __init__(
        self,
        kernel: Any,
        fixed: Mapping[str, Any] | None = None,
        presets: Callable[[], Mapping[tuple, Mapping[str, Any]]] | None = None,
    ):
        self._entry = kernel
        self._tuner = kernel if isinstance(kernel, Autotuner) else None
        self._key_names = tuple(self._tuner.keys) if self._tuner else ()
        heuristics: dict[str, Callable[[dict], Any]] = {}
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            if isinstance(fn, Heuristics):
                heuristics.update(fn.values)
            fn = fn.fn
        self._jit = fn
        self._heuristics = heuristics
        self._fixed = dict(fixed or {})
        # tuning key -> (the config's meta-parameters, every launch option)
        self._chosen: dict[tuple, tuple[dict, dict]] = {}
        self._load_presets = presets
        self._presets: Mapping[tuple, Mapping[str, Any]] | None = None
        self.preset_keys: list[tuple] = []  # keys launched from presets, untuned

    def forget(self) -> None:
        """Drop the remembered choices: the next launch of every key goes through
        Triton's wrappers again (a checker that swaps the autotuner's configs)."""
        self._chosen.clear()

    @property
    def autotuner(self) -> Autotuner | None:
        """Triton's autotuner behind this kernel (its timings, best config), if any."""
        return self._tuner

    def __getitem__(self, grid) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            if args:  # named in the kernel's parameter order
                names = self._jit.arg_names
                if len(args) > len(names):
                    raise TypeError(f"{len(args)} arguments for {len(names)} params")
                kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
            self._launch(grid, kwargs)

        return launch

    def _key(self, kwargs: dict[str, Any]) -> tuple:
        return (
            *[kwargs[name] for name in self._key_names],
            *[v.dtype for v in kwargs.values() if isinstance(v, torch.Tensor)],
        )

    def _launch(self, grid, kwargs: dict[str, Any]) -> None:
        key = self._key(kwargs)
        chosen = self._chosen.get(key)
        if chosen is None:
            self._first_launch(key, grid, kwargs)
            return
        meta, options = chosen
        if self._heuristics:
            merged = {**kwargs, **meta}
            for name, rule in self._heuristics.items():
                kwargs[name] = rule(merged)
        self._jit.run(grid=grid, warmup=False, **kwargs, **options)

    def _first_launch(self, key: tuple, grid, kwargs: dict[str, Any]) -> None:
        """Through Triton's wrappers (tuning, caches, compilation); remembers the
        choice unless a config carries a pre-hook (then every launch goes this way)."""
        if self._tuner is None:
            self._entry[grid](**kwargs, **self._fixed)
            self._chosen[key] = (self._fixed, self._fixed)
            return
        config = self._preset(key)
        if config is not None:
            self._chosen[key] = (dict(config.kwargs), config.all_kwargs())
            self.preset_keys.append(key)
            self._launch(grid, kwargs)
            return
        self._entry[grid](**kwargs)
        config = self._tuner.best_config
        if config.pre_hook is None:
            self._chosen[key] = (dict(config.kwargs), config.all_kwargs())

    def _preset(self, key: tuple) -> Config | None:
        """The autotuner's configuration the presets name for ``key``, if any."""
        if self._load_presets is None:
            return None
        if self._presets is None:
            self._presets = self._load_presets()
        entry = self._presets.get(
            tuple(str(k) if isinstance(k, torch.dtype) else k for k in key)
        )
        if entry is None:
            return None
        for config in self._tuner.configs:
            if (
                config.kwargs == entry["kwargs"]
                and config.num_warps == entry["num_warps"]
                and config.num_stages == entry["num_stages"]
                and config.pre_hook is None
            ):
                return config
        return None
