"""The attention benchmark's providers compute the same function, also in OF3's
high-precision mode (the diffusion transformer's call site)."""

import pytest
import torch

from of3_megafold.bench.attention_core import (
    HIGH_PRECISION_PROVIDERS,
    _cases,
    _forward_fn,
    _inputs,
)
from of3_megafold.kernels.backend import interpreter_enabled


def test_gpu_cases_include_the_high_precision_diffusion_site():
    cases = _cases(quick=False, on_gpu=True)
    assert {c["shape"] for c in cases if c["case"] == "diffusion-hp"} == {
        (1, 48, 384, 16, 48),
        (1, 48, 768, 16, 48),
    }


@pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreter_enabled()),
    reason="the kit's kernel needs CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("high_precision", [False, True])
def test_providers_agree(high_precision):
    on_gpu = torch.cuda.is_available()
    # SDPA's memory-efficient backend (the one the bench pins) is CUDA-only.
    providers = ["torch", "kit"] + (["sdpa"] if on_gpu else [])
    assert set(providers) <= set(HIGH_PRECISION_PROVIDERS)
    q, k, v, mask_bias, pair_bias, _ = _inputs(
        (1, 3, 20, 2, 16),
        torch.device("cuda" if on_gpu else "cpu"),
        torch.bfloat16,
        torch.bfloat16,
    )
    reference = _forward_fn("torch", high_precision)(q, k, v, mask_bias, pair_bias)
    assert reference.dtype == torch.bfloat16
    for provider in providers[1:]:
        out = _forward_fn(provider, high_precision)(q, k, v, mask_bias, pair_bias)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
