"""Where a training step reaches its peak memory: peaks between module events.

A :class:`MemoryWindows` recorder hooks the forward of every submodule down to a
given depth. Each hook call is an *event* (entering or leaving a module); at every
event the recorder reads the allocator's peak since the previous event and resets
it. So each *window* between two consecutive events gets its own peak, and the step's
peak lies in one window, named by the events around it.

Backward passes get two kinds of events:

* ``grad <module>``: autograd has computed the gradient of the module's output (the
  first tensor output that requires grad, hooked when the forward leaves it), so the
  module's own backward starts. This splits the backward of modules that are not
  checkpointed (the loss, the heads, the diffusion module's outer layers).
* where OF3 checkpoints, a block's backward calls its forward again (the recompute),
  so its ``enter``/``leave`` hooks fire inside the backward, and the block's gradient
  work falls in the window its recompute opens (torch's non-reentrant checkpoint
  recomputes when the first saved tensor is needed and stops once it has them all,
  so the recompute's ``leave`` event may not fire).

Plain functions get the same three events when named in ``functions`` (the loss
terms, which are functions, not modules): the recorder swaps each for a wrapper while
it records.

A window's ``phase`` is ``forward``, ``backward``, or ``forward->backward`` for the
one that spans the start of the backward pass (an event's phase is read at the
event: inside autograd's backward or not).

Diagnostic only (``python -m tools.gpu_step_sp --memory-windows``): no benchmark rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

GIB = 1024**3


@dataclass
class Window:
    """The stretch between two events and its peak allocated bytes."""

    after: str  # the event that opened it, e.g. "enter pairformer_stack.blocks.3"
    before: str  # the event that closed it
    phase: str  # "forward", "backward" or "forward->backward" (see the module doc)
    peak: int


@dataclass
class MemoryWindows:
    """Records per-window peaks of a model's forward and backward.

    Args:
        modules: Name prefix -> module whose submodules (and itself) are hooked, e.g.
            ``{"": model, "loss": loss_fn}``.
        depth: Deepest qualified-name level hooked below a prefix
            (``pairformer_stack.blocks.3`` is depth 3); containers that are never
            called (``ModuleList``) fire nothing.
        peak_and_reset: Returns the peak allocated bytes since the last call and
            resets it; default: the current CUDA device's allocator.
        functions: Label -> ``(owner, attribute)`` of a function to time as if it
            were a module (``{"loss.bond": (diffusion, "bond_loss")}``); the owner
            is the module the callers look the name up in.
    """

    modules: dict[str, torch.nn.Module]
    depth: int = 3
    peak_and_reset: Callable[[], int] | None = None
    functions: dict[str, tuple[object, str]] = field(default_factory=dict)
    windows: list[Window] = field(default_factory=list)
    _last: tuple[str, str] = field(
        default=("start", "forward"), init=False, repr=False
    )  # (label, phase) of the last event
    _recording: bool = field(default=False, init=False, repr=False)

    def _read(self) -> int:
        if self.peak_and_reset is not None:
            return self.peak_and_reset()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak

    def _event(self, label: str, phase: str | None = None) -> None:
        if not self._recording:  # a gradient hook of a tensor that outlived it
            return
        peak = self._read()
        phase = phase or _phase()
        opened = self._last[1]
        span = opened if opened == phase else f"{opened}->{phase}"
        self.windows.append(Window(self._last[0], label, span, peak))
        self._last = (label, phase)

    @contextlib.contextmanager
    def recording(self) -> Iterator[MemoryWindows]:
        """Hooks in place for the ``with`` body; the body's windows are appended."""
        handles = []
        for prefix, root in self.modules.items():
            for name, module in root.named_modules():
                if name.count(".") + 1 > self.depth:
                    continue
                name = ".".join(part for part in (prefix, name) if part) or "model"
                handles.append(
                    module.register_forward_pre_hook(
                        lambda _m, _a, name=name: self._event(f"enter {name}")
                    )
                )
                handles.append(
                    module.register_forward_hook(
                        lambda _m, _a, out, name=name: self._leave(name, out)
                    )
                )
        originals = []
        for label, (owner, attribute) in self.functions.items():
            original = getattr(owner, attribute)
            originals.append((owner, attribute, original))
            setattr(owner, attribute, self._wrap(label, original))
        self._read()
        self._last = ("start", "forward")
        self._recording = True
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for owner, attribute, original in originals:
                setattr(owner, attribute, original)
            # the body's last window ends in the phase its last event opened it in
            self._event("end", phase=self._last[1])
            self._recording = False

    def _wrap(self, label: str, function: Callable) -> Callable:
        def recorded(*args, **kwargs):
            self._event(f"enter {label}")
            output = function(*args, **kwargs)
            self._leave(label, output)
            return output

        return recorded

    def _leave(self, name: str, output) -> None:
        """The ``leave`` event; in the forward, the ``grad`` event hooked on the
        output (not in a recompute: those tensors get no gradient of their own)."""
        self._event(f"leave {name}")
        if _phase() != "forward" or not torch.is_grad_enabled():
            return
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(lambda _grad: self._event(f"grad {name}"))

    def top(self, count: int = 15) -> list[Window]:
        """The ``count`` windows with the highest peaks, highest first."""
        return sorted(self.windows, key=lambda w: -w.peak)[:count]

    def report(self, count: int = 15) -> list[str]:
        """Text lines: the overall peak, then the top windows."""
        if not self.windows:
            return ["no windows recorded"]
        lines = [
            f"peak {max(w.peak for w in self.windows) / GIB:.2f} GiB over "
            f"{len(self.windows)} windows; the highest:"
        ]
        lines += [
            f"  {w.peak / GIB:7.2f} GiB  {w.phase:8s} after {w.after}, "
            f"before {w.before}"
            for w in self.top(count)
        ]
        return lines


def _first_grad_tensor(output) -> torch.Tensor | None:
    """The first tensor that requires grad in a module's output (tensors, tuples,
    lists, dicts, nested)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = (
        output.values()
        if isinstance(output, dict)
        else (output if isinstance(output, (tuple, list)) else ())
    )
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


def _phase() -> str:
    """``backward`` while autograd runs a backward pass (e.g. a checkpoint's
    recompute), else ``forward``."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return "backward" if task is not None and task() != -1 else "forward"
