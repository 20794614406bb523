"""The 3xTF32 linear against an fp64 oracle, and its split kernel bit for bit.

Rule (as for the other kernels): the largest error against the fp64 reference may be
at most twice that of torch's own fp32 ``linear`` plus a small floor, for the output
and every gradient. On CPU the split kernel runs under the Triton interpreter and the
GEMMs in fp32; on the GPU in TF32, where the rule is what 3xTF32 must earn (plain
TF32 misses it by orders of magnitude: ``test_gpu_production_shapes``).
``test_emulated_tensor_cores_meet_the_rule`` applies the rule to the GPU's
arithmetic on the CPU: every GEMM operand truncated to TF32 as the tensor cores
read it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from of3_megafold.kernels.tf32x3_linear import function as tf32x3
from of3_megafold.kernels.tf32x3_linear import (
    split_tf32,
    split_tf32_reference,
    tf32x3_linear,
    tf32x3_linear_reference,
)

FLOOR = 1e-6


def _inputs(shape, n, bias, device, seed):
    gen = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
    b = torch.randn(n, generator=gen).to(device) if bias else None
    dy = torch.randn(*shape[:-1], n, generator=gen).to(device)
    return x, weight, b, dy


def _outputs(fn, x, weight, bias, dy):
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    it = iter(leaves)
    args = [next(it) if t is not None else None for t in (x, weight, bias)]
    y = fn(*args)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


def _errors(fn, x, weight, bias, dy):
    """Largest error of ``fn``'s output and gradients against fp64, with torch's
    fp32 ``linear``'s and the allowed one, per output."""
    got = _outputs(fn, x, weight, bias, dy)
    torch_fp32 = _outputs(F.linear, x, weight, bias, dy)
    want = _outputs(tf32x3_linear_reference, x, weight, bias, dy.double())
    rows = []
    for g, t, w in zip(got, torch_fp32, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        err = (g.double() - w).abs().max().item()
        err_torch = (t.double() - w).abs().max().item()
        rows.append((err, err_torch, 2 * err_torch + FLOOR * w.abs().max().item()))
    return rows


@pytest.mark.parametrize(
    ("shape", "n", "bias"),
    [
        ((37, 70), 33, True),
        ((3, 5, 128), 64, False),
        ((1, 1), 1, True),
        ((2, 17, 24), 129, True),  # the split's grid: 4896 elements, one block past
        ((4099, 3), 5, True),
    ],
    ids=str,
)
def test_matches_fp64_reference(shape, n, bias, device):
    for name, (err, err_torch, allowed) in zip(
        ("y", "dx", "dweight", "dbias"),
        _errors(tf32x3_linear, *_inputs(shape, n, bias, device, seed=sum(shape))),
        strict=False,
    ):
        assert err <= allowed, (name, err, err_torch, allowed)


@pytest.mark.parametrize("numel", [1, 7, 4096, 4097, 3 * 4096 + 5])
def test_split_is_the_reference_bit_for_bit(numel, device):
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.logspace(-30, 30, numel)
    x[: min(numel, 4)] = torch.tensor([0.0, -0.0, 3.0e38, 1.0 + 2**-11])[:numel]
    hi, lo = split_tf32(x.to(device))
    want_hi, want_lo = split_tf32_reference(x)
    assert torch.equal(hi.cpu().view(torch.int32), want_hi.view(torch.int32))
    assert torch.equal(lo.cpu().view(torch.int32), want_lo.view(torch.int32))
    assert torch.equal(want_hi + want_lo, x)
    assert not (want_hi.view(torch.int32) & ~tf32x3.TF32_MASK).any()
    assert (want_lo.abs() <= x.abs() * 2**-11).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_split_of_special_values(device):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 2**-149, -(2**-126)])
    hi, lo = split_tf32(x.to(device))
    assert hi[:2].cpu().tolist() == [float("inf"), -float("inf")]
    assert lo[:3].isnan().all() and (hi[3:] + lo[3:]).cpu().equal(x[3:])


