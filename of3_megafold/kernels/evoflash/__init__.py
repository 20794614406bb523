"""EvoFlash-3D: fused attention with a pair bias shared over S (OF3's triangle,
diffusion-transformer and single attention), forward and backward in Triton."""

from .function import EvoFlashAttentionFunction, evoflash_attention
from .projected import EvoFlashProjectedAttentionFunction, evoflash_attention_projected
from .reference import evoflash_attention_reference

__all__ = [
    "EvoFlashAttentionFunction",
    "EvoFlashProjectedAttentionFunction",
    "evoflash_attention",
    "evoflash_attention_projected",
    "evoflash_attention_reference",
]
