"""EvoFusion inside OF3's transition modules: same weights, key on vs off.

Both run under bf16 autocast (how Lightning's bf16-mixed trains OF3); errors against
OF3's module in float64. The kit (Triton; the interpreter on CPU) must stay within 2x
OF3's bf16 error plus a small floor, for the output and the gradients of the input
and of every parameter. fp32 transitions run OF3's math, recomputed (bitwise).
"""

import copy

import pytest
import torch
from ml_collections import ConfigDict

from of3_megafold import activate, registry


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


@pytest.fixture
def kernel_calls(monkeypatch, interpreted_kernels):
    """How often the fused autograd function ran."""
    from of3_megafold.kernels.swiglu_transition import SwiGLUTransitionFunction

    calls = []
    apply = SwiGLUTransitionFunction.apply

    def counted(*args):
        calls.append(args[-1])  # the compute dtype
        return apply(*args)

    monkeypatch.setattr(SwiGLUTransitionFunction, "apply", counted)
    return calls


def _run(module, inputs, grad_out, autocast=False):
    inputs = {
        k: v.detach().clone().requires_grad_(k != "mask") for k, v in inputs.items()
    }
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(**inputs)
    out.backward(grad_out.to(out.dtype))
    return (
        [out.detach()]
        + [v.grad for k, v in inputs.items() if k != "mask"]
        + [p.grad for p in module.parameters()]
    )


def _compare(module, inputs, switch_on):
    torch.manual_seed(1)
    reference = _run(
        copy.deepcopy(module).double(),
        {k: v.double() for k, v in inputs.items()},
        grad_out := torch.randn(module(**inputs).shape, dtype=torch.float64),
    )
    stock = _run(module, inputs, grad_out, autocast=True)
    switch_on()
    kit = _run(module, inputs, grad_out, autocast=True)
    activate()
    for i, (r, s, k) in enumerate(zip(reference, stock, kit, strict=True)):
        scale = r.abs().max().item() + 1e-12
        stock_err = (s.double() - r).abs().max().item() / scale
        kit_err = (k.double() - r).abs().max().item() / scale
        assert kit_err <= 2 * stock_err + 2e-3, (i, kit_err, stock_err)


def _force():
    activate(force=["evofusion_transitions"])


# c = 136 > 128 takes the kernels' torch fallback (as OF3's c = 384 single
# transition does): OF3's [*, 1] mask must broadcast the same way there.
@pytest.mark.parametrize(("c", "n", "rows"), [(8, 4, 7), (24, 2, 33), (136, 2, 5)])
def test_swiglu_transition(kit, kernel_calls, c, n, rows):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = _randomize(SwiGLUTransition(c_in=c, n=n), c)
    mask = (torch.rand(1, rows) > 0.3).float()
    _compare(module, {"x": torch.randn(1, rows, c), "mask": mask}, _force)
    assert kernel_calls == ([] if c > 128 else [torch.bfloat16])


def test_fp32_transitions_recompute_of3(kit, kernel_calls):
    """No autocast, fp32 input: OF3's own math, bit for bit, no kernel launch, and
    under checkpointing: less kept for the backward than OF3 keeps."""
    from openfold3.core.model.layers.transition import (
        ConditionedTransitionBlock,
        SwiGLUTransition,
    )

    def saved_bytes(module, inputs, grad_out):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results = _run(module, inputs, grad_out)
        return results, sum(total)

    torch.manual_seed(0)
    cases = [
        (_randomize(SwiGLUTransition(c_in=8, n=4), 1), {"x": torch.randn(2, 5, 8)}),
        (
            _randomize(ConditionedTransitionBlock(c_a=16, c_s=8, n=4), 2),
            {"a": torch.randn(1, 9, 16), "s": torch.randn(1, 9, 8)},
        ),
    ]
    for module, inputs in cases:
        rows = next(iter(inputs.values())).shape[:-1]
        inputs["mask"] = (torch.rand(rows) > 0.3).float()
        grad_out = torch.randn(module(**inputs).shape)
        stock, stock_saved = saved_bytes(module, inputs, grad_out)
        _force()
        kit_, kit_saved = saved_bytes(module, inputs, grad_out)
        activate()
        for s, k in zip(stock, kit_, strict=True):
            assert torch.equal(s, k)
        assert kit_saved < stock_saved / 2, (kit_saved, stock_saved)
    assert kernel_calls == []


