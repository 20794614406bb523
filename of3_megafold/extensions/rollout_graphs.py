"""Rollout graphs: OF3's diffusion rollout replays its diffusion module, or the
module's token transformer, from a CUDA graph.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_rollout_cuda_graphs``
(default false).

OF3's rollout (``SampleDiffusion._sample_rollout``: the 20-step mini-rollout of every
training step, the 200-step rollout of validation and inference) calls the diffusion
module once per step on the same trunk outputs. At a few samples a call's GPU work
is small: the call waits for the host, which issues its kernels one by one through
OF3's Python (some 1,000 launches per token-transformer call and as many again in
the atom encoder, decoder and conditioning). On one H200 the mini-rollout took 1.9 s
of host time of a 384-token training step whose GPU kernels took 2.5 s in all
(docs/benchmarks.md, "Full training step").

With a key on, each rollout opens a session that graphs one of two scopes, chosen at
its first diffusion-module call:

- the **whole diffusion-module call** when nothing in it needs the host: the
  ``sync_free_indexing`` key is on (OF3's token-to-atom broadcasts and
  relative-position encoding synchronise at every call otherwise), the batch was
  made outside ``torch.inference_mode`` (the cached broadcast layouts need version
  counters) and no chain is cyclic (OF3's cyclic offsets synchronise). The batch,
  masks and trunk outputs are the same objects at every step of a rollout, so the
  graph reads them in place; only the noisy positions and the noise level are
  copied in;
- otherwise the module's **token transformer** only (its blocks never synchronise),
  all its tensor arguments copied in.

Within the rollout the first call of the scope with a given signature (shapes,
strides, dtypes, flags, autocast state) runs as OF3's (kernels compile and tune
there); the second is captured into a CUDA graph on a side stream; every later call
copies its inputs into the graph's buffers and replays it. The graph holds the
kernels the captured call launched, in its order, on the same weights, so a replay
computes what OF3's call would (the GPU tests compare a training step's losses and
gradients with the key on and off). Graphs and their memory pools live for one
rollout: weights change between training steps and token counts between samples.

Only calls without autograd on CUDA tensors are graphed, and a model's other
``DiffusionTransformer`` instances (the atom transformers) are graphed only inside a
whole-module graph. A capture that fails (an op that needs the host, e.g. a module
the user patched in) raises :class:`RolloutCaptureError` naming the key: after a
failed capture the process's CUDA generator is left in capture mode (the next
``torch.randn`` on the GPU fails, seen on the H200), so running on would not be
safe.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.extensions import sync_free_indexing
from of3_megafold.kernels.backend import cuda_device
from of3_megafold.runtime import cuda_graphs, tensor_cache
from of3_megafold.runtime.cuda_graphs import GraphedCall

NAME = "rollout_graphs"
FLAG = "use_rollout_cuda_graphs"

logger = logging.getLogger(__name__)

NOT_ON_CUDA = "its tensors are not on a CUDA device"
"""Why a CPU call graphs nothing (:func:`why_not_whole_module`)."""

_ACTIVE: contextvars.ContextVar[_RolloutGraphs | None] = contextvars.ContextVar(
    "of3_megafold_rollout_graphs", default=None
)


def _cuda_graphs() -> registry.Check:
    return cuda_device(
        "CUDA graphs need an NVIDIA GPU (without the key the rollout runs as OF3's)"
    )


class RolloutCaptureError(RuntimeError):
    """A rollout's diffusion module or token transformer could not be captured into
    a CUDA graph."""


MODULE_CONSTANTS = frozenset(
    {"batch", "token_mask", "atom_mask", "si_input", "si_trunk", "zij_trunk"}
)
"""The diffusion module's arguments that are the same objects at every step of a
rollout: a whole-module graph reads them in place."""


def capture(
    original, module: Any, arguments: dict[str, Any], constants: frozenset[str]
) -> GraphedCall:
    """``original(module, **arguments)`` captured into a CUDA graph (see
    :func:`of3_megafold.runtime.cuda_graphs.capture`) that reads ``constants`` in
    place. The graph lives within one rollout, as autocast's cache of cast weights
    does, so it reads that cache.

    Raises:
        RolloutCaptureError: capture failed (with the CUDA error as its cause)."""

    return cuda_graphs.capture(
        lambda **kw: original(module, **kw),
        arguments,
        constants=constants,
        error=RolloutCaptureError,
        what=f"{NAME}: the rollout's {type(module).__name__}",
        flag=FLAG,
    )


def why_not_whole_module(arguments: dict[str, Any]) -> str | None:
    """Why a diffusion-module call with ``arguments`` would stop the host, or
    ``None`` when it runs without it: CUDA tensors, sync-free indexing on, a batch
    made outside inference mode and without cyclic chains."""
    batch = arguments["batch"]
    cyclic = batch.get("cyclic_mask")
    if not graphable(arguments["xl_noisy"]):
        return NOT_ON_CUDA
    if not sync_free_indexing.enabled():
        return f"{sync_free_indexing.FLAG} is off"
    if not tensor_cache.cacheable(
        [v for v in batch.values() if isinstance(v, torch.Tensor)]
    ):
        return "the batch was made under torch.inference_mode"
    if cyclic is not None and sync_free_indexing.any_cyclic(cyclic):
        return "a chain is cyclic"
    return None


@functools.cache
def _say_scope(reason: str) -> None:
    """Say once per reason why rollouts graph the token transformer only."""
    logger.info(
        "%s: graphing the rollout's token transformer only, not the whole "
        "diffusion module: %s",
        NAME,
        reason,
    )


class _RolloutGraphs:
    """The graphs of one rollout of one diffusion module, by call signature."""

    def __init__(self, module: Any):
        self.module = module
        self.transformer = module.diffusion_transformer
        self.whole: bool | None = None  # graph whole-module calls; set at the first
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, GraphedCall] = {}

    def call(
        self,
        original,
        module: Any,
        arguments: dict[str, Any],
        constants: frozenset[str] = frozenset(),
    ) -> torch.Tensor:
        key = cuda_graphs.call_signature(arguments, constants)
        graphed = self.graphs.get(key)
        if graphed is not None:
            return graphed.replay(arguments)
        if key not in self.seen:  # OF3's call: compiles, tunes, fills caches
            self.seen.add(key)
            return original(module, **arguments)
        # the broadcast layouts the call takes from sync-free indexing's caches are
        # read by the graph at every replay: it keeps them
        with tensor_cache.retaining() as retained:
            graphed = capture(original, module, arguments, constants)
        graphed.held = (*graphed.held, *retained)
        self.graphs[key] = graphed
        return graphed.replay(arguments)  # capture computed nothing

    def close(self) -> None:
        self.graphs.clear()


def _enabled(module: Any) -> bool:
    return registry.module_enabled(module, NAME, FLAG)


def _patch_sample_rollout(original):
    def _sample_rollout(self, *args, **kwargs):
        # any denoiser OF3's sampler is given (OF3's tests pass stand-ins without a
        # token transformer) runs as OF3's unless it has one with the key on
        module = self.diffusion_module
        transformer = getattr(module, "diffusion_transformer", None)
        if transformer is None or torch.is_grad_enabled() or not _enabled(transformer):
            return original(self, *args, **kwargs)
        session = _RolloutGraphs(module)
        token = _ACTIVE.set(session)
        try:
            return original(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            session.close()

    return _sample_rollout


def graphable(a: torch.Tensor) -> bool:
    """Whether a call with activations or positions ``a`` can be graphed (CUDA
    tensors)."""
    return a.is_cuda


def _bound(signature: inspect.Signature, *args, **kwargs) -> dict[str, Any]:
    """A call's arguments by name, defaults filled in, ``self`` left out."""
    call = signature.bind(*args, **kwargs)
    call.apply_defaults()
    return {k: v for k, v in call.arguments.items() if k != "self"}


