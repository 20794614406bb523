"""Values derived from tensors, computed once per tensor object and version.

OF3 recomputes some host-side facts about a batch at every call that needs them:
how many atoms each token spreads to, whether any chain is cyclic. On the GPU each
such fact is a host synchronisation (``.item()``, a size taken from a tensor), and
a training step asks for the same facts of the same batch tensors dozens of times.
:class:`TensorCache` keeps such a value per tensor *object* and *version counter*:
an in-place change to a tensor bumps its version and misses the cache, and an
entry dies with any of its tensors. Inference tensors (made under
``torch.inference_mode``) carry no version counter and are never cached.

A CUDA graph captured over a call that takes values from a cache reads them by
address long after the lookup; :func:`retaining` collects what the caches hand out
while it is open, so the graph's owner can keep those values alive after the cache
drops them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

_RETAINED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "of3_megafold_tensor_cache_retained", default=None
)


@contextlib.contextmanager
def retaining() -> Iterator[list]:
    """Collect every value any :class:`TensorCache` returns while open, in a list
    the caller keeps (values read later by address, as by a CUDA graph)."""
    retained: list = []
    token = _RETAINED.set(retained)
    try:
        yield retained
    finally:
        _RETAINED.reset(token)


def cacheable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether values of ``tensors`` can be cached: none is an inference tensor
    (their in-place changes leave no trace in a version counter)."""
    return not any(t.is_inference() for t in tensors)


class TensorCache:
    """Up to ``max_entries`` values keyed by tensors' identities and versions and a
    hashable ``extra`` part, least recently used dropped first.

    ``hits`` and ``misses`` count lookups (tests read them).
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], Any]] = (
            OrderedDict()
        )
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self,
        tensors: Sequence[torch.Tensor],
        extra: Hashable,
        compute: Callable[[], Any],
    ) -> Any:
        """The value for ``tensors`` and ``extra``: ``compute()`` on a miss (or for
        inference tensors, uncached), the stored value on a hit.

        Args:
            tensors: the tensors the value is derived from; none may be changed
                in place without its version counter changing (true of every
                tensor outside ``torch.inference_mode``).
            extra: whatever else the value depends on (shapes, options, device).
            compute: computes the value from ``tensors`` and ``extra``.
        """
        if not cacheable(tensors):
            return _retained(compute())
        key = (tuple((id(t), t._version) for t in tensors), extra)
        entry = self._entries.get(key)
        # an id is reused only after its tensor died, whose callback dropped the
        # entry; the identity check covers a callback that has not run yet
        if entry is not None and all(
            ref() is t for ref, t in zip(entry[0], tensors, strict=True)
        ):
            self.hits += 1
            self._entries.move_to_end(key)
            return _retained(entry[1])
        self.misses += 1
        value = compute()
        drop = _dropper(weakref.ref(self), key)
        self._entries[key] = (tuple(weakref.ref(t, drop) for t in tensors), value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return _retained(value)


def _retained(value: Any) -> Any:
    """``value``, added to the open :func:`retaining` list if there is one."""
    retained = _RETAINED.get()
    if retained is not None:
        retained.append(value)
    return value


def _dropper(cache: weakref.ref, key: tuple) -> Callable[[weakref.ref], None]:
    """A weakref callback that drops ``key`` from the cache (if both still live)."""

    def drop(_: weakref.ref) -> None:
        owner = cache()
        if owner is not None:
            owner._entries.pop(key, None)

    return drop
