"""OF3's triangle multiplicative update for 16-bit pair activations: LayerNorm,
the five projections as one GEMM, gating written in the batched GEMM's layout, and
the output LayerNorm, projection and gate in one pass (see ``function``)."""

from .function import triangle_multiplication
from .reference import triangle_multiplication_reference

__all__ = ["triangle_multiplication", "triangle_multiplication_reference"]
