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
``devices`` argument names ``"cpu"`` (tests use that to run the bookkeeping, pieces
and prefetch included, without a GPU: the copies are then plain CPU copies).

Host memory comes in power-of-two pieces: torch's pinned-memory allocator rounds every
allocation up to a power of two (and caches it), so one 1.2 GB tensor (``z`` at 2176
tokens) would hold 2 GiB of pinned memory, and 48 of them would not fit a 128 GiB
host. A tensor of ``n`` bytes is stored as the pieces of ``n``'s binary expansion
down to ``PIECE_FLOOR`` (the rest in one small piece), each an exact allocator size
that later tensors reuse.

Imports neither OpenFold3 nor Triton.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MIN_BYTES = 1 << 20
"""Saved tensors smaller than this stay where they are (1 MiB: masks, single reps)."""

PIECE_FLOOR = 1 << 20
"""Host pieces are powers of two down to this size; below it, one last piece."""

HOST_RESERVE_BYTES = 8 << 30
"""A tensor moves only if the host keeps this much available memory after it (8 GiB
for the data loader workers and the rest of the process); otherwise it stays on the
device, so a step that would exhaust the host's memory runs, and runs as OF3's
would, instead of being killed."""


def host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (Linux); None where it cannot be read
    (then nothing is held back)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that carries this device's host copies (one per device)."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream


def host_pieces(nbytes: int, floor: int = PIECE_FLOOR) -> list[tuple[int, int]]:
    """``(offset, length)`` byte ranges covering ``nbytes``: the powers of two of its
    binary expansion, largest first, down to ``floor``; what is left below ``floor``
    is one last piece."""
    pieces, offset = [], 0
    while nbytes - offset >= floor:
        length = 1 << ((nbytes - offset).bit_length() - 1)
        pieces.append((offset, length))
        offset += length
    if offset < nbytes:
        pieces.append((offset, nbytes - offset))
    return pieces


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` view."""
    return tensor.reshape(-1).view(torch.uint8)


class _Stash:
    """One saved tensor while it is away: its host pieces, the events that order the
    copies, and a link to the tensor packed before it (the next one the backward
    will want).

    Attributes:
        pieces: ``(offset, host bytes)`` covering the tensor's contiguous bytes
            (pinned for CUDA tensors; :func:`host_pieces`).
        shape, dtype, device: what the tensor is and where it goes back to.
        nbytes: its size in bytes.
        to_host: event recorded on the copy stream after the device-to-host copies
            (CUDA only).
        fetched: the tensor already copied back by a prefetch, or None.
        to_device: event recorded after that copy (CUDA only).
        unpacked: the backward has taken it at least once.
        previous: the stash packed just before this one in the same context.
    """

    __slots__ = ("pieces", "shape", "dtype", "device", "nbytes", "to_host", "fetched",
                 "to_device", "unpacked", "previous")

    def __init__(self, tensor: torch.Tensor, floor: int, previous: _Stash | None):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.fetched = self.to_device = self.to_host = None
        self.unpacked = False
        self.previous = previous
        pinned = tensor.device.type == "cuda"
        self.pieces = [
            (offset, torch.empty(length, dtype=torch.uint8, pin_memory=pinned))
            for offset, length in host_pieces(self.nbytes, floor)
        ]
        if not pinned:
            self._copy_out(tensor)
            return
        main = torch.cuda.current_stream(tensor.device)
        copy = copy_stream(tensor.device)
        copy.wait_stream(main)
        with torch.cuda.stream(copy):
            self._copy_out(tensor)
            self.to_host = torch.cuda.Event()
            self.to_host.record(copy)
        tensor.record_stream(copy)

    def _copy_out(self, tensor: torch.Tensor) -> None:
        flat = _bytes(tensor.detach().contiguous())
        for offset, host in self.pieces:
            host.copy_(flat[offset:offset + host.numel()], non_blocking=True)

    def copy_back(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """``into`` (default: a new tensor on the device) filled from the pieces, on
        the current stream."""
        if into is None:
            into = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        flat = _bytes(into)
        for offset, host in self.pieces:
            flat[offset:offset + host.numel()].copy_(host, non_blocking=True)
        return into


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Keep saved tensors of at least ``min_bytes`` in host memory until backward.

    Args:
        min_bytes: smaller (and empty) saved tensors are kept as they are.
        devices: device types whose tensors move (default CUDA only).
        prefetch: on unpacking a tensor, start copying back as many bytes of the
            not yet unpacked tensors packed before it.
        piece_floor: smallest power-of-two host piece (:func:`host_pieces`).
        host_reserve: host memory (bytes) left available after a move; a tensor
            that would take the host below it stays on the device
            (:data:`HOST_RESERVE_BYTES`; checked with :func:`host_available_bytes`).

    Attributes:
        moved_bytes: bytes copied to the host so far by this context (for logs and
            tests).
        kept_bytes: bytes of tensors that stayed on the device for lack of host
            memory (logged once per context).
    """

    def __init__(
        self,
        min_bytes: int = DEFAULT_MIN_BYTES,
        devices: Iterable[str] = ("cuda",),
        prefetch: bool = True,
        piece_floor: int = PIECE_FLOOR,
        host_reserve: int = HOST_RESERVE_BYTES,
    ):
        self.min_bytes = max(int(min_bytes), 1)
        self.devices = frozenset(devices)
        self.prefetch = prefetch
        self.piece_floor = piece_floor
        self.host_reserve = host_reserve
        self.moved_bytes = 0
        self.kept_bytes = 0
        self._last: _Stash | None = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type not in self.devices or nbytes < self.min_bytes:
            return tensor
        available = host_available_bytes()
        if available is not None and available - nbytes < self.host_reserve:
            if not self.kept_bytes:
                logger.warning(
                    "host memory low (%.1f GiB available, %.1f GiB kept in reserve): "
                    "saved tensors that do not fit stay on %s",
                    available / 2**30, self.host_reserve / 2**30, tensor.device)
            self.kept_bytes += nbytes
            return tensor
        self.moved_bytes += nbytes
        self._last = _Stash(tensor, self.piece_floor, self._last)
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
        stash.fetched = stash.copy_back()
        return
    main = torch.cuda.current_stream(stash.device)
    copy = copy_stream(stash.device)
    # from ``main``'s pool (``main`` reads and frees it); the memory may still be
    # read by work queued on ``main``, so the copy waits for that first
    fetched = torch.empty(stash.shape, dtype=stash.dtype, device=stash.device)
    copy.wait_stream(main)
    with torch.cuda.stream(copy):
        copy.wait_event(stash.to_host)
        stash.fetched = stash.copy_back(into=fetched)
        stash.to_device = torch.cuda.Event()
        stash.to_device.record(copy)


def _fetch(stash: _Stash) -> torch.Tensor:
    """The stashed tensor on its device, copied back now unless a prefetch did."""
    if stash.fetched is not None:
        if stash.to_device is not None:
            torch.cuda.current_stream(stash.device).wait_event(stash.to_device)
        return stash.fetched
    if stash.device.type == "cuda":
        torch.cuda.current_stream(stash.device).wait_event(stash.to_host)
    return stash.copy_back()
