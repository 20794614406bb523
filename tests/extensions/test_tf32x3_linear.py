"""TF32x3 linear inside OF3's ``Linear``: which GEMMs it takes, their values and
gradients against OF3's in fp64, and a training step of the tiny model.

On the CPU the kit's GEMMs run in fp32 (no tensor cores): the values test the
routing and the autograd, and hold the kit to 2x OF3's fp32 error plus a floor;
tests/kernels/test_tf32x3_linear.py holds the TF32 arithmetic to the same rule.
"""

from __future__ import annotations

import copy

import pytest
import torch

from of3_megafold import activate
from of3_megafold.extensions import tf32x3_linear

NAME = "tf32x3_linear"
FLAG = "use_tf32x3_linear"


@pytest.fixture
def kernel_calls(monkeypatch, interpreted_kernels):
    """The shapes of the inputs the kit's linear ran on; every GEMM counts. The
    float32 matmul precision is torch's default for the test (OF3's ``predict``,
    which other tests run in this process, leaves it at "high")."""
    import of3_megafold.kernels.tf32x3_linear as kernel

    calls = []
    run = kernel.tf32x3_linear

    def counted(x, weight, bias):
        calls.append(tuple(x.shape))
        return run(x, weight, bias)

    monkeypatch.setattr(kernel, "tf32x3_linear", counted)
    monkeypatch.setattr(tf32x3_linear, "MIN_MNK", 1)
    monkeypatch.setattr(tf32x3_linear, "MIN_WIDTH", 1)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield calls
    torch.set_float32_matmul_precision(before)


def _linear(seed, k=24, n=40, bias=True, precision=None):
    from openfold3.core.model.primitives.linear import Linear

    gen = torch.Generator().manual_seed(seed)
    module = Linear(k, n, bias=bias, precision=precision)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _run(module, x, grad_out):
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize(("bias", "shape"), [(True, (3, 7, 24)), (False, (5, 24))])
def test_fp32_linear_matches_of3_in_fp64(kit, kernel_calls, bias, shape):
    module = _linear(1, bias=bias)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen)
    grad_out = torch.randn((*shape[:-1], 40), generator=gen, dtype=torch.float64)
    reference = _run(copy.deepcopy(module).double(), x.double(), grad_out)
    of3 = _run(module, x, grad_out)
    activate(force=[NAME])
    kit_out = _run(module, x, grad_out)
    assert kernel_calls == [shape]
    for r, o, k in zip(reference, of3, kit_out, strict=True):
        assert k.dtype == o.dtype == torch.float32 and k.shape == o.shape
        of3_err = (o.double() - r).abs().max().item()
        kit_err = (k.double() - r).abs().max().item()
        assert kit_err <= 2 * of3_err + 1e-6 * r.abs().max().item(), (kit_err, of3_err)


def test_which_gemms_it_takes(kit, kernel_calls, monkeypatch):
    """fp32 GEMMs only: OF3's 16-bit ones (a bf16 input, autocast at bf16), TF32
    chosen by the user, and GEMMs below ``MIN_MNK`` or ``MIN_WIDTH`` run OF3's
    forward."""
    activate(force=[NAME])
    x = torch.randn(4, 24)
    fp32 = _linear(3)
    fp32(x)
    assert kernel_calls == [(4, 24)]
    kernel_calls.clear()

    assert fp32(x.bfloat16()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp32(x).dtype == torch.bfloat16
    assert kernel_calls == []

    # precision=fp32 computes in fp32 whatever the input, and casts back
    pinned = _linear(4, precision=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pinned(x.bfloat16()).dtype == torch.bfloat16
    assert kernel_calls == [(4, 24)]
    kernel_calls.clear()
    assert _linear(5, precision=torch.bfloat16)(x).dtype == torch.float32
    assert kernel_calls == []

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        fp32(x)
    finally:
        torch.set_float32_matmul_precision(before)
    assert kernel_calls == []

    monkeypatch.setattr(tf32x3_linear, "MIN_MNK", 4 * 24 * 40 + 1)
    fp32(x)
    assert kernel_calls == []
    monkeypatch.setattr(tf32x3_linear, "MIN_MNK", 4 * 24 * 40)
    fp32(x)
    assert kernel_calls == [(4, 24)]
    monkeypatch.setattr(tf32x3_linear, "MIN_WIDTH", 25)  # K = 24 < 25 <= N = 40
    fp32(x)
    assert kernel_calls == [(4, 24)]


def test_off_unless_the_model_or_force_asks(kit, kernel_calls):
    _linear(6)(torch.randn(2, 24))
    assert kernel_calls == []


def test_cpu_tensors_take_ofs_path_without_the_interpreter(
    kit, kernel_calls, monkeypatch, device_fallback_messages
):
    module, x = _linear(7), torch.randn(3, 24)
    expected = module(x)
    activate(force=[NAME])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(module(x), expected) and kernel_calls == []
    said = device_fallback_messages()
    assert len(said) == 1 and NAME in said[0]


def test_a_training_step_keeps_its_losses(kit, kernel_calls):
    """The tiny model's training step with the key on: OF3's fp32 diffusion GEMMs
    take the kit's linear; loss and gradient norm as with it off, to fp32 rounding."""
    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    results = []
    for on in (False, True):
        update = {"settings": {"memory": {"train": {FLAG: on}}}}
        harness = TrainingStepHarness(
            "tiny", "stock", "cpu", num_recycles=1, update=update
        )
        torch.manual_seed(0)
        result = harness.step(random_training_batch(24, 8, 2, harness.device))
        results.append((result.loss["loss"], result.grad_norm, len(kernel_calls)))
    (loss_off, norm_off, calls_off), (loss_on, norm_on, calls_on) = results
    assert calls_off == 0 and calls_on >= 50, results
    assert loss_on == pytest.approx(loss_off, rel=1e-4)
    assert norm_on == pytest.approx(norm_off, rel=1e-4)
