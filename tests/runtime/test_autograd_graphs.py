"""Autograd graphs: a checkpointed stack with dropout, captured with its backward and
replayed, against the same stack run without graphs.

CUDA graphs and the CUDA generator's offsets need a GPU; on the CPU run the
refusal of a segment count that differs from the recorded one and the packing of
gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint

from of3_megafold.runtime import autograd_graphs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Stack(torch.nn.Module):
    """``n`` checkpointed blocks ``x -> x + dropout(gelu(x @ w)) * gate``, each
    through the module-level :data:`_CHECKPOINT` (as OF3's ``checkpoint_blocks``
    goes through ``get_checkpoint_fn``); returns ``x`` (``single``) or
    ``(x, x.sum(-1))``."""

    def __init__(self, n: int = 3, c: int = 16, single: bool = False):
        super().__init__()
        self.single = single
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(c, c) / c**0.5) for _ in range(n)
        )

    def forward(self, x, gate):
        for w in self.weights:
            x = _CHECKPOINT[0](_block, x, w, gate, use_reentrant=False)
        return x if self.single else (x, x.sum(-1))


def _block(x, w, gate):
    return x + torch.nn.functional.dropout(torch.nn.functional.gelu(x @ w), 0.25) * gate


_CHECKPOINT = [torch.utils.checkpoint.checkpoint]


@contextlib.contextmanager
def _through(checkpoint):
    _CHECKPOINT[0] = checkpoint
    try:
        yield
    finally:
        _CHECKPOINT[0] = torch.utils.checkpoint.checkpoint


def test_more_segments_than_recorded_are_refused(monkeypatch):
    randomness = object.__new__(autograd_graphs.CheckpointRandomness)
    randomness.draws = autograd_graphs.RandomDraws(starts=[0], total=4)
    randomness._segments = 1
    with pytest.raises(RuntimeError, match="more than the 1 segments"):
        randomness.checkpoint(_block, torch.ones(1), torch.ones(1, 1), 1.0)


def test_packed_gradients_come_back_equal_and_apart_from_the_buffers():
    grads = [
        torch.randn(3, 4),
        None,
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(4, 3).t(),  # not contiguous
        torch.randn(2, 2, 2),
    ]
    packed = autograd_graphs.PackedGradients.pack(grads)
    assert sorted(map(str, packed.buffers)) == ["torch.bfloat16", "torch.float32"]
    first = packed.unpack()
    for buffer in packed.buffers.values():
        buffer.fill_(7)  # the next replay writes the buffers again
    second = packed.unpack()
    for want, got, again in zip(grads, first, second, strict=True):
        if want is None:
            assert got is None and again is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert bool((again == 7).all())


def _step(stack, x, gate, run):
    """One forward and backward through ``run``; returns outputs and gradients."""
    x = x.clone().requires_grad_(True)
    out = run(x, gate)
    out, total = (out, out.sum(-1)) if stack.single else out
    (out.square().sum() + total.sum()).backward()
    grads = [x.grad] + [w.grad.clone() for w in stack.weights]
    for w in stack.weights:
        w.grad = None
    return [out.detach(), total.detach()], grads


@gpu
@pytest.mark.parametrize(
    ("shape", "single"), [((5, 7, 16), False), ((1, 33, 16), True)]
)
def test_gpu_replays_equal_the_uncaptured_call(shape, single):
    """Three steps each way from the same generator state: the first uncaptured
    (recording its draws), then capture and replays. Outputs and every gradient
    equal the uncaptured steps' (same dropout masks), the generator ends where the
    uncaptured steps leave it, and a second forward before the backward is
    reported busy."""
    torch.manual_seed(0)
    stack = _Stack(single=single).cuda()
    x = torch.randn(*shape, device="cuda")
    gate = torch.rand(shape[-1], device="cuda")
    generator = torch.cuda.default_generators[torch.cuda.current_device()]

    torch.cuda.manual_seed(1)
    want = [_step(stack, x, gate, stack) for _ in range(3)]
    end = generator.get_offset()

    torch.cuda.manual_seed(1)
    with autograd_graphs.recording_draws(_through) as draws:
        got = [_step(stack, x, gate, stack)]
    assert len(draws.starts) == 3 and draws.starts[0] == 0 and draws.total > 0
    graphs = autograd_graphs.capture(
        lambda **kw: stack(**kw),
        {"x": x.clone().requires_grad_(True), "gate": gate},
        differentiable=("x",),
        parameters=tuple(stack.weights),
        draws=draws,
        checkpoint_hook=_through,
        error=RuntimeError,
        what="a test stack",
        flag="none",
    )

    def replay(x_, gate_):
        return graphs.replay({"x": x_, "gate": gate_})

    got += [_step(stack, x, gate, replay) for _ in range(2)]
    torch.cuda.synchronize()
    assert generator.get_offset() == end
    for (want_out, want_grads), (got_out, got_grads) in zip(want, got, strict=True):
        for a, b in zip(want_out + want_grads, got_out + got_grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert not graphs.busy()
    outputs = replay(x.clone().requires_grad_(True), gate)
    assert graphs.busy()
    del outputs
    assert not graphs.busy()
