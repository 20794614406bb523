"""Values derived from tensors, computed once per tensor object and version.

OF3 recomputes some host-side facts about a batch at every call that needs them:
how many atoms each token spreads to, whether any chain is cyclic. On the GPU each
such fact is a host synchronisation (``.item()``, a size taken from a tensor), and
a training step asks for the same facts of the same batch tensors dozens of times.
:class:`TensorCache` keeps such a value per tensor *object* and *version counter*:
an in-place change to a tensor bumps its version and misses the cache, and an
entry dies with any of its tensors. Inference tensors (made under
``torch.inference_mode``) carry no version counter and are never cached.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch


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
            return compute()
        key = (tuple((id(t), t._version) for t in tensors), extra)
        entry = self._entries.get(key)
        # an id is reused only after its tensor died, whose callback dropped the
        # entry; the identity check covers a callback that has not run yet
        if entry is not None and all(
            ref() is t for ref, t in zip(entry[0], tensors, strict=True)
        ):
            self.hits += 1
            self._entries.move_to_end(key)
            return entry[1]
        self.misses += 1
        value = compute()
        drop = _dropper(weakref.ref(self), key)
        self._entries[key] = (tuple(weakref.ref(t, drop) for t in tensors), value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value


def _dropper(cache: weakref.ref, key: tuple) -> Callable[[weakref.ref], None]:
    """A weakref callback that drops ``key`` from the cache (if both still live)."""

    def drop(_: weakref.ref) -> None:
        owner = cache()
        if owner is not None:
            owner._entries.pop(key, None)

    return drop
