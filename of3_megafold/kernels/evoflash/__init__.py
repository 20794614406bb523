"""EvoFlash-3D: fused attention with a pair bias shared over S (OF3's triangle,
diffusion-transformer and single attention), forward and backward in Triton."""

from .function import EvoFlashAttentionFunction, evoflash_attention
from .reference import evoflash_attention_reference

__all__ = [
    "EvoFlashAttentionFunction",
    "evoflash_attention",
    "evoflash_attention_reference",
]
