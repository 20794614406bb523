"""Trunk graphs: the trunk's cycles replay OF3's MSA module and pairformer stack
from CUDA graphs, the last cycle's backward included.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_trunk_cuda_graphs``
(default false).

OF3's ``run_trunk`` runs the trunk ``num_recycles + 1`` times; every cycle but the
last runs without autograd. Each cycle calls the MSA module (4 blocks) and the
pairformer stack (48 blocks), and at OF3's 384-token training crop their kernels
are short enough that the host, issuing some hundred kernels per block through
OF3's Python, sets the pace of those cycles.

With a key on, a call of ``PairFormerStack`` or ``MSAModuleStack`` without autograd
on CUDA tensors is keyed by its signature (shapes, strides, dtypes, flags, autocast
state, train or eval mode) and the addresses of the stack's parameters. The first
call with a key runs as OF3's (kernels compile and tune there); the second is
captured into a CUDA graph, with autocast's cast cache off so that the casts of the
weights are captured too, and replayed; every later call copies its inputs into
the graph's buffers and replays it. The graphs outlive the training step: the
optimizer updates the weights in place and the graph reads them by address, so a
replay computes with the current weights; weights moved to other memory make a new
key. Dropout draws from the default CUDA generator, as OF3's call does, so a replay
draws what OF3's call would. Each stack keeps the graphs of at most
:data:`MAX_GRAPHS` keys (the least recently used is dropped with its memory pool)
and remembers at most :data:`MAX_SEEN` keys it has not captured.

A call with autograd (the last cycle; the confidence heads' pairformer) goes the
same way when its blocks are checkpointed as OF3's training preset does: the first
call runs as OF3's and records where each checkpointed block draws random numbers,
the second is captured with its backward (the blocks' recomputation included) into
two graphs (:mod:`of3_megafold.runtime.autograd_graphs`), and later calls replay
the forward at once and the backward when autograd reaches it. The checkpoints'
inputs wait in the graphs' pool between the two, as they wait on the GPU in OF3's
step; a second call before the first one's backward runs as OF3's.

With ``checkpoint_offload`` on as well, the two split a stack's calls with autograd
by size (:data:`OFFLOAD_FROM_BYTES`): short crops are graphed, their checkpoints kept
on the device; long crops offload, as memory is what bounds them.

Runs as OF3's: chunked calls (``chunk_size`` set: OF3's inference, whose chunk tuner
runs trial blocks), stacks that empty the allocator's cache between blocks, tensors
off CUDA, and calls with autograd whose blocks are not checkpointed, are
checkpointed by DeepSpeed or reentrantly, or offload their checkpoints. A capture
that fails raises :class:`TrunkCaptureError` naming the key (after a failed capture
the process's CUDA generator is left in capture mode, so running on would not be
safe). Sequence parallelism's sharded stack exchanges tensors between processes
inside the stack: the two are refused together in training.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.errors import KitConfigError
from of3_megafold.extensions import checkpoint_offload, sequence_parallel
from of3_megafold.kernels.backend import cuda_device
from of3_megafold.runtime import autograd_graphs, cuda_graphs
from of3_megafold.runtime.cuda_graphs import GraphedCall

NAME = "trunk_graphs"
FLAG = "use_trunk_cuda_graphs"

MAX_GRAPHS = 2
"""Graphs kept per stack. A training run's crops are one size or a few; each graph
holds a memory pool of about one block's working set and its inputs and outputs."""

MAX_SEEN = 16
"""Keys a stack remembers having run once, to capture at their second call."""

_CACHE_ATTR = "_megafold_trunk_graphs"


def _cuda_graphs() -> registry.Check:
    return cuda_device(
        "CUDA graphs need an NVIDIA GPU (without the key the trunk runs as OF3's)"
    )


class TrunkCaptureError(RuntimeError):
    """A trunk stack could not be captured into a CUDA graph."""


def capture(original, module: Any, arguments: dict[str, Any]) -> GraphedCall:
    """``original(module, **arguments)`` captured into a CUDA graph that does not
    read autocast's cache (see :func:`of3_megafold.runtime.cuda_graphs.capture`).

    Raises:
        TrunkCaptureError: capture failed (with the CUDA error as its cause)."""

    return cuda_graphs.capture(
        lambda **kw: original(module, **kw),
        arguments,
        autocast_cache=False,
        error=TrunkCaptureError,
        what=f"{NAME}: OF3's {type(module).__name__}",
        flag=FLAG,
    )


