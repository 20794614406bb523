"""Calls with autograd captured into a forward and a backward CUDA graph.

:func:`capture` records one call of a function that runs under autograd (a stack of
activation-checkpointed blocks) into two graphs sharing one memory pool: the
forward, and the backward of its outputs with respect to its differentiable inputs
and the parameters it reads. :class:`AutogradGraphs` replays them through an
autograd function: the forward when the call is made, the backward when autograd
reaches it. The tensors the forward saves for the backward (the checkpoints'
inputs) live in the pool between the two replays, so a graph's forward must not be
replayed again before its backward: :meth:`AutogradGraphs.busy` says when it would.

Activation checkpointing saves and restores the CUDA generator's state on the host
(``torch.cuda.get_rng_state``), which a capture cannot record. Under capture the
checkpoints run through :class:`CheckpointRandomness` instead: each checkpointed
segment draws, in its forward and again in its recomputation, from generator
states of its own registered with the graphs (``graphsafe_set_state``); before
each forward replay they are set to the offsets where the segment drew in an
uncaptured call, so a replay draws what that call would (the dropout masks of
OF3's blocks, and equal losses with graphs on and off).

Imports neither OpenFold3 nor Triton.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from of3_megafold.runtime import cuda_graphs
from of3_megafold.runtime.cuda_graphs import (
    CAPTURE_ERROR_MODE,
    Outputs,
    autocast_cast_cache,
)


@dataclass
class RandomDraws:
    """Where an uncaptured call drew from the CUDA generator, relative to its offset
    when the call began: at the start of each checkpointed segment, and in all."""

    starts: list[int] = field(default_factory=list)
    total: int = 0


def _cuda_generator() -> torch.Generator:
    """The current device's default CUDA generator."""
    return torch.cuda.default_generators[torch.cuda.current_device()]


@contextlib.contextmanager
def recording_draws(
    checkpoint_hook: Callable[[Callable], contextlib.AbstractContextManager],
) -> Iterator[RandomDraws]:
    """Record an uncaptured call's :class:`RandomDraws`.

    Args:
        checkpoint_hook: given a replacement for ``torch.utils.checkpoint.checkpoint``
            (same arguments), a context manager under which the call's checkpoints
            go through it."""
    generator = _cuda_generator()
    draws = RandomDraws()
    begin = generator.get_offset()

    def checkpoint(function, *args, **kwargs):
        draws.starts.append(generator.get_offset() - begin)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    with checkpoint_hook(checkpoint):
        yield draws
    draws.total = generator.get_offset() - begin


class CheckpointRandomness:
    """Graph-safe random numbers for checkpointed segments (see the module's
    docstring): segment ``i`` draws from ``forward_states[i]`` in the forward graph
    and from ``backward_states[i]`` when the backward graph recomputes it."""

    def __init__(self, draws: RandomDraws) -> None:
        self.generator = _cuda_generator()
        self.draws = draws
        self.forward_states = [self.generator.clone_state() for _ in draws.starts]
        self.backward_states = [self.generator.clone_state() for _ in draws.starts]
        self.recomputing = False
        self._segments = 0

    def checkpoint(self, function, *args, **kwargs):
        """``torch.utils.checkpoint.checkpoint`` for the forward capture: the
        segment switches the generator to its own state, forward and recompute."""
        index = self._segments
        self._segments += 1
        if index >= len(self.draws.starts):
            raise RuntimeError(
                f"the captured call checkpoints more than the {len(self.draws.starts)} "
                "segments of its uncaptured call"
            )

        def segment(*inputs):
            states = self.backward_states if self.recomputing else self.forward_states
            previous = self.generator.graphsafe_get_state()
            self.generator.graphsafe_set_state(states[index])
            try:
                return function(*inputs)
            finally:
                self.generator.graphsafe_set_state(previous)

        kwargs["preserve_rng_state"] = False  # the segment's own state does it
        return torch.utils.checkpoint.checkpoint(segment, *args, **kwargs)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Around a forward replay: every segment's states point where an
        uncaptured call would draw now, and the generator then moves past the
        call's draws, as the call would have moved it."""
        seed = self.generator.initial_seed()
        begin = self.generator.get_offset()
        for start, *states in zip(
            self.draws.starts, self.forward_states, self.backward_states, strict=True
        ):
            for state in states:
                state.manual_seed(seed)
                state.set_offset(begin + start)
        yield
        self.generator.set_offset(begin + self.draws.total)


