"""Launchers, autograd function and functional API of the LayerNorm kernels.

``layer_norm(x, weight, bias, eps)`` equals OF3's ``LayerNorm.forward`` for bf16/fp16
``x`` (statistics and affine in fp32, the result in ``x``'s dtype), but reads and
writes ``x``'s dtype only. OF3 upcasts the whole input to an fp32 copy, normalises it
into a second fp32 tensor and casts that back, and its backward makes the same round
trip: at the pair representation's size that is most of a LayerNorm's cost
(docs/benchmarks.md, "Attention modules"). The forward keeps ``x`` and the per-row
fp32 mean and rstd; the backward recomputes the normalised rows.
"""

from __future__ import annotations

import torch

from of3_megafold.kernels._launch import TunedKernel
from of3_megafold.kernels.backend import (
    cdiv,
    interpreter_enabled,
    multiprocessors,
    next_power_of_2,
    runs_on,
)
from of3_megafold.kernels.layer_norm._kernels import (
    _layer_norm_bwd_kernel,
    _layer_norm_fwd_kernel,
)

# Widest row the kernels hold in registers (one row per thread group; OF3's
# LayerNorms are 16-768 channels wide).
MAX_CHANNELS = 4096
DTYPES = (torch.bfloat16, torch.float16)

_fwd = TunedKernel(_layer_norm_fwd_kernel)
_bwd = TunedKernel(_layer_norm_bwd_kernel)


def _blocks(c: int, elements: int = 4096) -> tuple[int, int]:
    """``(BLOCK_C, BLOCK_R)``: about ``elements`` elements per program step."""
    block_c = max(16, next_power_of_2(c))
    return block_c, max(1, min(64, elements // block_c))


# The forward runs one program per row block of 4096 elements, 4 warps. The
# backward's programs are long-lived (each owns a run of rows and one dw/db partial):
# narrow ones, one warp per 2048-element step, 32 of them per SM. On the H200 at the
# pair representation's [N^2, 128] bf16 that is within 2% of the fastest BLOCK_R x
# warps x programs per SM, 2.2x faster than 4 warps x 4 programs per SM (0.14 against
# 0.30 ms at N=768; tools/gpu_sweep_layer_norm.py). The partials cost
# 2 x programs x C fp32 (4.3 MB at C=128).
FWD_WARPS = 4
BWD_ELEMENTS = 2048
BWD_PROGRAMS_PER_SM = 32


def _bwd_blocks(c: int) -> tuple[int, int, int]:
    """Backward ``(BLOCK_C, BLOCK_R, num_warps)``: a warp per 2048 elements."""
    block_c, block_r = _blocks(c, BWD_ELEMENTS)
    return block_c, block_r, max(1, block_c * block_r // BWD_ELEMENTS)


def _programs(device_index: int | None) -> int:
    """Backward programs: ``BWD_PROGRAMS_PER_SM`` per SM (each keeps one fp32 partial
    of dw and db); 4 under the interpreter, so that small tests split the rows."""
    if interpreter_enabled() or not torch.cuda.is_available():
        return 4
    return BWD_PROGRAMS_PER_SM * multiprocessors(device_index)


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`layer_norm` takes ``x``: 16-bit, not empty, at most
    ``MAX_CHANNELS`` wide, on a device the kernels run on."""
    return (x.dtype in DTYPES and x.numel() > 0 and x.shape[-1] <= MAX_CHANNELS
            and runs_on(x))


def layer_norm_fwd(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward launcher: ``x2`` ``[R, C]`` contiguous, 16-bit; returns ``y`` (``x2``'s
    dtype and shape) and the per-row fp32 ``mean`` and ``rstd`` (``[R]``)."""
    rows, c = x2.shape
    y = torch.empty_like(x2)
    mean = torch.empty(rows, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    block_c, block_r = _blocks(c)
    _fwd[(cdiv(rows, block_r),)](
        x2, weight if weight is not None else x2, bias if bias is not None else x2,
        y, mean, rstd, rows, c, eps,
        HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=FWD_WARPS,
    )
    return y, mean, rstd


def layer_norm_bwd(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dwb: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward launcher: ``dy2`` and ``x2`` ``[R, C]`` contiguous; returns ``dx``
    (``x2``'s dtype) and, with ``need_dwb``, the fp32 ``[C]`` gradients of the
    weight and bias (per-program partials summed in a fixed order), else ``None``."""
    rows, c = x2.shape
    dx = torch.empty_like(x2)
    block_c, block_r, warps = _bwd_blocks(c)
    programs = max(1, min(_programs(x2.device.index), cdiv(rows, block_r)))
    per_program = cdiv(rows, programs)
    programs = cdiv(rows, per_program)
    part = (torch.empty((2, programs, c), dtype=torch.float32, device=x2.device)
            if need_dwb else None)
    _bwd[(programs,)](
        x2, weight if weight is not None else x2, dy2, mean, rstd, dx,
        part[0] if part is not None else x2, part[1] if part is not None else x2,
        rows, c, per_program,
        HAS_W=weight is not None, NEED_DWB=part is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )
    if part is None:
        return dx, None, None
    sums = part.sum(dim=1)  # over programs, in a fixed order
    return dx, sums[0], sums[1]


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


class LayerNormFunction(torch.autograd.Function):
    """Autograd function behind :func:`layer_norm` (same arguments)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = _rows(x)
        y, mean, rstd = layer_norm_fwd(x2, weight, bias, eps)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        need_w = weight is not None and ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dx, dw, db = layer_norm_bwd(
            _rows(dy), x2, weight, mean, rstd, need_dwb=need_w or need_b
        )
        dw = dw.to(weight.dtype) if need_w else None
        db = db.to(bias.dtype) if need_b else None
        return dx.view(ctx.shape), dw, db, None


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dim of a 16-bit ``x`` with fp32 statistics.

    Args:
        x: ``[*, C]`` bf16 or fp16, ``C <= MAX_CHANNELS``.
        weight, bias: optional ``[C]`` affine parameters (any float dtype; used in
            fp32; their gradients come back in their dtype).
        eps: added to the variance.

    Returns:
        ``[*, C]`` in ``x``'s dtype: OF3's ``LayerNorm`` for 16-bit inputs (see
        :func:`layer_norm_reference`).
    """
    if not supports(x):
        raise ValueError(
            f"layer_norm takes non-empty bf16/fp16 tensors of at most {MAX_CHANNELS} "
            f"channels on CUDA (or the CPU under TRITON_INTERPRET=1); got {x.dtype}, "
            f"{tuple(x.shape)} on {x.device}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != x.shape[-1:]:
            raise ValueError(f"{name} must be [{x.shape[-1]}], got {tuple(p.shape)}")
    return LayerNormFunction.apply(x, weight, bias, eps)
