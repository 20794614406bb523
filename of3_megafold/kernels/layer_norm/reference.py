"""What the kernels compute, in torch: OF3's ``LayerNorm`` for 16-bit inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``LayerNorm`` over the last dim in fp32 (input, statistics and affine
    parameters upcast), the result in ``x``'s dtype: OF3's
    ``LayerNorm.forward`` for bf16/fp16 inputs."""
    out = F.layer_norm(
        x.float(),
        x.shape[-1:],
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        eps,
    )
    return out.to(x.dtype)
