"""The memory-window recorder on CPU, with a fake allocator peak."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from of3_megafold.bench.memory_windows import GIB, MemoryWindows


class _Peak:
    """A fake allocator: modules raise its peak; reading it resets it."""

    def __init__(self):
        self.value = 0

    def bump(self, nbytes: int) -> None:
        self.value = max(self.value, nbytes)

    def read_and_reset(self) -> int:
        value, self.value = self.value, 0
        return value


class _Block(torch.nn.Module):
    def __init__(self, peak: _Peak, nbytes: int, backward_nbytes: int):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.peak, self.nbytes, self.backward_nbytes = peak, nbytes, backward_nbytes

    def forward(self, x):
        self.peak.bump(self.nbytes)
        return _BumpInBackward.apply(self.linear(x), self.peak, self.backward_nbytes)


class _BumpInBackward(torch.autograd.Function):
    """Identity whose backward raises the peak after unpacking a saved tensor (so
    under non-reentrant checkpointing it runs after the recompute)."""

    @staticmethod
    def forward(ctx, x, peak, nbytes):
        ctx.save_for_backward(x)
        ctx.peak, ctx.nbytes = peak, nbytes
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (_,) = ctx.saved_tensors
        ctx.peak.bump(ctx.nbytes)
        return grad, None, None


class _Model(torch.nn.Module):
    def __init__(self, peak: _Peak):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [_Block(peak, 1 * GIB, 0), _Block(peak, 3 * GIB, 7 * GIB),
             _Block(peak, 2 * GIB, 5 * GIB)])

    def forward(self, x):
        x = self.blocks[0](x)
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        return 2 * self.blocks[2](x)  # an output of its own (hooked apart)


@pytest.fixture
def model_and_recorder():
    peak = _Peak()
    model = _Model(peak)
    return model, MemoryWindows({"": model}, depth=2,
                                peak_and_reset=peak.read_and_reset)


def test_windows_name_the_forward_and_backward_peaks(model_and_recorder):
    model, recorder = model_and_recorder
    with recorder.recording():
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()

    forward = [w for w in recorder.windows if w.phase == "forward"]
    top_forward = max(forward, key=lambda w: w.peak)
    assert top_forward.peak == 3 * GIB
    assert top_forward.after == "enter blocks.1"
    # The checkpointed block's recompute fires its hooks inside the backward, and
    # its gradient work lands in the window the recompute opens (torch's
    # non-reentrant checkpoint stops the recompute once it has what the backward
    # needs, so the recompute's "leave" need not fire).
    top = recorder.top(1)[0]
    assert (top.peak, top.phase, top.after) == (7 * GIB, "backward", "enter blocks.1")
    # The block that is not checkpointed: its gradient work falls in the window
    # its output's gradient opens, ahead of the checkpointed block's.
    backward = [w for w in recorder.windows if "backward" in w.phase]
    second = max((w for w in backward if w.peak < 7 * GIB), key=lambda w: w.peak)
    assert (second.peak, second.after) == (5 * GIB, "grad blocks.2")
    grads = [w.before for w in backward if w.before.startswith("grad")]
    assert grads == ["grad model", "grad blocks.2", "grad blocks.1", "grad blocks.0"]
    # one window spans the end of the forward and the start of the backward
    assert [w.phase for w in recorder.windows].count("forward->backward") == 1
    assert recorder.windows[-1].before == "end"
    assert recorder.windows[-1].phase == "backward"


def test_report_lists_the_highest_windows_first(model_and_recorder):
    model, recorder = model_and_recorder
    with recorder.recording():
        model(torch.randn(3, 4))
    lines = recorder.report(count=2)
    assert lines[0].startswith("peak 3.00 GiB")
    assert "after enter blocks.1" in lines[1] and "after enter blocks.2" in lines[2]
    assert "after start, before enter model" in "\n".join(
        f"after {w.after}, before {w.before}" for w in recorder.windows)


def test_hooks_are_removed_after_recording(model_and_recorder):
    model, recorder = model_and_recorder
    with recorder.recording():
        out = model(torch.randn(3, 4, requires_grad=True))
    before = len(recorder.windows)
    model(torch.randn(3, 4))
    out.sum().backward()  # the gradient hooks of the recorded forward: silent now
    assert len(recorder.windows) == before


def _square_sum(x):
    return (x * x).sum()


def test_named_functions_fire_events_and_are_restored():
    import sys

    peak = _Peak()
    this = sys.modules[__name__]
    recorder = MemoryWindows({}, functions={"loss.sq": (this, "_square_sum")},
                             peak_and_reset=peak.read_and_reset)
    x = torch.randn(3, requires_grad=True)
    with recorder.recording():
        this._square_sum(x).backward()
    labels = [w.before for w in recorder.windows]
    assert labels[:3] == ["enter loss.sq", "leave loss.sq", "grad loss.sq"]
    assert this._square_sum is _square_sum
