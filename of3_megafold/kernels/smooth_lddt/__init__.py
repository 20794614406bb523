"""Smooth lDDT loss (AF3 Algorithm 27, OpenFold3's ``smooth_lddt_loss``) kernels.

``smooth_lddt_reference`` is pure torch; the Triton backends (``smooth_lddt_fused``,
``smooth_lddt_ball_query``, ``ball_query``) are imported on first use so that the
reference stays usable where Triton is not installed.
"""

from .reference import smooth_lddt_reference

_KERNEL_EXPORTS = {
    "smooth_lddt_fused": ".function",
    "smooth_lddt_ball_query": ".function",
    "SmoothLDDTFusedFunction": ".function",
    "SmoothLDDTBallQueryFunction": ".function",
    "ball_query": "._ball_query",
}

__all__ = ["smooth_lddt_reference", *_KERNEL_EXPORTS]


def __getattr__(name: str):
    if name in _KERNEL_EXPORTS:
        import importlib

        module = importlib.import_module(_KERNEL_EXPORTS[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
