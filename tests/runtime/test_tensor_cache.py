"""TensorCache: one value per tensor object and version, dropped with its tensors."""

from __future__ import annotations

import gc

import torch

from of3_megafold.runtime.tensor_cache import TensorCache, retaining


def _counting(cache: TensorCache, tensors, extra=None):
    calls = []

    def compute():
        calls.append(1)
        return sum(float(t.sum()) for t in tensors)

    return cache.get(tensors, extra, compute), len(calls)


def test_a_hit_skips_the_computation_and_extra_parts_of_the_key_count():
    cache = TensorCache()
    a, b = torch.rand(5), torch.rand(3)
    first, computed = _counting(cache, (a, b), extra=(1,))
    assert computed == 1
    again, computed = _counting(cache, (a, b), extra=(1,))
    assert (again, computed) == (first, 0)
    _, computed = _counting(cache, (a, b), extra=(2,))
    assert computed == 1
    _, computed = _counting(cache, (b, a), extra=(1,))
    assert computed == 1
    assert (cache.hits, cache.misses) == (1, 3)


def test_an_in_place_change_misses():
    cache = TensorCache()
    a = torch.rand(4)
    before, _ = _counting(cache, (a,))
    a.add_(1.0)
    after, computed = _counting(cache, (a,))
    assert computed == 1
    assert after == float(a.sum()) != before


def test_an_equal_but_distinct_tensor_misses():
    cache = TensorCache()
    a = torch.rand(4)
    _counting(cache, (a,))
    _, computed = _counting(cache, (a.clone(),))
    assert computed == 1


def test_entries_die_with_their_tensors():
    cache = TensorCache()
    keep = torch.rand(2)
    for _ in range(3):
        _counting(cache, (keep, torch.rand(3)))
    gc.collect()
    assert len(cache) == 0
    _counting(cache, (keep,))
    assert len(cache) == 1


def test_least_recently_used_entries_go_first():
    cache = TensorCache(max_entries=2)
    a, b, c = torch.rand(1), torch.rand(1), torch.rand(1)
    _counting(cache, (a,))
    _counting(cache, (b,))
    _counting(cache, (a,))  # a is now the most recent
    _counting(cache, (c,))  # drops b
    assert _counting(cache, (a,))[1] == 0
    assert _counting(cache, (b,))[1] == 1


def test_inference_tensors_are_never_cached():
    cache = TensorCache()
    with torch.inference_mode():
        a = torch.rand(3)
    _counting(cache, (a,))
    assert _counting(cache, (a,))[1] == 1
    assert len(cache) == 0


def test_retaining_keeps_what_every_cache_hands_out_while_open():
    """Hits, misses and uncached values alike: a graph reads them all by address."""
    first, second = TensorCache(max_entries=1), TensorCache()
    a, b = torch.rand(2), torch.rand(3)
    with torch.inference_mode():
        c = torch.rand(4)
    _counting(first, (a,))  # before: not retained
    with retaining() as retained, retaining() as inner:
        hit = first.get((a,), None, list)
        miss = second.get((b,), None, list)
        uncached = second.get((c,), None, list)
        first.get((b,), None, list)  # evicts a's entry from the cache
    assert inner and not retained  # the innermost collects
    assert [id(v) for v in inner[:3]] == [id(hit), id(miss), id(uncached)]
    assert len(inner) == 4
    _counting(first, (a,))
    assert len(inner) == 4  # closed: nothing more