@contextlib.contextmanager
def checkpoints_through(checkpoint):
    """OF3's ``checkpoint_blocks`` checkpoints through ``checkpoint`` (same
    arguments as ``torch.utils.checkpoint.checkpoint``) within the block."""
    from openfold3.core.utils import checkpointing

    original = checkpointing.get_checkpoint_fn
    checkpointing.get_checkpoint_fn = lambda use_reentrant=None: checkpoint
    try:
        yield
    finally:
        checkpointing.get_checkpoint_fn = original


def capture_with_autograd(
    original,
    module: Any,
    arguments: dict[str, Any],
    differentiable: tuple[str, ...],
    parameters: tuple[torch.Tensor, ...],
    draws: autograd_graphs.RandomDraws,
) -> autograd_graphs.AutogradGraphs:
    """``original(module, **arguments)`` and its backward captured into CUDA graphs
    (:func:`of3_megafold.runtime.autograd_graphs.capture`).

    Raises:
        TrunkCaptureError: capture failed (with the CUDA error as its cause)."""
    return autograd_graphs.capture(
        lambda **kw: original(module, **kw),
        arguments,
        differentiable=differentiable,
        parameters=parameters,
        draws=draws,
        checkpoint_hook=checkpoints_through,
        error=TrunkCaptureError,
        what=f"{NAME}: OF3's {type(module).__name__} with its backward",
        flag=FLAG,
    )


OFFLOAD_FROM_BYTES = 64 << 20
"""With ``checkpoint_offload`` also on, a stack's call with autograd offloads its
checkpoints when a tensor argument is this large (the pair representation from 512
tokens, in bf16), and is graphed, its checkpoints kept on the device, when all are
smaller. In the full model's training step offloading saves 3.9 GiB at 384 tokens and
12.7 GiB at 768 (docs/benchmarks.md, one H200)."""


def autograd_graphable(module: Any) -> bool:
    """Whether a stack's call with autograd can be graphed: its blocks are
    checkpointed by ``torch.utils.checkpoint`` (non-reentrant, not DeepSpeed's) and
    no outer saved-tensor hook decides where its saved tensors go."""
    from openfold3.core.utils.checkpointing import is_deepspeed_configured

    return (
        getattr(module, "blocks_per_ckpt", None) is not None
        and getattr(module, "use_reentrant", None) is False
        and not is_deepspeed_configured()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


def offloads(module: Any, arguments: dict[str, Any]) -> bool:
    """Whether ``checkpoint_offload`` takes this call with autograd (its key is on
    for the stack and the call reaches :data:`OFFLOAD_FROM_BYTES`)."""
    return registry.module_enabled(
        module, checkpoint_offload.NAME, checkpoint_offload.FLAG
    ) and any(
        v.numel() * v.element_size() >= OFFLOAD_FROM_BYTES
        for v in arguments.values()
        if isinstance(v, torch.Tensor)
    )


def _key(
    module: Any, arguments: dict[str, Any], parameters: tuple[torch.Tensor, ...]
) -> tuple:
    """What a stack's graph is specific to: the call's signature, train or eval
    mode, and the addresses of the stack's ``parameters`` (all of them, in order)."""
    return (
        cuda_graphs.call_signature(arguments),
        module.training,
        tuple(p.data_ptr() for p in parameters),
    )


class StackGraphs:
    """One stack's graphs, by key, least recently used first.

    A copy of the stack (``copy.deepcopy``, pickling) starts with none: the graphs
    read the original's parameters and buffers by address."""

    def __init__(self) -> None:
        self.graphs: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        # key -> None, or for a call with autograd the draws of its first call
        self.seen: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def __deepcopy__(self, memo: dict) -> StackGraphs:
        return StackGraphs()

    def __reduce__(self):
        return StackGraphs, ()

    def call(self, original, module: Any, arguments: dict[str, Any]):
        """A call without autograd: OF3's, captured, or replayed."""
        key = _key(module, arguments, tuple(module.parameters()))
        graphed = self.graphs.get(key)
        if graphed is not None:
            self.graphs.move_to_end(key)
            return graphed.replay(arguments)
        if key not in self.seen:  # OF3's call: compiles, tunes
            self._remember(key, None)
            return original(module, **arguments)
        del self.seen[key]
        graphed = self._keep(key, capture(original, module, arguments))
        return graphed.replay(arguments)  # capture computed nothing

    def call_with_autograd(self, original, module: Any, arguments: dict[str, Any]):
        """A call with autograd (the trunk's last cycle): OF3's (recording where
        its checkpoints draw random numbers), captured with its backward, or
        replayed. A replay whose forward waits for its backward runs as OF3's."""
        every = tuple(module.parameters())  # walked once per call
        parameters = tuple(p for p in every if p.requires_grad)
        differentiable = tuple(
            name
            for name, value in sorted(arguments.items())
            if isinstance(value, torch.Tensor) and value.requires_grad
        )
        key = (
            *_key(module, arguments, every),
            differentiable,
            tuple(p.requires_grad for p in every),
        )
        graphed = self.graphs.get(key)
        if graphed is not None:
            if graphed.busy():
                return original(module, **arguments)
            self.graphs.move_to_end(key)
            return graphed.replay(arguments)
        if key not in self.seen:
            with autograd_graphs.recording_draws(checkpoints_through) as draws:
                out = original(module, **arguments)
            self._remember(key, draws)
            return out
        draws = self.seen.pop(key)
        graphed = self._keep(
            key,
            capture_with_autograd(
                original, module, arguments, differentiable, parameters, draws
            ),
        )
        return graphed.replay(arguments)

    def _remember(self, key: tuple, value: Any) -> None:
        self.seen[key] = value
        while len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)

    def _keep(self, key: tuple, graphed: Any) -> Any:
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = graphed
        return graphed


