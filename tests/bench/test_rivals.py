"""The rival providers: what a missing one reports, and that each wrapper computes
the same function as the kit's reference when the rival's kernel does what its
documentation says (stand-in kernels here, written in torch in the rival's own
layout, so a wrong transpose or mask conversion in the wrapper fails)."""

import importlib.util
import math
import sys
import types

import pytest
import torch

from of3_megafold.bench import attention_core, rivals
from of3_megafold.kernels.evoflash import evoflash_attention_reference


def test_a_missing_rival_names_the_package_and_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for name in rivals.RIVALS:
        reason = rivals.unavailable(name)
        assert reason.startswith(f"{name}: ") and "pip install" in reason


def test_an_installed_rival_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rivals.unavailable("cueq") == "cueq: needs a CUDA device"


def _install(monkeypatch, dotted: str, **attrs) -> None:
    """Put a stand-in module (and its parents) into ``sys.modules``."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules or i == len(parts):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for key, value in attrs.items():
        setattr(sys.modules[dotted], key, value)


def _cueq_triangle_attention(q, k, v, bias, mask=None, scale=None):
    """cuEquivariance's documented math in its layout: q/k/v ``[B, S, H, N, D]``,
    bias ``[B, 1, H, N, N]``, boolean ``mask [B, S, 1, 1, N]`` (True = keep)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = scale * q.float() @ k.float().transpose(-1, -2) + bias.float()
    logits = logits.masked_fill(~mask, -1e9)
    return (torch.softmax(logits, -1) @ v.float()).to(q.dtype)


def _deepspeed_evoformer(q, k, v, biases):
    """DeepSpeed's documented math in the kit's layout ``[B, S, N, H, D]``."""
    mask_bias, pair_bias = biases
    qh, kh, vh = (t.float().transpose(-2, -3) for t in (q, k, v))
    logits = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    weights = torch.softmax(logits + mask_bias.float() + pair_bias.float(), -1)
    return (weights @ vh).transpose(-2, -3).to(q.dtype)


@pytest.fixture
def stand_in_kernels(monkeypatch):
    _install(
        monkeypatch,
        "cuequivariance_torch.primitives.triangle",
        triangle_attention=_cueq_triangle_attention,
    )
    _install(
        monkeypatch,
        "deepspeed.ops.deepspeed4science",
        DS4Sci_EvoformerAttention=_deepspeed_evoformer,
    )


@pytest.mark.parametrize("provider", sorted(rivals.ATTENTION_CALLS))
def test_attention_wrappers_compute_the_kits_function(stand_in_kernels, provider):
    # N != H != S so that a swapped axis changes shapes or values
    q, k, v, mask_bias, pair_bias, do = attention_core._inputs(
        (2, 3, 20, 4, 8), torch.device("cpu"), torch.float32, torch.float32
    )
    want = evoflash_attention_reference(q, k, v, mask_bias, pair_bias, upcast=True)
    got = attention_core._forward_fn(provider)(q, k, v, mask_bias, pair_bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # The timed call runs on inputs already in the rival's layout, and its output
    # gradient is the same one, moved there too.
    forward, native = attention_core._timed(
        provider, False, (q, k, v, mask_bias, pair_bias, do)
    )
    call = rivals.ATTENTION_CALLS[provider]()
    out = forward(*native[:5])
    torch.testing.assert_close(call.from_native(out), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(call.from_native(native[5]), do)
    assert all(t.is_leaf and t.requires_grad for t in (*native[:3], native[4]))


class _LayerNormFn(torch.autograd.Function):
    """Liger's ``LigerLayerNormFunction.apply(X, W, B, eps)``, in torch."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


class _SiLUMulFn(torch.autograd.Function):
    """Liger's ``LigerSiLUMulFunction.apply(a, b)``, in torch."""

    @staticmethod
    def forward(ctx, a, b):
        return torch.nn.functional.silu(a) * b


def test_liger_transition_is_of3s_transition(monkeypatch):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    _install(
        monkeypatch, "liger_kernel.ops.layer_norm", LigerLayerNormFunction=_LayerNormFn
    )
    _install(monkeypatch, "liger_kernel.ops.swiglu", LigerSiLUMulFunction=_SiLUMulFn)
    torch.manual_seed(0)
    module = SwiGLUTransition(c_in=12, n=3)
    with torch.no_grad():  # OF3 zero-initialises linear_out; LayerNorm starts at 1/0
        for p in module.parameters():
            p.normal_()
    x = torch.randn(2, 5, 7, 12)
    mask = (torch.rand(2, 5, 7) > 0.3).float()
    want = module(x, mask=mask)
    got = rivals.liger_swiglu_transition(module)(x, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
