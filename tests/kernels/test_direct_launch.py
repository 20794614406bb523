"""DirectLaunch's control flow, on a stand-in for Triton's JIT function (no GPU).

The real launcher is exercised on the GPU (``tests/kernels/test_launch.py``'s GPU
test and every kernel test there); here: a compiled kernel is reused only for the
same device, options and specialization, and profiler hooks send launches back
through ``JITFunction.run``.
"""

from __future__ import annotations

import pytest
from triton import knobs

from of3_megafold.kernels import _launch


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *launch):
        self.log.append(("kernel.run", launch))


class _Jit:
    """``device_caches[device][4]`` is the binder; ``run`` compiles and launches."""

    def __init__(self):
        self.log = []
        binder = self.bind
        self.device_caches = {0: (None, None, None, None, binder),
                              1: (None, None, None, None, binder)}

    @staticmethod
    def bind(x, n, BLOCK, **options):
        # Triton's specialization: an integer is "1", "divisible by 16" or neither
        divisibility = "D" if n % 16 == 0 else ("1" if n == 1 else "")
        spec = [("*fp32", "D"), ("i32", divisibility), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def run(self, *args, grid, warmup, **options):
        self.log.append(("jit.run", args, options))
        return _Compiled(self.log)


@pytest.fixture
def direct(monkeypatch):
    device = {"index": 0}
    monkeypatch.setattr(_launch, "_current_device", lambda: device["index"])
    monkeypatch.setattr(_launch, "_current_stream", lambda index: 100 + index)
    jit = _Jit()
    return _launch.DirectLaunch(jit), jit, device


def _kinds(log):
    return [entry[0] for entry in log]


def test_reuses_the_compiled_kernel_per_specialization(direct):
    launch, jit, device = direct
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 2)  # noqa: E731
    launch(grid, ["x", 64, 16], {"num_warps": 4}, ("key",))
    launch(grid, ["y", 128, 16], {"num_warps": 4}, ("key",))
    assert _kinds(jit.log) == ["jit.run", "kernel.run"]
    # grid from the bound arguments, stream of the current device, no hooks
    assert jit.log[1][1] == (8, 2, 1, 100, "function", "metadata", None, None, None,
                             "y", 128, 16)
    launch(grid, ["x", 17, 16], {"num_warps": 4}, ("key",))  # other specialization
    launch(grid, ["x", 64, 32], {"num_warps": 4}, ("key",))  # other constexpr
    launch(grid, ["x", 64, 16], {"num_warps": 8}, ("other key",))  # other options
    device["index"] = 1
    launch(grid, ["x", 64, 16], {"num_warps": 4}, ("key",))  # other device
    assert _kinds(jit.log) == ["jit.run", "kernel.run"] + ["jit.run"] * 4
    device["index"] = 0
    launch((3,), ["x", 17, 16], {"num_warps": 4}, ("key",))  # a tuple grid
    assert jit.log[-1][0] == "kernel.run" and jit.log[-1][1][:4] == (3, 1, 1, 100)


@pytest.mark.parametrize("hook", ["chain", "callable"])
def test_profiler_hooks_go_through_jit_run(direct, monkeypatch, hook):
    launch, jit, _ = direct
    launch((1,), ["x", 64, 16], {}, ())
    launch((1,), ["x", 64, 16], {}, ())  # an empty hook chain is no hook
    assert _kinds(jit.log) == ["jit.run", "kernel.run"]
    if hook == "chain" and hasattr(knobs.runtime.launch_enter_hook, "add"):
        chain = type(knobs.runtime.launch_enter_hook)()
        chain.add(lambda *a: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda *a: None)
    launch((1,), ["x", 64, 16], {}, ())
    assert _kinds(jit.log) == ["jit.run", "kernel.run", "jit.run"]


def test_only_compiled_functions_are_supported():
    assert _launch.DirectLaunch.supports(_Jit())
    assert not _launch.DirectLaunch.supports(object())
