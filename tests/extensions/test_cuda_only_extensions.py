"""What the extensions that need a CUDA device themselves share: keys that default to
stock OF3, and on a machine without one, an unavailable extension that names why
and that ``force="all"`` leaves out."""

from __future__ import annotations

import pytest
import torch

from of3_megafold import activate, registry
from of3_megafold.errors import ExtensionUnavailableError

CUDA_ONLY = [
    ("rollout_graphs", "use_rollout_cuda_graphs", "CUDA graphs need"),
    ("checkpoint_offload", "use_checkpoint_offload", "offloading moves GPU memory"),
    ("trunk_graphs", "use_trunk_cuda_graphs", "CUDA graphs need"),
]


@pytest.mark.parametrize(("name", "flag", "why"), CUDA_ONLY)
def test_keys_default_to_stock(kit, name, flag, why):
    from openfold3.projects.of3_all_atom.config.model_config import model_config

    assert {k.dotted for k in registry.get(name).keys} == {
        f"settings.memory.{mode}.{flag}" for mode in ("train", "eval")
    }
    for mode in ("train", "eval"):
        assert model_config.settings.memory[mode][flag] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machine")
@pytest.mark.parametrize(("name", "flag", "why"), CUDA_ONLY)
def test_unavailable_without_cuda_names_the_fix(name, flag, why):
    ok, reason = registry.get(name).available()
    assert not ok and reason.startswith("no CUDA device") and why in reason
    with pytest.raises(ExtensionUnavailableError, match=why):
        activate(force=[name])
    activate(force="all")  # "all" leaves out what cannot run here
    assert registry.forced_variant(name) is None
    activate()
