"""Fused SwiGLU transition (OF3's ``SwiGLUTransition``): LayerNorm -> SwiGLU ->
``linear_out`` -> mask, forward and backward in Triton without materialising the
``n*c``-wide hidden activations. See :mod:`.function` for the API."""

from of3_megafold.kernels.swiglu_transition.function import (
    SwiGLUTransitionFunction,
    compute_dtype,
    stack_ab,
    swiglu_mlp,
    swiglu_transition,
    swiglu_transition_bwd,
    swiglu_transition_fwd,
)
from of3_megafold.kernels.swiglu_transition.reference import (
    swiglu_transition_reference,
)

__all__ = [
    "SwiGLUTransitionFunction",
    "compute_dtype",
    "stack_ab",
    "swiglu_mlp",
    "swiglu_transition",
    "swiglu_transition_bwd",
    "swiglu_transition_fwd",
    "swiglu_transition_reference",
]
