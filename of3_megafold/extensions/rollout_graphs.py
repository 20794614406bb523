"""Rollout graphs: OF3's diffusion rollout replays its token transformer from a
CUDA graph.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_rollout_cuda_graphs``
(default false).

OF3's rollout (``SampleDiffusion._sample_rollout``: the 20-step mini-rollout of every
training step, the 200-step rollout of validation and inference) calls the diffusion
module once per step on the same trunk outputs. Most of a call is the token
``DiffusionTransformer`` (24 blocks), whose GPU work at a few samples is small: the
call waits for the host, which issues some 60 kernels per block through OF3's Python.
On one H200 the mini-rollout took 1.9 s of host time of a 384-token training step
whose GPU kernels took 2.5 s in all (docs/benchmarks.md, "Full training step").

With a key on, within one rollout the token transformer's first call with a given
signature (shapes, strides, dtypes, flags, autocast state) runs as OF3's (kernels
compile and tune there); the second is captured into a CUDA graph on a side stream,
its tensor inputs copied into static buffers first; every later call copies its
inputs into those buffers and replays the graph. The graph holds the kernels the
captured call launched, in its order, on the same weights, so a replay computes what
OF3's call would (the GPU tests compare a training step's losses and gradients with
the key on and off). Graphs and their memory pools live for one rollout: weights
change between training steps and token counts between samples.

Only calls without autograd on CUDA tensors are graphed; anything else, and every
``DiffusionTransformer`` other than the diffusion module's token transformer (the
atom transformers, which prepare their blocks with host-synchronising index ops),
runs as OF3's. A capture that fails (an op in the transformer that needs the host,
e.g. a module the user patched in) raises :class:`RolloutCaptureError` naming the
key: after a failed capture the process's CUDA generator is left in capture mode
(the next ``torch.randn`` on the GPU fails, seen on the H200), so running on would
not be safe.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.kernels.backend import cuda_device
from of3_megafold.runtime import cuda_graphs
from of3_megafold.runtime.cuda_graphs import GraphedCall

NAME = "rollout_graphs"
FLAG = "use_rollout_cuda_graphs"

_ACTIVE: contextvars.ContextVar[_RolloutGraphs | None] = contextvars.ContextVar(
    "of3_megafold_rollout_graphs", default=None
)


def _cuda_graphs() -> registry.Check:
    return cuda_device(
        "CUDA graphs need an NVIDIA GPU (without the key the rollout runs as OF3's)"
    )


class RolloutCaptureError(RuntimeError):
    """The token transformer could not be captured into a CUDA graph."""


def capture(original, module: Any, arguments: dict[str, Any]) -> GraphedCall:
    """``original(module, **arguments)`` captured into a CUDA graph (see
    :func:`of3_megafold.runtime.cuda_graphs.capture`). The graph lives within one
    rollout, as autocast's cache of cast weights does, so it reads that cache.

    Raises:
        RolloutCaptureError: capture failed (with the CUDA error as its cause)."""

    return cuda_graphs.capture(
        lambda **kw: original(module, **kw),
        arguments,
        error=RolloutCaptureError,
        what=f"{NAME}: the rollout's token transformer",
        flag=FLAG,
    )


class _RolloutGraphs:
    """The graphs of one rollout of one token transformer, by call signature."""

    def __init__(self, transformer: Any):
        self.transformer = transformer
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, GraphedCall] = {}

    def call(self, original, module: Any, arguments: dict[str, Any]) -> torch.Tensor:
        key = cuda_graphs.call_signature(arguments)
        graphed = self.graphs.get(key)
        if graphed is not None:
            return graphed.replay(arguments)
        if key not in self.seen:  # OF3's call: compiles, tunes
            self.seen.add(key)
            return original(module, **arguments)
        graphed = self.graphs[key] = capture(original, module, arguments)
        return graphed.replay(arguments)  # capture computed nothing

    def close(self) -> None:
        self.graphs.clear()


def _enabled(module: Any) -> bool:
    return registry.module_enabled(module, NAME, FLAG)


def _patch_sample_rollout(original):
    def _sample_rollout(self, *args, **kwargs):
        # any denoiser OF3's sampler is given (OF3's tests pass stand-ins without a
        # token transformer) runs as OF3's unless it has one with the key on
        transformer = getattr(self.diffusion_module, "diffusion_transformer", None)
        if transformer is None or torch.is_grad_enabled() or not _enabled(transformer):
            return original(self, *args, **kwargs)
        session = _RolloutGraphs(transformer)
        token = _ACTIVE.set(session)
        try:
            return original(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            session.close()

    return _sample_rollout


def graphable(a: torch.Tensor) -> bool:
    """Whether a call with token activations ``a`` can be graphed (CUDA tensors)."""
    return a.is_cuda


def _patch_transformer_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        session = _ACTIVE.get()
        if (session is None or session.transformer is not self
                or torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        arguments = {k: v for k, v in call.arguments.items() if k != "self"}
        if not graphable(arguments["a"]):
            registry.log_device_fallback(NAME, arguments["a"].device.type)
            return original(self, *args, **kwargs)
        return session.call(original, self, arguments)

    return forward


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="replay the diffusion rollout's token transformer from a CUDA graph "
        "captured once per rollout (host time; same kernels, same results). Needs "
        "CUDA.",
        summary="The diffusion rollout's token transformer replayed from a CUDA "
        "graph (host time of every training step's mini-rollout and of inference)",
        device_check=_cuda_graphs,
        patches=(
            registry.Patch(
                "openfold3.core.model.structure.diffusion_module:"
                "SampleDiffusion._sample_rollout",
                _patch_sample_rollout,
            ),
            registry.Patch(
                "openfold3.core.model.layers.diffusion_transformer:"
                "DiffusionTransformer.forward",
                _patch_transformer_forward,
            ),
        ),
    )
)