def graphable(arguments: dict[str, Any]) -> bool:
    """Whether a stack call with these arguments can be graphed: every tensor on
    CUDA and no chunking."""
    tensors = [v for v in arguments.values() if isinstance(v, torch.Tensor)]
    return (
        arguments.get("chunk_size") is None
        and bool(tensors)
        and all(t.is_cuda for t in tensors)
    )


def _patch_stack_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        if getattr(self, "clear_cache_between_blocks", False) or not (
            registry.module_enabled(self, NAME, FLAG)
        ):
            return original(self, *args, **kwargs)
        with_autograd = torch.is_grad_enabled()
        if with_autograd and not autograd_graphable(self):
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        arguments = {k: v for k, v in call.arguments.items() if k != "self"}
        if not graphable(arguments):
            return original(self, *args, **kwargs)
        graphs = self.__dict__.get(_CACHE_ATTR)
        if graphs is None:
            graphs = self.__dict__[_CACHE_ATTR] = StackGraphs()
        if not with_autograd:
            return graphs.call(original, self, arguments)
        if offloads(self, arguments):
            return original(self, *args, **kwargs)
        with checkpoint_offload.suspended():  # the graphs keep the checkpoints
            return graphs.call_with_autograd(original, self, arguments)

    return forward


def _validate(config: Any) -> None:
    if config.settings.memory.train.get(FLAG) and (
        sequence_parallel.SIZE_KEY.read(config) > 1
    ):
        raise KitConfigError(
            f"model_update.custom.settings.memory.train.{FLAG} is on together with "
            f"{sequence_parallel.SIZE_KEY.yaml_path} > 1: the sharded pairformer "
            "exchanges tensors between processes inside the stack, which a CUDA "
            "graph of one process cannot hold; turn one of them off"
        )


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="replay the trunk's MSA module and pairformer stack from CUDA graphs "
        "in every cycle, the last one's backward included (host time; same kernels, "
        "same results). Needs CUDA.",
        summary="The trunk's MSA module and pairformer stack replayed from CUDA "
        "graphs in every cycle, forward and backward (host time of the trunk)",
        device_check=_cuda_graphs,
        validate=_validate,
        patches=(
            registry.Patch(
                "openfold3.core.model.latent.pairformer:PairFormerStack.forward",
                _patch_stack_forward,
            ),
            registry.Patch(
                "openfold3.core.model.latent.msa_module:MSAModuleStack.forward",
                _patch_stack_forward,
            ),
        ),
    )
)
