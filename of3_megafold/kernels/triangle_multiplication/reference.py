"""Pure-torch triangle multiplicative update: the oracle of the fused kernels and
their fallback.

OF3's ``TriangleMultiplicativeUpdate.forward`` (AF3 Algorithms 12 and 13), training
path, bias-free projections, written out:

    x = LN_in(z)
    a = mask * sigmoid(x W_ag^T) * (x W_ap^T)          [*, N, N, C_h]
    b = mask * sigmoid(x W_bg^T) * (x W_bp^T)
    outgoing: p_ijc = sum_k a_ikc b_jkc;  incoming: p_ijc = sum_k a_kic b_kjc
    out = (LN_out(p) W_z^T) * sigmoid(x W_g^T)          [*, N, N, C_z]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def triangle_multiplication_reference(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    ln_in_weight: torch.Tensor,
    ln_in_bias: torch.Tensor,
    w_a_p: torch.Tensor,
    w_a_g: torch.Tensor,
    w_b_p: torch.Tensor,
    w_b_g: torch.Tensor,
    w_g: torch.Tensor,
    ln_out_weight: torch.Tensor,
    ln_out_bias: torch.Tensor,
    w_z: torch.Tensor,
    outgoing: bool = True,
    eps: float = 1e-5,
    upcast: bool = False,
) -> torch.Tensor:
    """The triangle multiplicative update in torch (see the module docstring).

    Args:
        z: ``[*, N, N, C_z]``.
        mask: ``[*, N, N]`` (broadcastable) or ``None``.
        ln_in_weight, ln_in_bias: ``[C_z]``.
        w_a_p, w_a_g, w_b_p, w_b_g: ``[C_h, C_z]`` (``nn.Linear`` layout).
        w_g: ``[C_z, C_z]``; w_z: ``[C_z, C_h]``.
        ln_out_weight, ln_out_bias: ``[C_h]``.
        outgoing: AF3 Algorithm 12 (``True``) or 13.
        eps: both LayerNorms' epsilon.
        upcast: compute everything in fp64 (the tests' oracle).

    Returns:
        ``[*, N, N, C_z]``: in fp64 with ``upcast``, else in ``z``'s dtype with
        OF3's roundings (LayerNorm in fp32, products in ``z``'s dtype).
    """
    params = (ln_in_weight, ln_in_bias, w_a_p, w_a_g, w_b_p, w_b_g, w_g,
              ln_out_weight, ln_out_bias, w_z)
    dtype = torch.float64 if upcast else z.dtype
    z = z.to(dtype)
    (ln_in_weight, ln_in_bias, w_a_p, w_a_g, w_b_p, w_b_g, w_g, ln_out_weight,
     ln_out_bias, w_z) = (p.to(dtype) for p in params)

    def layer_norm(t, weight, bias):
        statistics_dtype = torch.float64 if upcast else torch.float32
        return F.layer_norm(
            t.to(statistics_dtype), t.shape[-1:], weight.to(statistics_dtype),
            bias.to(statistics_dtype), eps,
        ).to(dtype)

    m = (torch.ones_like(z[..., 0]) if mask is None else mask.to(dtype))
    m = m.expand(z.shape[:-1]).unsqueeze(-1)
    x = layer_norm(z, ln_in_weight, ln_in_bias)
    a = m * torch.sigmoid(F.linear(x, w_a_g)) * F.linear(x, w_a_p)
    b = m * torch.sigmoid(F.linear(x, w_b_g)) * F.linear(x, w_b_p)
    equation = "...ikc,...jkc->...ijc" if outgoing else "...kic,...kjc->...ijc"
    p = torch.einsum(equation, a, b)
    out = F.linear(layer_norm(p, ln_out_weight, ln_out_bias), w_z)
    return out * torch.sigmoid(F.linear(x, w_g))
