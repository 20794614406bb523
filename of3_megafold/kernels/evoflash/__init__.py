"""EvoFlash-3D: fused attention with a pair bias shared over S (OF3's triangle,
diffusion-transformer and single attention), forward and backward in Triton."""

from .function import (
    EvoFlashAttentionFunction,
    EvoFlashPackedAttentionFunction,
    evoflash_attention,
    evoflash_attention_packed,
)
from .reference import evoflash_attention_reference

__all__ = [
    "EvoFlashAttentionFunction",
    "EvoFlashPackedAttentionFunction",
    "evoflash_attention",
    "evoflash_attention_packed",
    "evoflash_attention_reference",
]
