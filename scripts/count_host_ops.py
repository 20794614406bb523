"""Host work of one smooth lDDT forward + backward, counted on the CPU.

    TRITON_INTERPRET=1 python scripts/count_host_ops.py

Runs ``smooth_lddt_ball_query`` (K=16, atomics and deterministic) and
``smooth_lddt_fused`` on 300 atoms, B=1, S=2, under the Triton interpreter and prints,
per forward + backward (``loss.sum().backward()``, so the ``.sum()`` and its backward's
``ones_like``/``expand`` are included):

* Triton launches, per kernel;
* aten ops as a ``TorchDispatchMode`` sees them (what reaches the kernels' dispatch);
* top-level aten ops as ``torch.profiler`` records them (composites such as
  ``aten::to`` included even when they return their input);
* the host time per call with every Triton launch stubbed out (CPU tensors, so the
  torch ops are tiny: Python, dispatch and autograd overhead only).

Ops inside a Triton launch (the interpreter's own) are not counted. These counts do
not depend on N; the GPU host cost of each item does not show here.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from of3_megafold.bench.smooth_lddt import make_inputs  # noqa: E402
from of3_megafold.kernels.smooth_lddt import (  # noqa: E402
    smooth_lddt_ball_query,
    smooth_lddt_fused,
)

LAUNCH = "triton_launch"
_in_launch = [0]
_launches: collections.Counter = collections.Counter()
_run = interpreter.InterpretedFunction.run


def _counted_run(self, *args, **kwargs):
    _launches[self.fn.__name__] += 1
    _in_launch[0] += 1
    try:
        with torch.profiler.record_function(LAUNCH):
            return _run(self, *args, **kwargs)
    finally:
        _in_launch[0] -= 1


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _in_launch[0]:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _cases(n: int, k: int) -> dict:
    inputs = make_inputs(n, torch.float32, torch.device("cpu"))
    rest = (inputs["truth"], inputs["is_nucleotide"], inputs["atom_mask"])
    cases = {
        "ball_query": lambda x: smooth_lddt_ball_query(
            x, *rest, max_neighbors=k, seed=0
        ),
        "ball_query deterministic": lambda x: smooth_lddt_ball_query(
            x, *rest, max_neighbors=k, seed=0, deterministic=True
        ),
        "fused": lambda x: smooth_lddt_fused(x, *rest),
    }
    return {name: (fn, inputs["x"]) for name, fn in cases.items()}


def _top_level_aten(prof) -> collections.Counter:
    top: collections.Counter = collections.Counter()
    for event in prof.events():
        parent, nested = event.cpu_parent, False
        while parent is not None:
            nested |= parent.name == LAUNCH or parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and not nested:
            top[event.name.removeprefix("aten::")] += 1
    return top


def main() -> None:
    interpreter.InterpretedFunction.run = _counted_run
    cases = _cases(300, 16)
    for name, (fn, x0) in cases.items():
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()  # warm-up
        x.grad = None
        _launches.clear()
        with _CountOps() as mode:
            fn(x).sum().backward()
        launches = dict(_launches)
        x.grad = None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(x).sum().backward()
        top = _top_level_aten(prof)
        print(f"== {name}")
        print(f"  Triton launches: {sum(launches.values())} {launches}")
        print(f"  dispatched aten ops: {sum(mode.ops.values())} {dict(mode.ops)}")
        print(f"  profiler top-level aten ops: {sum(top.values())} {dict(top)}")

    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None
    for name, (fn, x0) in cases.items():
        x = x0.clone().requires_grad_()
        for _ in range(20):
            fn(x).sum().backward()
            x.grad = None
        calls = 2000
        start = time.perf_counter()
        for _ in range(calls):
            fn(x).sum().backward()
            x.grad = None
        per_call = (time.perf_counter() - start) / calls * 1e6
        print(f"== {name}: host path with launches stubbed {per_call:.0f} us/call")


if __name__ == "__main__":
    main()
