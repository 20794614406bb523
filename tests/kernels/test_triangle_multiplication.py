"""The fused triangle multiplicative update against an fp64 oracle.

Rule (as for the other kernels): the largest error against the fp64 reference may be
at most twice that of OF3's math in the same dtype
(``triangle_multiplication_reference`` without ``upcast``) plus a small floor
relative to the tensor's scale, for the output and the gradients of the input and of
every parameter. On CPU the kernels run under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from of3_megafold.kernels.triangle_multiplication import (
    function,
    triangle_multiplication,
    triangle_multiplication_reference,
)

FLOOR = {torch.bfloat16: 4e-3, torch.float16: 2e-3}
NAMES = ["out", "dz", "dln_in_w", "dln_in_b", "dw_a_p", "dw_a_g", "dw_b_p", "dw_b_g",
         "dw_g", "dln_out_w", "dln_out_b", "dw_z"]


def _inputs(lead, n, cz, ch, dtype, device, masked, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device)

    z = randn(*lead, n, n, cz, scale=2.0, shift=0.5).to(dtype)
    mask = (randn(*lead, n, n) > -0.8).float() if masked else None
    params = [
        randn(cz, scale=0.3, shift=1.0), randn(cz, scale=0.3),
        *(randn(ch, cz, scale=cz**-0.5) for _ in range(4)),
        randn(cz, cz, scale=cz**-0.5),
        randn(ch, scale=0.3, shift=1.0), randn(ch, scale=0.3),
        randn(cz, ch, scale=ch**-0.5),
    ]
    dout = randn(*lead, n, n, cz).to(dtype)
    return z, mask, params, dout


def _outputs(fn, z, mask, params, dout, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (z, *params)]
    out = fn(leaves[0], mask, *leaves[1:], **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def _check(lead, n, cz, ch, dtype, device, outgoing, masked):
    z, mask, params, dout = _inputs(lead, n, cz, ch, dtype, device, masked,
                                    seed=n + cz + ch)
    got = _outputs(triangle_multiplication, z, mask, params, dout, outgoing=outgoing)
    of3 = _outputs(triangle_multiplication_reference, z, mask, params, dout,
                   outgoing=outgoing)
    want = _outputs(triangle_multiplication_reference, z.double(), mask,
                    [p.double() for p in params], dout.double(), outgoing=outgoing,
                    upcast=True)
    for name, g, o, w in zip(NAMES, got, of3, want, strict=True):
        assert g.dtype == o.dtype and g.shape == w.shape, name
        err = (g.double() - w).abs().max().item()
        err_of3 = (o.double() - w).abs().max().item()
        allowed = 2 * err_of3 + FLOOR[dtype] * w.abs().max().item()
        assert err <= allowed, (name, err, err_of3, allowed)


@pytest.mark.parametrize(
    ("lead", "n", "cz", "ch", "dtype", "outgoing", "masked"),
    [
        ((1,), 17, 16, 16, torch.bfloat16, True, True),
        ((1,), 17, 16, 16, torch.bfloat16, False, True),
        ((2,), 33, 32, 16, torch.bfloat16, False, False),
        ((1, 2), 9, 24, 20, torch.float16, True, True),  # template dims, odd widths
        ((1,), 1, 16, 16, torch.bfloat16, True, True),
    ],
    ids=str,
)
def test_matches_fp64_reference(lead, n, cz, ch, dtype, outgoing, masked, device):
    _check(lead, n, cz, ch, dtype, device, outgoing, masked)


@pytest.mark.gpu
@pytest.mark.parametrize("outgoing", [True, False])
@pytest.mark.parametrize("n", [129, 300])
def test_gpu_pair_stack_shapes(n, outgoing):
    _check((1,), n, 128, 128, torch.bfloat16, "cuda", outgoing, masked=True)


def test_keeps_z_and_the_product_only(device):
    """What the forward keeps for the backward: the input, the product ``p`` (each
    ``[*, N, N, C]``-sized), the stacked weights and per-row statistics; OF3's math
    keeps many times that."""
    z, mask, params, _ = _inputs((1,), 48, 32, 32, torch.bfloat16, device, True, 3)
    slice_bytes = z.numel() * z.element_size()

    def kept_bytes(fn):
        kept = []

        def pack(t):
            kept.append(t)
            return t

        leaves = [t.detach().requires_grad_() for t in (z, *params)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(leaves[0], mask, *leaves[1:])
        unique = {t.untyped_storage().data_ptr(): t for t in kept}
        return sum(t.untyped_storage().nbytes() for t in unique.values())

    kit = kept_bytes(triangle_multiplication)
    of3 = kept_bytes(triangle_multiplication_reference)
    assert kit <= 2.5 * slice_bytes, (kit, slice_bytes)
    assert of3 >= 3 * kit, (of3, kit)


def test_unsupported_inputs_take_the_reference():
    z, mask, params, _ = _inputs((1,), 9, 16, 16, torch.float32, "cpu", True, 4)
    assert not function.supports(z, 16)[0]
    torch.testing.assert_close(
        triangle_multiplication(z, mask, *params),
        triangle_multiplication_reference(z, mask, *params),
        rtol=0, atol=0,
    )
    wide = torch.zeros(1, 3, 3, 136, dtype=torch.bfloat16)
    assert function.supports(wide, 16)[1] == "channels 136/16 > 128"
