"""Pure-torch SwiGLU transition: the test oracle and the fallback schedule.

It computes exactly what OpenFold3's ``SwiGLUTransition._transition`` computes
(``core/model/layers/transition.py``)::

    xn = LayerNorm(x)                  # statistics in fp32, result cast back to x.dtype
    h  = silu(xn @ w_a.T) * (xn @ w_b.T)
    y  = (h @ w_out.T) * mask[..., None]

with the weights in OF3's ``nn.Linear`` layout (``[out, in]``, no biases):
``swiglu.linear_a.weight`` and ``swiglu.linear_b.weight`` are ``[n*c, c]``,
``linear_out.weight`` is ``[c, n*c]``; ``layer_norm.weight`` / ``.bias`` are ``[c]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from of3_megafold.kernels.layer_norm.reference import layer_norm_reference


def swiglu_transition_reference(
    x: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    w_a: torch.Tensor,
    w_b: torch.Tensor,
    w_out: torch.Tensor,
    mask: torch.Tensor | None = None,
    eps: float = 1e-5,
    upcast: bool = False,
    normalize: bool = True,
) -> torch.Tensor:
    """SwiGLU transition in plain torch (differentiable through autograd).

    Args:
        x: ``[*, c]`` input.
        ln_weight, ln_bias: ``[c]`` LayerNorm scale and offset (``None``: that term
            is left out).
        w_a, w_b: ``[n*c, c]`` SwiGLU input projections (``swiglu.linear_a/b.weight``).
        w_out: ``[c, n*c]`` output projection (``linear_out.weight``).
        mask: ``[*]`` (``x.shape[:-1]``, or broadcastable to it) multiplier of the
            output rows; ``None`` for no mask.
        eps: LayerNorm epsilon.
        upcast: compute in fp32 (fp64 stays fp64) and cast the result back to
            ``x.dtype``; otherwise the matmuls run in the compute dtype (the
            autocast dtype inside ``torch.autocast``) as in OF3.
        normalize: ``False`` skips the LayerNorm: ``x`` is taken as already
            normalised (as after the AdaLN of OF3's ``ConditionedTransitionBlock``).

    Returns:
        ``[*, c]`` in ``x.dtype``. (OF3 multiplies by the mask in the mask's dtype,
        so a bf16 output times an fp32 mask becomes fp32 there; here the mask is cast
        to the output dtype first.)
    """
    out_dtype = x.dtype
    if upcast and x.dtype != torch.float64:
        x = x.float()
    dtype = x.dtype
    xn = layer_norm_reference(x, ln_weight, ln_bias, eps) if normalize else x
    h = F.silu(F.linear(xn, w_a.to(dtype))) * F.linear(xn, w_b.to(dtype))
    y = F.linear(h, w_out.to(dtype))
    if mask is not None:
        y = y * mask.to(dtype).unsqueeze(-1)
    return y.to(out_dtype)
