"""What the kernels compute, in torch: the TF32 split and an fp32 ``linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TF32_MASK = -8192
"""``0xFFFFE000`` as an int32: an fp32's sign, exponent and the 10 mantissa bits
that TF32 keeps."""
TF32_HALF = 4096
"""Half a TF32 unit in the last place, in an fp32's bits: added before masking, it
rounds to nearest (ties away from zero) instead of truncating."""


def split_tf32_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of an fp32 tensor: ``hi`` is ``x`` rounded to TF32's 10
    mantissa bits (exactly representable in TF32) and ``lo = x - hi`` (exact in
    fp32, at most 2^-11 of ``|x|``), so ``hi + lo == x``. A NaN or infinite ``x``
    gives ``lo`` NaN (and the products NaN)."""
    hi = ((x.view(torch.int32) + TF32_HALF) & TF32_MASK).view(torch.float32)
    return hi, x - hi


def tf32x3_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    upcast: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``), in fp64 if ``upcast`` (the tests'
    oracle), else in the inputs' dtype."""
    if upcast:
        x, weight = x.double(), weight.double()
        bias = bias.double() if bias is not None else None
    return F.linear(x, weight, bias)
