"""The triangle-multiplication benchmark: the kit's provider computes the module's
update from the module's own parameters, and a CPU smoke run."""

import json

import pytest
import torch

from of3_megafold.bench import triangle_multiplication as bench


def test_inputs_are_the_same_for_every_caller():
    """Scripts that reproduce the benchmark's call get its exact values."""
    first = bench.inputs(5, 8, torch.device("cpu"))
    second = bench.inputs(5, 8, torch.device("cpu"))
    z, dz, mask = first
    assert z.requires_grad and not dz.requires_grad
    assert z.shape == dz.shape == (1, 5, 5, 8) and mask.shape == (1, 5, 5)
    assert set(mask.unique().tolist()) == {0.0, 1.0}
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_kit_provider_is_the_module(direction, device):
    module = bench._module(direction, 16, torch.device(device))
    z = torch.randn(1, 9, 9, 16).to(device, torch.bfloat16)
    mask = (torch.rand(1, 9, 9) > 0.2).float().to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        want = bench.forward_fn("of3-eager", module, z, mask)().float()
        got = bench.forward_fn("kit", module, z, mask)().float()
    scale = want.abs().max().item()
    assert scale > 0.1
    assert (got - want).abs().max().item() <= 0.05 * scale


def test_quick_run_times_both_providers(tmp_path):
    out = tmp_path / "triangle_multiplication.json"
    rows = bench.run(out, quick=True, providers=("of3-eager", "kit"))
    assert [r["provider"] for r in rows] == ["of3-eager", "kit"]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    assert json.loads(out.read_text()) == rows
