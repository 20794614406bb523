"""Where a training step's kernel launches come from, counted on the CPU.

    python -m tools.op_census [--provider stock] [--config full] [--tokens 32]
        [--recycles 3] [--depth 3] [--top 20]

Runs a warm-up step of the step harness (:mod:`of3_megafold.bench.step`) on the CPU,
then counts every aten op of one more step that computes something (views and
allocations left out). Each such op is one kernel launch on a GPU, so the census
stands in for a GPU step's launches: the full model's stock step counts 137,149
ops at 32 tokens and 3 recycles (137,140 at 48: the ops hardly depend on the crop),
where OF3 with its Triton kernels runs 142,814 kernels at 384 tokens on a GPU
(autocast's casts included).

Ops are grouped by phase and by module:

- ``nograd``: the recycles without autograd and the diffusion rollout (what the
  kit's trunk and rollout graphs replay on a GPU; a reentrant checkpoint's first
  forward, which runs without autograd, counts here too);
- ``forward``: the forward with autograd, the losses included;
- ``recompute``: activation-checkpoint recomputation during the backward;
- ``backward``: the gradients, each op under the module whose forward made the
  autograd node it belongs to (for a reentrant checkpoint's recomputed nodes, the
  module recomputed last).

A module is its dotted name in the model (the loss module's under ``loss``),
indices folded together (``pairformer_stack.blocks``) and cut to ``--depth``
components. Host synchronisations (``.item()`` and the like) are counted the same
way. On the CPU the kit's Triton kernels do not run (CPU tensors take OF3's path),
so a ``kit`` provider counts OF3's ops there, less what its CPU-side extensions
(sync-free indexing, the foreach loop) remove: the census ranks what is left to
fuse or graph, not the kit's own launches on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

PHASES = ("nograd", "forward", "recompute", "backward")
_NOT_KERNELS = frozenset(
    {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "set_", "resize_"}
)
_SYNC = "_local_scalar_dense"
_TAG = "of3mf_module"


@dataclass
class Census:
    """Ops and host synchronisations of one step, by ``(phase, module)``."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)

    def by_phase(self) -> dict[str, int]:
        totals = dict.fromkeys(PHASES, 0)
        for (phase, _), count in self.ops.items():
            totals[phase] += count
        return totals


def module_label(name: str, depth: int) -> str:
    """``name`` with its numeric components folded and cut to ``depth`` parts."""
    parts = [part for part in name.split(".") if part and not part.isdigit()]
    return ".".join(parts[:depth]) or "(top)"


def count_ops(
    step: Callable[[], Any], modules: Mapping[Any, str], depth: int = 3
) -> Census:
    """Run ``step()`` and count its computing aten ops by phase and module.

    Args:
        step: One training step (forward, loss, backward).
        modules: Module object -> dotted name; modules not in it count under their
            nearest named caller.
        depth: Components of a module's name kept (:func:`module_label`).
    """
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import set_checkpoint_early_stop

    census = Census()
    stack: list[Any] = []
    recomputed = ["(untagged)"]  # the module of the last recomputed op

    def current() -> str:
        for module in reversed(stack):
            if module in modules:
                return module_label(modules[module], depth)
        return "(top)"

    def push(module, args):
        stack.append(module)

    def pop(module, args, output):
        # pop back to this module: a module whose hook did not run leaves nothing
        while stack and stack.pop() is not module:
            pass

    def is_view(func) -> bool:
        return any(
            r.alias_info is not None and not r.alias_info.is_write
            for r in func._schema.returns
        )

    class Tag(TorchFunctionMode):  # above autograd: outputs carry their grad_fn
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if torch.is_grad_enabled():
                label = current()
                for value in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        value.grad_fn.metadata.setdefault(_TAG, label)
            return out

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            node = torch._C._current_autograd_node()
            if node is None:
                key = ("forward" if torch.is_grad_enabled() else "nograd", current())
            elif stack:  # a checkpointed forward runs again inside the backward
                key = ("recompute", current())
                recomputed[0] = key[1]
            else:
                # a reentrant checkpoint's recomputed nodes are made with torch
                # function modes off, so untagged: their backward follows the
                # recomputation at once
                key = ("backward", node.metadata.get(_TAG, recomputed[0]))
            name = func.overloadpacket.__name__
            if name == _SYNC:
                census.syncs[key] += 1
            elif name not in _NOT_KERNELS and not is_view(func):
                census.ops[key] += 1
            return out

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(push),
        torch.nn.modules.module.register_module_forward_hook(pop),
    ]
    try:
        # a recomputation that stops early (the default) leaves its modules' forward
        # hooks unrun, and the ops after it would count as recomputation
        with set_checkpoint_early_stop(False), Tag(), Count():
            step()
    finally:
        for hook in hooks:
            hook.remove()
    return census


def format_census(census: Census, top: int) -> str:
    """Per phase, its total and its ``top`` modules; then the host syncs."""
    totals = census.by_phase()
    lines = [f"ops: {sum(totals.values()):,}"]
    for phase in PHASES:
        lines.append(f"{phase}: {totals[phase]:,}")
        rows = sorted(
            (
                (count, module)
                for (p, module), count in census.ops.items()
                if p == phase
            ),
            reverse=True,
        )
        lines += [f"  {count:8,}  {module}" for count, module in rows[:top]]
    lines.append(f"host syncs: {sum(census.syncs.values())}")
    lines += [
        f"  {count:8,}  {phase} {module}"
        for (phase, module), count in census.syncs.most_common(top)
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="stock")
    parser.add_argument("--config", default="full")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--n-msa", type=int, default=64)
    parser.add_argument("--recycles", type=int, default=3)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)

    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    harness = TrainingStepHarness(
        args.config, args.provider, "cpu", num_recycles=args.recycles
    )
    batch = random_training_batch(args.tokens, args.n_msa, 4, "cpu")
    names = {module: name for name, module in harness.model.named_modules()}
    names.update(
        {m: f"loss.{n}".rstrip(".") for n, m in harness.loss_fn.named_modules()}
    )
    harness.step(batch)  # warm-up: first-call caches and lazy set-up
    census = harness.measured(batch, lambda run: count_ops(run, names, args.depth))
    print(
        f"{args.provider}, {args.config} model, {args.tokens} tokens, "
        f"{args.recycles} recycles, one training step on the CPU"
    )
    print(format_census(census, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
