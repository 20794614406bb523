"""Launcher, autograd function and functional API of the 3xTF32 linear.

An fp32 GEMM on a GPU with tensor cores runs on its CUDA cores unless TF32 is
allowed, and TF32 keeps 10 of fp32's 23 mantissa bits. 3xTF32 keeps fp32's accuracy
on the tensor cores: with ``a = a_hi + a_lo`` and ``b = b_hi + b_lo``, ``a_hi``
exactly TF32 and ``a_lo`` the rest (:func:`split_tf32`),

    a @ b  ~=  a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi

in three TF32 GEMMs accumulated in fp32 (cuBLAS ``addmm``, smallest terms first).
``a_hi`` is ``a`` rounded to nearest, so ``|a_lo| <= 2^-11 |a|``: the dropped
``a_lo @ b_lo`` is at most 2^-22 of ``|a| @ |b|`` and the tensor cores' TF32
rounding of the ``lo`` parts about 2^-21, against 2^-24 for each of fp32's
roundings in its sum of ``K`` terms. The tests hold the result to the tolerance of
torch's fp32 ``linear`` against an fp64 oracle. The identity is CUTLASS's
"3xTF32" and Triton's ``input_precision="tf32x3"`` (which the EvoFlash kernels use),
applied here at the GEMM level, so cuBLAS's tuned TF32 kernels do the work; one
Triton kernel splits an operand in a single pass.

On an H200 TF32 tensor cores are ~7x fp32 CUDA cores (dense), so three TF32 GEMMs
plus the splits' memory traffic beat one fp32 GEMM once the GEMM is large enough
to be bound by arithmetic (the extension's ``MIN_MNK``).

Backward: ``dx = g @ w`` and ``dw = g.T @ x``, each as three TF32 GEMMs of the
splits (``x``'s split recomputed, not saved); ``db = g.sum(0)``.
"""

from __future__ import annotations

import torch

from of3_megafold.kernels.backend import cdiv, cuda_tf32, on_device
from of3_megafold.kernels.tf32x3_linear._split import _split_tf32_kernel
from of3_megafold.kernels.tf32x3_linear.reference import TF32_HALF, TF32_MASK

SPLIT_BLOCK = 4096


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of an fp32 tensor in one kernel pass (what
    :func:`~.reference.split_tf32_reference` computes).

    Args:
        x: fp32, any shape, on a device the kernels run on (``backend.runs_on``).

    Returns:
        ``hi`` and ``lo``, contiguous, ``x``'s shape: ``hi`` exactly TF32, ``hi +
        lo == x``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"split_tf32 takes fp32 tensors, not {x.dtype}")
    x = x.contiguous()
    parts = torch.empty((2, *x.shape), dtype=x.dtype, device=x.device)
    n = x.numel()
    if n:
        with on_device(x):
            _split_tf32_kernel[(cdiv(n, SPLIT_BLOCK),)](
                x,
                parts[0],
                parts[1],
                n,
                HALF=TF32_HALF,
                MASK=TF32_MASK,
                BLOCK=SPLIT_BLOCK,
            )
    return parts[0], parts[1]


def _mm_3xtf32(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bias + a @ b`` from the splits ``a = (a_hi, a_lo)`` ``[M, K]`` and ``b =
    (b_hi, b_lo)`` ``[K, N]`` (any strides): three TF32 GEMMs into one fp32
    ``[M, N]``, the small terms first."""
    (a_hi, a_lo), (b_hi, b_lo) = a, b
    with cuda_tf32(True):
        out = torch.mm(a_lo, b_hi) if bias is None else torch.addmm(bias, a_lo, b_hi)
        out.addmm_(a_hi, b_lo)
        out.addmm_(a_hi, b_hi)
    return out


class Tf32x3LinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias`` in 3xTF32 for ``x`` ``[M, K]``, forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w_hi, w_lo = split_tf32(weight)
        with torch.autocast(x.device.type, enabled=False):
            out = _mm_3xtf32(split_tf32(x), (w_hi.t(), w_lo.t()), bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = dw = db = None
        with torch.autocast(grad.device.type, enabled=False):
            g = split_tf32(grad.float())
            if need_x:
                dx = _mm_3xtf32(g, split_tf32(weight))
            if need_w:
                dw = _mm_3xtf32((g[0].t(), g[1].t()), split_tf32(x))
            if need_b and ctx.has_bias:
                db = grad.float().sum(0)
        return dx, dw, db


def tf32x3_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 tensors at fp32 accuracy, in TF32
    GEMMs (3xTF32), with gradients for every input.

    Args:
        x: ``[*, K]`` fp32.
        weight: ``[N, K]`` fp32.
        bias: ``[N]`` fp32 or None.

    Returns:
        ``[*, N]`` fp32.
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"tf32x3_linear: {name} is {t.dtype}, not fp32")
    out = Tf32x3LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
