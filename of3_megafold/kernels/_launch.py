"""Launching Triton kernels with the per-call host work done once.

Two layers of host work sit between a ``kernel[grid](...)`` call and the GPU, and on
the H200 machine (Triton 3.6) they cost about 100 us per launch of EvoFlash's
~50-argument kernels: more than the kernels themselves at small shapes, where the
host, not the GPU, sets the time (docs/extensions/evoflash_attention.md, "Host path").

* Triton's ``Autotuner.run`` and ``Heuristics.run`` rebuild dicts of all arguments
  and a tuning key on every launch. :class:`TunedKernel` keeps the autotuner for the
  first launch of every tuning key (benchmarking, on-disk cache, compilation happen
  there) and remembers the configuration it chose; later launches with that key skip
  both wrappers and pass every argument positionally, in the kernel's parameter
  order (Triton binds positional arguments in about half the time of keywords: 36
  against 68 us for a 51-argument kernel).
* ``JITFunction.run`` itself, once a kernel is compiled, still reads its knobs and
  the current device through Triton's driver, hashes the specialization into its
  cache key, re-checks the kernel's global variables and builds launch metadata for
  profiler hooks. :class:`DirectLaunch` keeps what decides which binary runs (Triton's
  own argument binder and specialization: dtypes, 16-byte alignment, integers equal
  to 1 or divisible by 16, constexpr values) and calls the compiled kernel's
  launcher directly. It steps aside, to ``JITFunction.run``, for the first launch of
  every specialization (compilation), while a profiler hook is installed, and under
  the interpreter.

A kernel may also come with shipped choices (``presets``: the fastest configuration
per tuning key, measured on a GPU model beforehand): a key found there is launched
with that configuration on its first launch too, without benchmarking.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from triton import Config, knobs
from triton.runtime.autotuner import Autotuner, Heuristics


class DirectLaunch:
    """``jit.run(*args, grid=grid, warmup=False, **options)`` for a compiled kernel,
    without ``JITFunction.run``'s per-call bookkeeping (see the module docstring).

    Args:
        jit: a ``triton.jit`` function (not the interpreter's).

    The compiled kernel is looked up by (device, launch options, Triton's
    specialization of the arguments); a miss goes through ``jit.run``, which
    compiles or finds the kernel, and remembers what it returns.
    """

    def __init__(self, jit: Any):
        self._jit = jit
        self._kernels: dict[tuple, Any] = {}

    @staticmethod
    def supports(jit: Any) -> bool:
        """Whether ``jit`` is a compiled (not interpreted) Triton function: one with
        the per-device binders this relies on."""
        return hasattr(jit, "device_caches")

    def __call__(self, grid, args: list, options: dict, options_key: tuple) -> None:
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(
            knobs.runtime.launch_exit_hook
        ):
            self._jit.run(*args, grid=grid, warmup=False, **options)
            return
        device = _current_device()
        binder = self._jit.device_caches[device][4]
        bound, specialization, _ = binder(*args, **options)
        key = (device, options_key, *specialization)
        kernel = self._kernels.get(key)
        if kernel is None:
            self._kernels[key] = self._jit.run(*args, grid=grid, warmup=False,
                                               **options)
            return
        if callable(grid):
            grid = grid(bound)
        kernel.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            _current_stream(device), kernel.function, kernel.packed_metadata, None,
            None, None, *bound.values(),
        )


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is installed: a callable, or a non-empty chain of them
    (Triton's ``HookChain``, present even when empty)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    """The raw CUDA stream torch launches on (as Triton's driver reads it)."""
    return torch._C._cuda_getCurrentRawStream(device)


# Launch options a call may pass to a kernel that is not autotuned, beside its
# arguments (``kernel[grid](..., num_warps=2)``).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class TunedKernel:
    """``kernel[grid](**kwargs)`` for a ``triton.autotune``/``triton.heuristics``
    wrapped kernel, with the dispatch done once per tuning key.

    Args:
        kernel: the decorated kernel: ``autotune(heuristics(jit))``, ``autotune(jit)``,
            ``heuristics(jit)`` or a bare JIT function.
        fixed: meta-parameters (e.g. block sizes) for a kernel that is not autotuned
            (also: every kernel under the Triton interpreter, where nothing is tuned).
        options: launch options (``num_warps``, ...) for a kernel that is not
            autotuned; a call may pass its own (``LAUNCH_OPTIONS``), which then
            hold for that call and are remembered with its key.
        presets: called once, at the first launch of an autotuned kernel: returns
            ``{tuning key: {"kwargs", "num_warps", "num_stages"}}``, keys with dtypes
            as strings (as Triton writes them). An entry that names none of the
            autotuner's configurations is ignored.

    The tuning key is what the autotuner uses: its key arguments' values and the
    dtypes of all tensor arguments. Which arguments are tensors is read at the first
    launch with a given number of arguments (the kit passes its tensors in fixed
    places; a None where a tensor was is noticed and re-read). Arguments may be
    positional (in the kernel's parameter order) or named.
    """

    def __init__(
        self,
        kernel: Any,
        fixed: Mapping[str, Any] | None = None,
        presets: Callable[[], Mapping[tuple, Mapping[str, Any]]] | None = None,
        options: Mapping[str, Any] | None = None,
    ):
        self._entry = kernel
        self._tuner = kernel if isinstance(kernel, Autotuner) else None
        self._key_names = tuple(self._tuner.keys) if self._tuner else ()
        self._tensor_names: tuple[str, ...] | None = None
        self._n_kwargs = -1
        heuristics: dict[str, Callable[[dict], Any]] = {}
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            if isinstance(fn, Heuristics):
                heuristics.update(fn.values)
            fn = fn.fn
        self._jit = fn
        params = inspect.signature(fn.fn).parameters
        self._arg_names = tuple(params)
        self._defaults = {
            name: p.default for name, p in params.items() if p.default is not p.empty
        }
        self._heuristics = heuristics
        self._fixed = dict(fixed or {})
        self._options = dict(options or {})
        self._direct = DirectLaunch(fn) if DirectLaunch.supports(fn) else None
        # tuning key -> (the config's meta-parameters, the other launch options)
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
                names = self._arg_names
                if len(args) > len(names):
                    raise TypeError(f"{len(args)} arguments for {len(names)} params")
                kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
            self._launch(grid, kwargs)

        return launch

    def _key(self, kwargs: dict[str, Any]) -> tuple:
        names = self._tensor_names
        if names is None or len(kwargs) != self._n_kwargs:
            # which arguments are tensors: read once per argument count
            names = tuple(n for n, v in kwargs.items() if isinstance(v, torch.Tensor))
            self._tensor_names, self._n_kwargs = names, len(kwargs)
        try:
            dtypes = [kwargs[name].dtype for name in names]
        except (AttributeError, KeyError):
            self._tensor_names = None
            return self._key(kwargs)
        return (*[kwargs[name] for name in self._key_names], *dtypes)

    def _launch(self, grid, kwargs: dict[str, Any]) -> None:
        given = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        if given and self._tuner is not None:
            raise TypeError(f"{sorted(given)}: an autotuned kernel's launch options "
                            "come from its configurations")
        key = self._key(kwargs)
        if given:  # a launch option is part of what was chosen for the key
            key = (*key, *sorted(given.items()))
        chosen = self._chosen.get(key)
        if chosen is None:
            self._first_launch(key, grid, kwargs, given)
            return
        meta, options = chosen
        values = {**self._defaults, **kwargs, **meta}
        for name, rule in self._heuristics.items():
            values[name] = rule(values)
        args = [values[name] for name in self._arg_names]
        if self._direct is not None:
            self._direct(grid, args, options, key)
        else:
            self._jit.run(*args, grid=grid, warmup=False, **options)

    def _first_launch(
        self, key: tuple, grid, kwargs: dict[str, Any], given: dict[str, Any]
    ) -> None:
        """Through Triton's wrappers (tuning, caches, compilation); remembers the
        choice unless a config carries a pre-hook (then every launch goes this way).
        ``given``: launch options of this call (a kernel that is not autotuned)."""
        if self._tuner is None:
            options = {**self._options, **given}
            self._entry[grid](**kwargs, **self._fixed, **options)
            self._chosen[key] = (self._fixed, options)
            return
        config = self._preset(key)
        if config is not None:
            self._chosen[key] = _choice(config)
            self.preset_keys.append(key)
            self._launch(grid, kwargs)
            return
        self._entry[grid](**kwargs)
        config = self._tuner.best_config
        if config.pre_hook is None:
            self._chosen[key] = _choice(config)

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


def _choice(config: Config) -> tuple[dict, dict]:
    """A configuration as ``(meta-parameters, other launch options)``: the first are
    the kernel's constexpr arguments, the second go to ``run`` as keywords
    (``num_warps``, ``num_stages``, ...)."""
    meta = dict(config.kwargs)
    options = {k: v for k, v in config.all_kwargs().items() if k not in meta}
    return meta, options
