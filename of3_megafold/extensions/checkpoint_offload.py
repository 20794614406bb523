"""Checkpoint offload: OF3's activation-checkpoint inputs wait in pinned host memory.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_checkpoint_offload``
(default false).

In training OF3 checkpoints every block of its stacks (``blocks_per_ckpt`` 1 in the
``train`` preset): the pairformer's 48 blocks, the MSA module's, the template
stack's and the diffusion transformer's. A checkpoint keeps only its block's inputs,
but at long crops those inputs are the largest thing the backward starts from: the
trunk's 48 copies of the pair representation ``z`` ``[N, N, 128]`` are 32 GiB in
bf16 at 1664 tokens. With a key on, OF3's ``checkpoint_blocks`` runs its loop inside
:class:`of3_megafold.runtime.host_offload.HostOffload`: each checkpoint's inputs are
copied to pinned host memory on a side stream as the forward saves them, and copied
back one block ahead of the backward's recompute. The checkpointed blocks, their
RNG and autocast handling and their gradients are OF3's (``torch.utils.checkpoint``;
DeepSpeed's checkpoint function, which OF3 picks when DeepSpeed's checkpointing is
configured, is untested here): only where the saved inputs wait changes. The kit's
sequence-parallel pairformer goes through the same ``checkpoint_blocks``.

The cost is two PCIe copies of every checkpoint input per step (the trunk's ``z``
alone: 2 x 6.8 GiB at 768 tokens, 2 x 32 GiB at 1664), on their own stream beside the
blocks' compute, and as much pinned host memory as the inputs take (a tensor that
would leave the host less than 8 GiB available stays on the device, warned once per
stack). CUDA tensors only; a stack that runs without checkpoints (inference,
``blocks_per_ckpt`` unset), inside another saved-tensor hook (an outer checkpoint's
region, a user's ``save_on_cpu``), or on CPU tensors runs exactly as OF3's. So
does a trunk stack at short crops when ``use_trunk_cuda_graphs`` is on too: there
the trunk graphs take its cycle with autograd
(:data:`of3_megafold.extensions.trunk_graphs.OFFLOAD_FROM_BYTES`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.kernels.backend import cuda_device
from of3_megafold.runtime.host_offload import HostOffload, host_available_bytes

logger = logging.getLogger(__name__)

NAME = "checkpoint_offload"
FLAG = "use_checkpoint_offload"

OFFLOAD_DEVICES: tuple[str, ...] = ("cuda",)
"""Device types whose checkpoint inputs move (tests add ``"cpu"``)."""

MIN_BYTES = 1 << 20
"""Checkpoint inputs smaller than this stay on the device (masks, small stacks)."""

_CHECKPOINT_BLOCKS_USERS = (
    "openfold3.core.utils.checkpointing",
    "openfold3.core.model.latent.pairformer",
    "openfold3.core.model.latent.base_stacks",
    "openfold3.core.model.latent.template_module",
    "openfold3.core.model.layers.diffusion_transformer",
)
"""Modules whose ``checkpoint_blocks`` name is patched (the stacks import it by name;
the kit's sequence-parallel pairformer imports it from OF3's checkpointing module)."""


def _cuda() -> registry.Check:
    ok, reason = cuda_device(
        "offloading moves GPU memory to the host (without the key the checkpoints "
        "keep their inputs on the device, as OF3's)"
    )
    available = host_available_bytes()
    if ok and available is not None:
        reason += f"; host memory available: {available / 2**30:.0f} GiB"
    return ok, reason


def block_module(block: Any) -> torch.nn.Module | None:
    """The module behind one of ``checkpoint_blocks``'s callables: OF3's stacks pass
    ``functools.partial(block_module, ...)``, the kit's sequence-parallel pairformer
    ``functools.partial(sharded_pairformer_block, block_module, ...)``; anything else
    has none."""
    while isinstance(block, functools.partial):
        if not isinstance(block.func, torch.nn.Module | functools.partial) and (
            block.args and isinstance(block.args[0], torch.nn.Module)
        ):
            return block.args[0]
        block = block.func
    return block if isinstance(block, torch.nn.Module) else None


_suspension = threading.local()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within it, ``checkpoint_blocks`` runs as OF3's in this thread: the checkpoints
    keep their inputs on the device (for a caller that graphs the stack,
    :mod:`of3_megafold.extensions.trunk_graphs`)."""
    depth = getattr(_suspension, "depth", 0)
    _suspension.depth = depth + 1
    try:
        yield
    finally:
        _suspension.depth = depth


def _other_hooks_active() -> bool:
    """A saved-tensor hook is already active (an outer checkpoint's region, a user's
    ``save_on_cpu``): it decides where saved tensors go, not this extension."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _offloaded_module(blocks, args, blocks_per_ckpt) -> torch.nn.Module | None:
    """The first block's module if this ``checkpoint_blocks`` call offloads, else
    None (see the module docstring for what runs as OF3's)."""
    if blocks_per_ckpt is None or not torch.is_grad_enabled() or not blocks:
        return None
    if getattr(_suspension, "depth", 0):
        return None
    module = block_module(blocks[0])
    if module is None or not registry.module_enabled(module, NAME, FLAG):
        return None
    if _other_hooks_active():
        return None
    tensors = [a for a in (args if isinstance(args, tuple) else (args,))
               if isinstance(a, torch.Tensor)]
    if any(t.device.type not in OFFLOAD_DEVICES for t in tensors):
        registry.log_device_fallback(NAME, tensors[0].device.type)
        return None
    return module


def _patch_checkpoint_blocks(original):
    @torch.jit.ignore  # as OF3's: scripted callers leave it to Python
    def checkpoint_blocks(blocks, args, blocks_per_ckpt, use_reentrant=None):
        module = _offloaded_module(blocks, args, blocks_per_ckpt)
        if module is None:
            return original(blocks, args, blocks_per_ckpt, use_reentrant)
        offload = HostOffload(min_bytes=MIN_BYTES, devices=OFFLOAD_DEVICES)
        with offload:
            out = original(blocks, args, blocks_per_ckpt, use_reentrant)
        logger.debug("%s: %s moved %.2f GiB of checkpoint inputs to the host", NAME,
                     type(module).__name__, offload.moved_bytes / 2**30)
        return out

    return checkpoint_blocks


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="keep OF3's activation-checkpoint inputs (the pair representation per "
        "block) in pinned host memory between forward and backward; copies overlap "
        "compute. Needs CUDA.",
        summary="OF3's activation-checkpoint inputs kept in pinned host memory "
        "between forward and backward (longer crops; copies overlap compute)",
        device_check=_cuda,
        patches=tuple(
            registry.Patch(f"{module}:checkpoint_blocks", _patch_checkpoint_blocks)
            for module in _CHECKPOINT_BLOCKS_USERS
        ),
    )
)