@pytest.mark.parametrize(
    ("shape", "mask_shape", "chunks"),
    [
        ((1, 7, 5, 8), (1, 7, 5), 3),  # 3 slices of dim -3 per chunk: 3 + 3 + 1
        ((2, 7, 5, 8), (1, 7, 5), 3),  # a mask broadcast over the batch
        ((1, 7, 5, 8), (5,), 3),  # a mask broadcast over dim -3
        ((2, 7, 5, 8), (3, 2, 7, 5), 1),  # a mask that widens x: one checkpoint
        ((7, 8), (7,), 1),  # fewer than 3 dims: one checkpoint
        ((1, 0, 5, 8), (1, 0, 5), 1),  # empty: one checkpoint
    ],
)
def test_large_fp32_transition_recomputes_in_chunks(
    kit, kernel_calls, monkeypatch, shape, mask_shape, chunks
):
    """Above RECOMPUTE_CHUNK_BYTES of hidden activations, the recomputed fp32
    transition runs as checkpointed chunks of dim -3, each within the budget: OF3's
    output and gradients to fp32 rounding, nothing but the inputs kept."""
    from openfold3.core.model.layers.transition import SwiGLUTransition

    from of3_megafold.extensions import evofusion_transitions as ext

    module = _randomize(SwiGLUTransition(c_in=8, n=4), 3)
    hidden = module.swiglu.linear_a.out_features
    rows_per_slice = 5 if len(shape) > 2 else 1
    budget = 3 * rows_per_slice * shape[0] * hidden * 4  # 3 slices of dim -3
    monkeypatch.setattr(ext, "RECOMPUTE_CHUNK_BYTES", budget)
    sliced = []
    recomputed = ext._recomputed

    def counted(original, mod, x, mask):
        sliced.append(x.shape[-3] if x.dim() >= 3 else None)
        return recomputed(original, mod, x, mask)

    monkeypatch.setattr(ext, "_recomputed", counted)
    torch.manual_seed(4)
    inputs = {"x": torch.randn(shape), "mask": (torch.rand(mask_shape) > 0.3).float()}
    grad_out = torch.randn(module(**inputs).shape)
    stock = _run(module, inputs, grad_out)
    _force()
    kit_ = _run(module, inputs, grad_out)
    activate()
    assert len(sliced) == chunks
    if chunks > 1:
        assert sliced == [3, 3, 1]
    for s, k in zip(stock, kit_, strict=True):
        torch.testing.assert_close(k, s, rtol=1e-5, atol=1e-6)
    assert kernel_calls == []


def test_swiglu_transition_reads_model_settings(kit, kernel_calls):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = _randomize(SwiGLUTransition(c_in=8, n=2), 5).train()
    memory = ConfigDict(
        {
            "train": {"use_evofusion_transitions": True},
            "eval": {"use_evofusion_transitions": False},
        }
    )

    def tag():
        for m in module.modules():
            object.__setattr__(m, registry.MEMORY_ATTR, memory)

    _compare(module, {"x": torch.randn(2, 5, 8), "mask": torch.ones(2, 5)}, tag)
    assert kernel_calls == [torch.bfloat16]  # the train-mode key only


def test_conditioned_transition_block(kit, kernel_calls):
    from openfold3.core.model.layers.transition import ConditionedTransitionBlock

    module = _randomize(ConditionedTransitionBlock(c_a=16, c_s=8, n=2), 7)
    inputs = {
        "a": torch.randn(1, 2, 9, 16),
        "s": torch.randn(1, 2, 9, 8),
        "mask": (torch.rand(1, 2, 9) > 0.3).float(),
    }
    _compare(module, inputs, _force)
    assert kernel_calls == [torch.bfloat16]


def test_cpu_tensors_take_ofs_path_without_the_interpreter(
    kit, monkeypatch, device_fallback_messages
):
    """On a GPU machine without the interpreter the kernels cannot take CPU tensors
    (OF3's CPU tests run there too): the forced extension runs OF3's own module,
    bit for bit, and says so once."""
    from openfold3.core.model.layers.transition import SwiGLUTransition

    from of3_megafold.kernels import swiglu_transition as kernels

    def kernel_called(*args, **kwargs):
        raise AssertionError("the kernel path ran on CPU tensors")

    monkeypatch.setattr(kernels, "swiglu_transition", kernel_called)
    module = _randomize(SwiGLUTransition(c_in=8, n=2), 3)
    x = torch.randn(1, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module(x=x, mask=None)
        _force()
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert torch.equal(module(x=x, mask=None), expected)
        assert torch.equal(module(x=x, mask=None), expected)
    said = device_fallback_messages()
    assert len(said) == 1 and "evofusion_transitions" in said[0]


def test_layer_norm_on_16_bit_inputs(kit, interpreted_kernels, monkeypatch):
    """OF3's LayerNorm with the key on: 16-bit inputs take the kernel (within 2x
    OF3's error against fp64, output and every gradient); fp32 inputs keep OF3's
    path, bit for bit."""
    from openfold3.core.model.primitives.normalization import LayerNorm

    from of3_megafold.kernels.layer_norm import function as kernels

    calls = []
    apply = kernels.LayerNormFunction.apply
    monkeypatch.setattr(
        kernels.LayerNormFunction,
        "apply",
        lambda *args: calls.append(args[0].dtype) or apply(*args),
    )
    module = _randomize(LayerNorm(24), 9)
    torch.manual_seed(2)
    x = torch.randn(2, 7, 24) * 2 + 1
    grad_out = torch.randn(2, 7, 24)
    reference = _run(
        copy.deepcopy(module).double(), {"x": x.double()}, grad_out.double()
    )
    for dtype in (torch.bfloat16, torch.float16):
        stock = _run(module, {"x": x.to(dtype)}, grad_out)
        _force()
        kit_ = _run(module, {"x": x.to(dtype)}, grad_out)
        activate()
        for i, (r, s, k) in enumerate(zip(reference, stock, kit_, strict=True)):
            assert k.dtype == s.dtype, i
            scale = r.abs().max().item()
            stock_err = (s.double() - r).abs().max().item() / scale
            kit_err = (k.double() - r).abs().max().item() / scale
            assert kit_err <= 2 * stock_err + 2e-3, (dtype, i, kit_err, stock_err)
    assert calls == [torch.bfloat16, torch.float16]
    stock = _run(module, {"x": x}, grad_out)
    _force()
    kit_ = _run(module, {"x": x}, grad_out)
    activate()
    assert all(torch.equal(s, k) for s, k in zip(stock, kit_, strict=True))
    assert calls == [torch.bfloat16, torch.float16]
