"""What the kernels compute, in torch: OF3's ``LayerNorm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """OF3's ``LayerNorm.forward`` over the last dim: a bf16/fp16 ``x`` is
    normalised in fp32 (input, statistics and affine parameters upcast) and the
    result cast back to its dtype; other dtypes (fp32, the fp64 oracles) as they
    are."""
    if x.dtype in (torch.bfloat16, torch.float16):
        out = F.layer_norm(
            x.float(),
            x.shape[-1:],
            weight.float() if weight is not None else None,
            bias.float() if bias is not None else None,
            eps,
        )
        return out.to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
