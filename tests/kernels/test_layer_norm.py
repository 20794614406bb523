"""The 16-bit LayerNorm kernels against an fp64 oracle and against OF3's LayerNorm.

Rule (as for the other kernels): the largest error against the fp64 reference may be
at most twice that of OF3's own 16-bit path (``layer_norm_reference``: fp32 math on
an fp32 copy, the result cast back) plus a small floor, for the output and every
gradient. On CPU the kernels run under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from of3_megafold.kernels.layer_norm import function, layer_norm, layer_norm_reference

FLOOR = {torch.bfloat16: 2e-3, torch.float16: 1e-3}


def _inputs(shape, dtype, device, affine, seed):
    gen = torch.Generator().manual_seed(seed)
    c = shape[-1]
    x = (torch.randn(*shape, generator=gen) * 3 + 1).to(device=device, dtype=dtype)
    weight = bias = None
    if affine in ("both", "weight"):
        weight = (torch.randn(c, generator=gen) + 1).to(device)
    if affine == "both":
        bias = torch.randn(c, generator=gen).to(device)
    dy = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    return x, weight, bias, dy


def _outputs(fn, x, weight, bias, dy):
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    it = iter(leaves)
    args = [next(it) if t is not None else None for t in (x, weight, bias)]
    y = fn(*args, 1e-5)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


def _oracle(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _check(x, weight, bias, dy):
    """The kernel's output and gradients against fp64, within 2x OF3's error."""
    got = _outputs(layer_norm, x, weight, bias, dy)
    of3 = _outputs(layer_norm_reference, x, weight, bias, dy)
    want = _outputs(
        _oracle,
        x.double(),
        weight.double() if weight is not None else None,
        bias.double() if bias is not None else None,
        dy.double(),
    )
    names = ["y", "dx", "dweight", "dbias"]
    for name, g, o, w in zip(names, got, of3, want, strict=False):
        assert g.dtype == o.dtype and g.shape == o.shape, name
        err = (g.double() - w).abs().max().item()
        err_of3 = (o.double() - w).abs().max().item()
        allowed = 2 * err_of3 + FLOOR[x.dtype] * max(w.abs().max().item(), 1.0)
        assert err <= allowed, (name, err, err_of3, allowed)


@pytest.mark.parametrize(
    ("shape", "dtype", "affine"),
    [
        ((37, 24), torch.bfloat16, "both"),
        ((3, 5, 128), torch.float16, "weight"),
        ((50, 384), torch.bfloat16, "none"),
        ((301, 128), torch.bfloat16, "both"),  # several backward programs, a tail
        ((2, 7, 16), torch.float16, "both"),
        ((1, 33), torch.bfloat16, "both"),
    ],
    ids=str,
)
def test_matches_fp64_reference(shape, dtype, affine, device):
    _check(*_inputs(shape, dtype, device, affine, seed=sum(shape)))


def test_backward_is_reproducible(device):
    x, weight, bias, dy = _inputs((301, 128), torch.bfloat16, device, "both", seed=3)
    first = _outputs(layer_norm, x, weight, bias, dy)
    second = _outputs(layer_norm, x, weight, bias, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_only_requested_gradients(device):
    """Parameters that need no gradient get none (and with none needed the kernel
    skips the partial sums)."""
    x, weight, bias, dy = _inputs((9, 24), torch.bfloat16, device, "both", seed=4)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(layer_norm(x, weight, bias, 1e-5), (x,), dy)
    weight.requires_grad_()
    dx2, dw = torch.autograd.grad(layer_norm(x, weight, bias, 1e-5), (x, weight), dy)
    assert torch.equal(dx, dx2) and dw.shape == weight.shape


def test_rejects_what_it_does_not_take(device):
    with pytest.raises(ValueError, match="bf16/fp16"):
        layer_norm(torch.randn(4, 8, device=device))
    with pytest.raises(ValueError, match="bf16/fp16"):
        layer_norm(torch.randn(2, function.MAX_CHANNELS + 1, device=device).bfloat16())
    with pytest.raises(ValueError, match="bf16/fp16"):
        layer_norm(torch.empty(0, 8, device=device).bfloat16())
    with pytest.raises(ValueError, match="weight must be"):
        layer_norm(torch.randn(4, 8, device=device).bfloat16(),
                   torch.ones(7, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c", [128, 384, 768])
def test_gpu_production_shapes(dtype, c, device):
    rows = {128: (1, 384, 384), 384: (1, 768), 768: (1, 48, 384)}[c]
    _check(*_inputs((*rows, c), dtype, device, "both", seed=c))