def _tensor_core_mm(a, b):
    """``a @ b`` as a TF32 tensor core computes it: operands truncated to TF32
    (their low 13 bits ignored), exact products, fp32 accumulation (emulated by
    an fp64 sum rounded to fp32, which errs on the accurate side by at most the
    accumulation's own fp32 error, already in torch's)."""

    def tf32(t):
        return (t.contiguous().view(torch.int32) & tf32x3.TF32_MASK).view(torch.float32)

    return (tf32(a).double() @ tf32(b).double()).float()


def test_emulated_tensor_cores_meet_the_rule(monkeypatch):
    """On the GPU each of the three GEMMs reads its operands in TF32: the ``lo``
    parts lose their low bits there. With that arithmetic emulated, the output and
    every gradient still meet the rule at OF3's diffusion width (K = 768), while
    one plain TF32 GEMM does not."""

    def mm(a, b):
        return _tensor_core_mm(a, b)

    def addmm(c, a, b):
        return c + _tensor_core_mm(a, b)

    class Out(torch.Tensor):
        def addmm_(self, a, b):
            return self.add_(_tensor_core_mm(a, b))

    monkeypatch.setattr(tf32x3.torch, "mm", lambda a, b: mm(a, b).as_subclass(Out))
    monkeypatch.setattr(
        tf32x3.torch, "addmm", lambda c, a, b: addmm(c, a, b).as_subclass(Out)
    )
    inputs = _inputs((2, 96, 768), 768, True, "cpu", seed=11)
    for name, (err, err_torch, allowed) in zip(
        ("y", "dx", "dweight", "dbias"), _errors(tf32x3_linear, *inputs), strict=False
    ):
        assert err <= allowed, (name, err, err_torch, allowed)
    x, weight, bias, _ = inputs
    tf32_err = (
        (
            (_tensor_core_mm(x.reshape(-1, 768), weight.t()) + bias).double()
            - tf32x3_linear_reference(x, weight, bias).reshape(-1, 768)
        )
        .abs()
        .max()
        .item()
    )
    assert tf32_err > 20 * _errors(tf32x3_linear, *inputs)[0][2], tf32_err


def test_only_requested_gradients(device):
    x, weight, bias, dy = _inputs((9, 24), 16, True, device, seed=4)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(tf32x3_linear(x, weight, bias), (x,), dy)
    weight.requires_grad_()
    dx2, dw = torch.autograd.grad(tf32x3_linear(x, weight, bias), (x, weight), dy)
    assert torch.equal(dx, dx2) and dw.shape == weight.shape


def test_rejects_what_it_does_not_take(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match="bfloat16, not fp32"):
        tf32x3_linear(x.bfloat16(), torch.randn(3, 8, device=device))
    with pytest.raises(TypeError, match="weight is torch.float64"):
        tf32x3_linear(x, torch.randn(3, 8, device=device, dtype=torch.float64))
    with pytest.raises(TypeError, match="fp32 tensors"):
        split_tf32(x.half())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [
        ((48, 384), 768, 768),  # the diffusion transformer at 384 tokens
        ((48, 384), 768, 1536),  # its transition
        ((48, 2944), 128, 128),  # the atom transformer
    ],
    ids=str,
)
def test_gpu_production_shapes(rows, k, n, device):
    inputs = _inputs((*rows, k), n, True, device, seed=k + n)
    for name, (err, err_torch, allowed) in zip(
        ("y", "dx", "dweight", "dbias"), _errors(tf32x3_linear, *inputs), strict=False
    ):
        assert err <= allowed, (name, err, err_torch, allowed)
    x, weight, bias, _ = inputs
    want = tf32x3_linear_reference(x, weight, bias)
    with tf32x3.cuda_tf32(True):
        tf32_err = (F.linear(x, weight, bias).double() - want).abs().max().item()
    assert tf32_err > 20 * (tf32x3_linear(x, weight, bias).double() - want).abs().max()
