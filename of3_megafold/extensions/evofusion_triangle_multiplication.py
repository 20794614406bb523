"""EvoFusion in OF3's triangle multiplications: LayerNorm-fed projections, gates and
the output LayerNorm + projection + gate fused around the two batched GEMMs.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_evofusion_triangle_
multiplication`` (default false). With a key on, ``TriangleMultiplicativeUpdate``
(``TriangleMultiplicationOutgoing``/``Incoming`` in the pairformer, MSA module,
template stack and confidence pairformer) runs the fused kernels of
:mod:`of3_megafold.kernels.triangle_multiplication` on 16-bit pair activations:
the input LayerNorm, the five projections as one GEMM, the gates written straight
into the batched GEMM's channel-major layout, and the output LayerNorm, projection
and gate in one pass. The forward keeps ``z`` and the
product; the backward recomputes the rest. Under sequence parallelism
:func:`sharded_update` runs the same kernels on a rank's shard of ``z``. Parameter
names are unchanged, so OF3 checkpoints load as they are.

OF3's own path stays for fp32 pair activations (outside autocast), Linears with a
bias or LayerNorms without an affine (OF3's configs have neither), and the chunked
in-place inference path (``inplace_safe``, which OF3 takes to bound memory at
inference). The key is exclusive with OF3's ``use_cueq_triangle_kernels`` in the
same section, which routes the same module to cuEquivariance.
"""

from __future__ import annotations

from typing import Any

from of3_megafold import registry
from of3_megafold.kernels.backend import runs_on, triton_backend

NAME = "evofusion_triangle_multiplication"
FLAG = "use_evofusion_triangle_multiplication"
OF3_KERNEL_FLAG = "use_cueq_triangle_kernels"

_BIAS_FREE = ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g",
              "linear_z")


def _fused(
    module: Any, z, inplace_safe: bool, use_cueq: bool, shard: bool = False
) -> bool:
    """Whether this call takes the fused kernels (see the module docstring)."""
    if inplace_safe or use_cueq or not registry.module_enabled(module, NAME, FLAG):
        return False
    ln_in, ln_out = module.layer_norm_in, module.layer_norm_out
    if ln_in.eps != ln_out.eps or any(
        t is None for t in (ln_in.weight, ln_in.bias, ln_out.weight, ln_out.bias)
    ):
        return False
    if any(getattr(module, name).bias is not None for name in _BIAS_FREE):
        return False
    from of3_megafold.kernels.triangle_multiplication import function as kernels

    ok, _ = kernels.supports(z, module.c_hidden, shard=shard)
    if not ok and z.dtype in kernels.DTYPES and not runs_on(z):
        registry.log_device_fallback(NAME, z.device.type)
    return ok


def _run_fused(module: Any, z, mask, exchange=None):
    from of3_megafold.kernels.triangle_multiplication.function import (
        fused_triangle_multiplication,
    )

    ln_in, ln_out = module.layer_norm_in, module.layer_norm_out
    return fused_triangle_multiplication(
        z, mask, ln_in.weight, ln_in.bias,
        module.linear_a_p.weight, module.linear_a_g.weight,
        module.linear_b_p.weight, module.linear_b_g.weight, module.linear_g.weight,
        ln_out.weight, ln_out.bias, module.linear_z.weight,
        outgoing=module._outgoing, eps=ln_in.eps, exchange=exchange,
    )


def _patch_forward(original):
    def forward(self, z, mask=None, inplace_safe=False,
                use_cueq_triangle_kernels=False, *args, **kwargs):
        if not _fused(self, z, inplace_safe, use_cueq_triangle_kernels):
            return original(self, z, mask, inplace_safe, use_cueq_triangle_kernels,
                            *args, **kwargs)
        return _run_fused(self, z, mask)

    return forward


def sharded_update(module: Any, z, mask, exchange):
    """The fused update of this rank's shard of ``z`` under sequence parallelism,
    or ``None`` where the module takes OF3's path (the key off, or a case
    :func:`_fused` refuses).

    Args:
        module: OF3's ``TriangleMultiplicationOutgoing`` / ``Incoming``.
        z: ``[*, N/P, N, C_z]`` (outgoing) or ``[*, N, N/P, C_z]`` (incoming).
        mask: the matching pair-mask shard, ``[*, N/P, N]`` or ``[*, N, N/P]``.
        exchange: the SP group's collectives (``parallel.comm.GroupExchange``).

    Returns:
        The update, shaped like ``z``, or ``None``.
    """
    if not _fused(module, z, False, False, shard=True):
        return None
    return _run_fused(module, z, mask, exchange)


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="fused triangle multiplication (LayerNorm + one projection GEMM + gates "
        "in the batched GEMM's layout + output LayerNorm/projection/gate); keeps the "
        "input and the product only; also on sequence parallelism's shards. "
        "Exclusive with OF3's use_cueq_triangle_kernels.",
        summary="Fused triangle multiplication: LayerNorm-fed projections as one "
        "GEMM, gates in the batched GEMM's layout, fused output; keeps z and the "
        "product only",
        requires=("triton",),
        device_check=triton_backend,
        patches=(
            registry.Patch(
                "openfold3.core.model.layers.triangular_multiplicative_update"
                ":TriangleMultiplicativeUpdate.forward",
                _patch_forward,
            ),
        ),
        exclusive_with=(OF3_KERNEL_FLAG,),
        exclusive_what="triangle multiplication",
    )
)