@dataclass
class PackedGradients:
    """Gradients the backward graph packs into one flat buffer per dtype, so that a
    replay hands them out in one copy per dtype rather than one per tensor (a
    stack's parameters are some thousand tensors)."""

    buffers: dict[torch.dtype, torch.Tensor]
    layout: tuple[tuple[torch.dtype, int, torch.Size] | None, ...]
    """Per gradient: its buffer's dtype, its offset there and its shape; ``None``
    where the gradient is unused."""

    @classmethod
    def pack(cls, grads: Sequence[torch.Tensor | None]) -> PackedGradients:
        """Flat buffers holding ``grads`` (in a capture: kernels of the graph)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}
        layout = []
        for grad in grads:
            if grad is None:
                layout.append(None)
                continue
            layout.append((grad.dtype, sizes.get(grad.dtype, 0), grad.shape))
            groups.setdefault(grad.dtype, []).append(grad.reshape(-1))
            sizes[grad.dtype] = sizes.get(grad.dtype, 0) + grad.numel()
        buffers = {dtype: torch.cat(flat) for dtype, flat in groups.items()}
        return cls(buffers, tuple(layout))

    def unpack(self) -> tuple[torch.Tensor | None, ...]:
        """Copies of the gradients, as views of one copy of each buffer (the next
        replay overwrites the buffers)."""
        copies = {dtype: buffer.clone() for dtype, buffer in self.buffers.items()}
        return tuple(
            None
            if entry is None
            else copies[entry[0]][entry[1] : entry[1] + entry[2].numel()].view(entry[2])
            for entry in self.layout
        )


@dataclass
class AutogradGraphs:
    """One captured call with autograd: its forward and backward graphs, static
    inputs (by argument name), outputs, the gradients the backward writes (for the
    differentiable inputs, then the parameters, packed) and the randomness of its
    checkpoints."""

    forward_graph: Any  # torch.cuda.CUDAGraph
    backward_graph: Any
    inputs: dict[str, torch.Tensor]
    differentiable: tuple[str, ...]
    parameters: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    grad_outputs: tuple[torch.Tensor | None, ...]
    grads: PackedGradients
    randomness: CheckpointRandomness
    single: bool = False  # the call returns one tensor, not a tuple
    _pending: Any = None  # weakref to the autograd node of an unfinished replay

    def busy(self) -> bool:
        """A forward replay waits for its backward: replaying the forward now would
        overwrite what that backward reads."""
        return self._pending is not None and self._pending() is not None

    def replay(self, arguments: dict[str, Any]) -> Outputs:
        """The call on ``arguments``: its output(s) (copies), connected to autograd
        so that their backward replays the backward graph."""
        for name, static in self.inputs.items():
            if name not in self.differentiable:
                static.copy_(arguments[name])
        outputs = _Replay.apply(
            self, *(arguments[name] for name in self.differentiable), *self.parameters
        )
        return outputs[0] if self.single else outputs


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: AutogradGraphs, *tensors):
        for name, value in zip(graphs.differentiable, tensors, strict=False):
            graphs.inputs[name].copy_(value)
        with graphs.randomness.replaying():
            graphs.forward_graph.replay()
        graphs._pending = weakref.ref(ctx)
        ctx.graphs = graphs
        outputs = tuple(output.clone() for output in graphs.outputs)
        ctx.mark_non_differentiable(
            *(o for o, g in zip(outputs, graphs.grad_outputs, strict=True) if g is None)
        )
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        graphs: AutogradGraphs = ctx.graphs
        for static, grad in zip(graphs.grad_outputs, grad_outputs, strict=True):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        graphs.backward_graph.replay()
        graphs._pending = None
        return (None, *graphs.grads.unpack())


def capture(
    call: Callable[..., Outputs],
    arguments: dict[str, Any],
    *,
    differentiable: Sequence[str],
    parameters: Sequence[torch.Tensor],
    draws: RandomDraws,
    checkpoint_hook: Callable[[Callable], contextlib.AbstractContextManager],
    error: type[Exception],
    what: str,
    flag: str,
) -> AutogradGraphs:
    """``call(**arguments)`` and its backward captured into two CUDA graphs.
    Capture computes nothing: replay for the result.

    Args:
        call: returns a tensor or a tuple of tensors; runs its checkpoints
            (non-reentrant) through ``torch.utils.checkpoint.checkpoint``, without host
            synchronisations in its forward or backward.
        arguments: keyword arguments; their tensors are copied into the graphs'
            static inputs, the rest passed as they are.
        differentiable: names of the tensor arguments to differentiate.
        parameters: the tensors (requiring grad) the call reads besides its
            arguments, by address: the graphs read their values at each replay and
            give their gradients.
        draws: the uncaptured call's draws (:func:`recording_draws`).
        checkpoint_hook: as for :func:`recording_draws`.
        error, what, flag: as for :func:`of3_megafold.runtime.cuda_graphs.capture`.

    Raises:
        ``error``, with the CUDA error as its cause: an op in the call needs the
        host. After a failed capture the process's CUDA generator stays in capture
        mode: the caller must not carry on.
    """
    inputs = {
        name: value.detach().clone().requires_grad_(name in differentiable)
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor)
    }
    randomness = CheckpointRandomness(draws)
    forward_graph = torch.cuda.CUDAGraph()
    backward_graph = torch.cuda.CUDAGraph()
    for state in randomness.forward_states:
        forward_graph.register_generator_state(state)
    for state in randomness.backward_states:
        backward_graph.register_generator_state(state)
    with cuda_graphs.capturing(error=error, what=what, flag=flag):
        with autocast_cast_cache(False), checkpoint_hook(randomness.checkpoint):
            forward_graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            try:
                result = call(**{**arguments, **inputs})
            finally:
                forward_graph.capture_end()
        single = isinstance(result, torch.Tensor)
        outputs = (result,) if single else tuple(result)
        grad_outputs = tuple(
            torch.empty_like(o) if o.requires_grad else None for o in outputs
        )
        wanted = [inputs[name] for name in differentiable] + list(parameters)
        randomness.recomputing = True
        backward_graph.capture_begin(
            pool=forward_graph.pool(), capture_error_mode=CAPTURE_ERROR_MODE
        )
        try:
            grads = PackedGradients.pack(
                torch.autograd.grad(
                    [o for o in outputs if o.requires_grad],
                    wanted,
                    grad_outputs=[g for g in grad_outputs if g is not None],
                    allow_unused=True,
                )
            )
        finally:
            backward_graph.capture_end()
            randomness.recomputing = False
    return AutogradGraphs(
        forward_graph,
        backward_graph,
        inputs,
        tuple(differentiable),
        tuple(parameters),
        tuple(o.detach() for o in outputs),
        grad_outputs,
        grads,
        randomness,
        single,
    )
