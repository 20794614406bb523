"""Calls captured into CUDA graphs and replayed on new inputs.

A :class:`GraphedCall` holds one captured call of a function: the graph, static
copies of the call's tensor arguments (the graph reads them by address) and the
tensors the graph writes. :func:`capture` makes one; :func:`call_signature` says
what a graph is specific to, so callers key their graphs by it. Arguments a caller
names *constants* are not copied: the graph reads the very objects of the captured
call (tensors, or dicts of them), holds them alive, and its signature names them by
identity, so a call with other objects is another key.

Capture runs nothing on the GPU: it records the kernels the call launches, in
order, on a side stream. Replaying copies new inputs into the static buffers,
launches the whole graph at once (one launch instead of one per kernel: the host
time of a launch-bound call) and returns copies of the outputs, which the next
replay overwrites. Random ops draw from the default CUDA generator as they would
outside the graph (PyTorch registers it with every capture and advances it at each
replay).

Imports neither OpenFold3 nor Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


CAPTURE_ERROR_MODE = "thread_local"
"""Other threads (data loaders) may keep using CUDA while a graph is captured."""


@dataclass
class GraphedCall:
    """One captured call: its graph, its static input buffers (by argument name),
    the output tensor(s) the graph writes, and what else it reads by address and
    keeps alive (constant arguments, tensors the call took from caches)."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: Outputs
    held: tuple = ()

    def replay(self, arguments: dict[str, Any]) -> Outputs:
        """Copy the tensor ``arguments`` in, replay, return copies of the outputs
        (the graph overwrites its own at the next replay)."""
        for name, static in self.inputs.items():
            static.copy_(arguments[name])
        self.graph.replay()
        if isinstance(self.output, torch.Tensor):
            return self.output.clone()
        return tuple(t.clone() for t in self.output)


def capture(
    call: Callable[..., Outputs],
    arguments: dict[str, Any],
    *,
    constants: frozenset[str] = frozenset(),
    autocast_cache: bool = True,
    error: type[Exception],
    what: str,
    flag: str,
) -> GraphedCall:
    """``call(**arguments)`` captured into a CUDA graph on a side stream, reading
    static copies of its tensor arguments. Capture computes nothing: replay it for
    the result.

    Args:
        call: returns a tensor or a tuple of tensors; must not synchronise with the
            host.
        arguments: keyword arguments; the tensors among them are copied into the
            graph's static inputs, the rest passed as they are.
        constants: names of arguments the graph reads in place instead (held by
            the returned call); the caller must not change their values between
            replays.
        autocast_cache: leave autocast's cast cache as it is. With ``False`` the
            casts of weights are captured as kernels instead of read from the
            cache, so the graph stays valid after the cache is cleared (it is at
            every training step); replays then cast the weights again.
        error, what, flag: the exception raised if capture fails, naming ``what``
            was captured and the ``settings.memory`` key ``flag`` that turns it off.

    Raises:
        ``error``, with the CUDA error as its cause: an op in the call needs the
        host. It does not fall back: after a failed capture the process's CUDA
        generator stays in capture mode.
    """
    inputs = {
        k: v.clone()
        for k, v in arguments.items()
        if isinstance(v, torch.Tensor) and k not in constants
    }
    graph = torch.cuda.CUDAGraph()
    with capturing(error=error, what=what, flag=flag), autocast_cast_cache(
        autocast_cache
    ):
        graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        try:
            output = call(**{**arguments, **inputs})
        finally:
            graph.capture_end()
    held = tuple(arguments[k] for k in constants if k in arguments)
    return GraphedCall(graph, inputs, output, held)


@contextlib.contextmanager
def capturing(*, error: type[Exception], what: str, flag: str) -> Iterator[None]:
    """Run the block on a side stream to capture on (the current stream waits for
    it after); a ``RuntimeError`` in it becomes ``error``, naming ``what`` was
    captured and the ``settings.memory`` key ``flag`` that turns it off."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    except RuntimeError as cause:
        raise error(
            f"capturing {what} into a CUDA graph failed "
            f"({str(cause).splitlines()[0]}); an op in it needs the host. The "
            "process's CUDA state is not reliable after a failed capture: set "
            f"model_update.custom.settings.memory.<train|eval>.{flag}: false"
        ) from cause
    finally:
        torch.cuda.current_stream().wait_stream(stream)


def autocast_cast_cache(enabled: bool):
    """Autocast as it is, with its cast cache off unless ``enabled``."""
    if enabled or not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast(
        "cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False
    )


def call_signature(
    arguments: dict[str, Any], constants: frozenset[str] = frozenset()
) -> tuple:
    """What a graph is specific to: every tensor argument's shape, strides, dtype
    and device, the identity of every argument in ``constants``, every other
    argument's value, and the autocast state."""
    parts = []
    for name, value in sorted(arguments.items()):
        if name in constants:
            value = ("object", id(value))
        elif isinstance(value, torch.Tensor):
            value = (tuple(value.shape), value.stride(), value.dtype, value.device)
        parts.append((name, value))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return tuple(parts), autocast
