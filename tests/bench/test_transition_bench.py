"""The transition benchmark: its inputs, and a CPU smoke run of every provider."""

import json

import torch

from of3_megafold.bench import transition


def test_inputs_are_the_same_for_every_caller():
    """Scripts that reproduce the benchmark's call get its exact values."""
    shape = (1, 5, 5, 8)
    first = transition.inputs(shape, torch.device("cpu"), torch.bfloat16)
    second = transition.inputs(shape, torch.device("cpu"), torch.bfloat16)
    x, dy, mask = first
    assert x.requires_grad and not dy.requires_grad
    assert x.shape == dy.shape == shape and mask.shape == shape[:-1]
    assert set(mask.unique().tolist()) == {0.0, 1.0}
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_quick_run_times_both_providers(tmp_path):
    out = tmp_path / "transition.json"
    rows = transition.run(out, quick=True)
    assert [r["provider"] for r in rows] == ["of3-eager", "kit"]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    assert json.loads(out.read_text()) == rows
