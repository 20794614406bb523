"""Trunk graphs: the trunk's cycles without autograd replay OF3's MSA module and
pairformer stack from CUDA graphs.

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

Runs as OF3's: calls with autograd (the last cycle, and its recomputation in the
backward), chunked calls (``chunk_size`` set: OF3's inference, whose chunk tuner
runs trial blocks), stacks that empty the allocator's cache between blocks, and
tensors off CUDA. A capture that fails raises :class:`TrunkCaptureError` naming the
key (after a failed capture the process's CUDA generator is left in capture mode,
so running on would not be safe). Sequence parallelism's sharded stack exchanges
tensors between processes inside the stack: the two are refused together in
training.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.errors import KitConfigError
from of3_megafold.extensions import sequence_parallel
from of3_megafold.kernels.backend import cuda_device
from of3_megafold.runtime import cuda_graphs
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


class StackGraphs:
    """One stack's graphs, by key, least recently used first.

    A copy of the stack (``copy.deepcopy``, pickling) starts with none: the graphs
    read the original's parameters and buffers by address."""

    def __init__(self) -> None:
        self.graphs: collections.OrderedDict[tuple, GraphedCall] = (
            collections.OrderedDict()
        )
        self.seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()

    def __deepcopy__(self, memo: dict) -> StackGraphs:
        return StackGraphs()

    def __reduce__(self):
        return StackGraphs, ()

    def call(self, original, module: Any, arguments: dict[str, Any]):
        key = (
            cuda_graphs.call_signature(arguments),
            module.training,
            tuple(p.data_ptr() for p in module.parameters()),
        )
        graphed = self.graphs.get(key)
        if graphed is not None:
            self.graphs.move_to_end(key)
            return graphed.replay(arguments)
        if key not in self.seen:  # OF3's call: compiles, tunes
            self.seen[key] = None
            while len(self.seen) > MAX_SEEN:
                self.seen.popitem(last=False)
            return original(module, **arguments)
        del self.seen[key]
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        graphed = self.graphs[key] = capture(original, module, arguments)
        return graphed.replay(arguments)  # capture computed nothing


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
        if (
            torch.is_grad_enabled()
            or getattr(self, "clear_cache_between_blocks", False)
            or not registry.module_enabled(self, NAME, FLAG)
        ):
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        arguments = {k: v for k, v in call.arguments.items() if k != "self"}
        if not graphable(arguments):
            return original(self, *args, **kwargs)
        graphs = self.__dict__.get(_CACHE_ATTR)
        if graphs is None:
            graphs = self.__dict__[_CACHE_ATTR] = StackGraphs()
        return graphs.call(original, self, arguments)

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
        "in the cycles without autograd (host time; same kernels, same results). "
        "Needs CUDA.",
        summary="The trunk's MSA module and pairformer stack replayed from CUDA "
        "graphs in the cycles without autograd (host time of every recycle)",
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
