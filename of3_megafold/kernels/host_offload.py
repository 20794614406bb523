"""Saved tensors parked in pinned host memory between the forward and the backward.

:class:`HostOffload` is a ``torch.autograd.graph.saved_tensors_hooks`` context. Every
tensor that autograd saves while it is active and that is at least ``min_bytes`` on an
offloaded device is copied to pinned host memory on a side stream (the device copy is
freed as soon as the forward drops it), and copied back when the backward unpacks it.
Unpacking a tensor starts copying back as many bytes again of the tensors packed
before it that the backward has not unpacked yet, so in a stack of activation
checkpoints, whose backward runs the blocks in reverse order, the previous block's
inputs travel while the current block recomputes.

Activation checkpoints save only their inputs through the ambient hooks (what the
checkpointed function saves goes to the checkpoint's own hook, pushed on top), so
around a loop of checkpoints this moves exactly the checkpoint inputs: for OF3's
pairformer that is the pair representation ``z`` ``[*, N, N, C_z]`` once per block.
That is the use it is written for; around code without checkpoints it would move
every saved activation, which works but costs a PCIe round trip per tensor.

Ordering (``copy`` is the device's side stream, ``main`` the stream that saved or
unpacks): the device-to-host copy waits for ``main`` and the saved tensor is marked as
used by ``copy`` (``record_stream``), so the allocator cannot hand its memory out
before the copy has read it; the host-to-device copy writes a tensor allocated from
``main``'s pool after ``copy`` has waited for ``main``, and ``main`` waits for the
copy's event before the tensor is returned. CPU tensors are never moved unless the
``devices`` argument names ``"cpu"`` (tests use that to run the bookkeeping, prefetch
included, without a GPU: every copy is then a plain clone).

Imports neither OpenFold3 nor Triton.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

DEFAULT_MIN_BYTES = 1 << 20
"""Saved tensors smaller than this stay where they are (1 MiB: masks, single reps)."""

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that carries this device's host copies (one per device)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream


class _Stash:
    """One saved tensor while it is away: the host copy, the events that order the
    copies, and a link to the tensor packed before it (the next one the backward
    will want).

    Attributes:
        host: the host copy (pinned for CUDA tensors), same shape and dtype.
        device: where the tensor lives and goes back to.
        to_host: event recorded on the copy stream after the device-to-host copy
            (CUDA only).
        fetched: the tensor already copied back by a prefetch, or None.
        to_device: event recorded after that copy (CUDA only).
        unpacked: the backward has taken it at least once.
        previous: the stash packed just before this one in the same context.
    """

    __slots__ = ("host", "device", "to_host", "fetched", "to_device", "unpacked",
                 "previous")

    def __init__(self, host, device, to_host, previous):
        self.host = host
        self.device = device
        self.to_host = to_host
        self.fetched = None
        self.to_device = None
        self.unpacked = False
        self.previous = previous

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Keep saved tensors of at least ``min_bytes`` in host memory until backward.

    Args:
        min_bytes: smaller saved tensors are kept as they are.
        devices: device types whose tensors move (default CUDA only).
        prefetch: on unpacking a tensor, start copying back as many bytes of the
            not yet unpacked tensors packed before it.

    Attributes:
        moved_bytes: bytes copied to the host so far by this context (for logs and
            tests).
    """

    def __init__(
        self,
        min_bytes: int = DEFAULT_MIN_BYTES,
        devices: Iterable[str] = ("cuda",),
        prefetch: bool = True,
    ):
        self.min_bytes = int(min_bytes)
        self.devices = frozenset(devices)
        self.prefetch = prefetch
        self.moved_bytes = 0
        self._last: _Stash | None = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type not in self.devices or nbytes < self.min_bytes:
            return tensor
        if tensor.device.type == "cuda":
            main = torch.cuda.current_stream(tensor.device)
            copy = copy_stream(tensor.device)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copy.wait_stream(main)
            with torch.cuda.stream(copy):
                host.copy_(tensor, non_blocking=True)
                to_host = torch.cuda.Event()
                to_host.record(copy)
            tensor.record_stream(copy)
        else:
            host, to_host = tensor.detach().clone(), None
        self.moved_bytes += nbytes
        self._last = _Stash(host, tensor.device, to_host, self._last)
        return self._last

    def __exit__(self, *exc_info):
        self._last = None  # the saved tensors own their stashes from here on
        return super().__exit__(*exc_info)

    def _unpack(self, packed):
        if not isinstance(packed, _Stash):
            return packed
        tensor = _fetch(packed)
        packed.fetched, packed.to_device = None, None  # keep no device reference
        packed.unpacked = True
        if self.prefetch:
            _prefetch_before(packed)
        return tensor


def _prefetch_before(stash: _Stash) -> None:
    """Start copying back the not yet unpacked stashes packed before ``stash``,
    newest first, until as many bytes as ``stash`` holds are on their way."""
    budget, previous = stash.nbytes, stash.previous
    while previous is not None and budget > 0:
        if not previous.unpacked:
            _start_fetch(previous)
            budget -= previous.nbytes
        previous = previous.previous


def _start_fetch(stash: _Stash) -> None:
    """Begin copying ``stash`` back to its device without waiting for it."""
    if stash.fetched is not None:
        return
    if stash.device.type != "cuda":
        stash.fetched = stash.host.clone()
        return
    main = torch.cuda.current_stream(stash.device)
    copy = copy_stream(stash.device)
    fetched = torch.empty(stash.host.shape, dtype=stash.host.dtype, device=stash.device)
    copy.wait_stream(main)  # ``fetched``'s memory may still be read by queued work
    with torch.cuda.stream(copy):
        copy.wait_event(stash.to_host)
        fetched.copy_(stash.host, non_blocking=True)
        stash.to_device = torch.cuda.Event()
        stash.to_device.record(copy)
    stash.fetched = fetched


def _fetch(stash: _Stash) -> torch.Tensor:
    """The stashed tensor on its device, copied back now unless a prefetch did."""
    if stash.fetched is not None:
        if stash.to_device is not None:
            torch.cuda.current_stream(stash.device).wait_event(stash.to_device)
        return stash.fetched
    if stash.device.type != "cuda":
        return stash.host.clone()
    main = torch.cuda.current_stream(stash.device)
    main.wait_event(stash.to_host)
    return stash.host.to(stash.device, non_blocking=True)