def _patch_module_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        session = _ACTIVE.get()
        if session is None or session.module is not self or torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        arguments = _bound(signature, self, *args, **kwargs)
        if session.whole is None:
            reason = why_not_whole_module(arguments)
            session.whole = reason is None
            # CPU tensors: the token transformer's device fallback says so
            if reason not in (None, NOT_ON_CUDA):
                _say_scope(reason)
        if not session.whole:
            return original(self, *args, **kwargs)
        return session.call(original, self, arguments, MODULE_CONSTANTS)

    return forward


def _patch_transformer_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        session = _ACTIVE.get()
        if (session is None or session.whole or session.transformer is not self
                or torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        arguments = _bound(signature, self, *args, **kwargs)
        if not graphable(arguments["a"]):
            registry.log_device_fallback(NAME, arguments["a"].device.type)
            return original(self, *args, **kwargs)
        return session.call(original, self, arguments)

    return forward


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="replay the diffusion rollout's diffusion module (with "
        "use_sync_free_indexing; else its token transformer) from a CUDA graph "
        "captured once per rollout (host time; same kernels, same results). Needs "
        "CUDA.",
        summary="The diffusion rollout's diffusion module, or its token transformer, "
        "replayed from a CUDA graph (host time of every training step's "
        "mini-rollout and of inference)",
        device_check=_cuda_graphs,
        patches=(
            registry.Patch(
                "openfold3.core.model.structure.diffusion_module:"
                "SampleDiffusion._sample_rollout",
                _patch_sample_rollout,
            ),
            registry.Patch(
                "openfold3.core.model.structure.diffusion_module:"
                "DiffusionModule.forward",
                _patch_module_forward,
            ),
            registry.Patch(
                "openfold3.core.model.layers.diffusion_transformer:"
                "DiffusionTransformer.forward",
                _patch_transformer_forward,
            ),
        ),
    )
)
