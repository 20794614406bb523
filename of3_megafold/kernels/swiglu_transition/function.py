"""Launchers, autograd function and functional API of the fused SwiGLU transition.

``swiglu_transition(x, ...)`` computes OF3's ``SwiGLUTransition._transition``
(``y = (silu(LN(x) w_a^T) * (LN(x) w_b^T)) w_out^T * mask``) in Triton kernels (one
forward, one or two backward; see ``_fwd.py`` and ``_bwd.py`` for the schedules)
and, for the weight gradients over many rows, two cuBLAS GEMMs per chunk of rows
(:data:`WEIGHT_GRAD_PATH`). The forward pass keeps only ``x`` and the fp32 per-row
LayerNorm mean and rstd; nothing ``n*c`` wide outlives the backward's chunk of rows
(at most :data:`HIDDEN_CHUNK_BYTES`).

``swiglu_mlp(x, ...)`` is the same core without the LayerNorm, for OF3's
``ConditionedTransitionBlock``: its AdaLN and its sigmoid output gate stay in torch
around the fused SwiGLU + ``linear_out`` (both are ``c``-wide and cheap; the
``n*c``-wide part is what the kernel keeps out of memory).
"""

from __future__ import annotations

import logging

import torch
import triton

from of3_megafold.kernels._launch import TunedKernel
from of3_megafold.kernels.backend import (
    cuda_tf32,
    interpreter_enabled,
    multiprocessors,
    runs_on,
)
from of3_megafold.kernels.swiglu_transition._bwd import (
    BWD_INPUT_CONFIGS,
    BWD_INPUT_PRUNE,
    BWD_WEIGHT_CONFIGS,
    BWD_WEIGHT_PRUNE,
    _swiglu_transition_bwd_input_kernel,
    _swiglu_transition_bwd_weight_kernel,
)
from of3_megafold.kernels.swiglu_transition._fwd import _swiglu_transition_fwd_kernel
from of3_megafold.kernels.swiglu_transition.reference import (
    swiglu_transition_reference,
)

logger = logging.getLogger(__name__)

# Launched through TunedKernel: after the first launch of a tuning key, a call skips
# the autotuner's per-launch host work and goes to the compiled kernel's launcher
# (DirectLaunch; the "gemm" backward launches the input kernel once per chunk of rows).
_fwd_kernel = TunedKernel(_swiglu_transition_fwd_kernel)
_bwd_input_kernel = TunedKernel(_swiglu_transition_bwd_input_kernel)
_bwd_weight_kernel = TunedKernel(_swiglu_transition_bwd_weight_kernel)

# Widest channel count the fused schedule takes: a program holds a [BLOCK_M, c] fp32
# accumulator plus the [BLOCK_M, c] normalised rows in registers, which stops
# fitting beyond c = 128 (c = 256 would need BLOCK_M = 32 and waste the tensor
# cores). OF3's wider transitions (single, c=384: N tokens; diffusion transformer,
# c=768: samples x N tokens) run on a few thousand to a few tens of thousands of
# rows, where cuBLAS GEMMs tiled over the output spread well over the GPU, so they
# take the torch path.
MAX_FUSED_CHANNELS = 128

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_c(c: int) -> int:
    # tl.dot needs every dimension >= 16.
    return max(16, triton.next_power_of_2(c))


def _num_sms(device_index: int | None) -> int:
    if interpreter_enabled() or not torch.cuda.is_available():
        return 4  # > 1, so CPU tests exercise the split reduction
    return multiprocessors(device_index)


def _kernel_flags(compute_dtype: torch.dtype) -> dict:
    """Precision flags shared by the three kernels."""
    interpret = interpreter_enabled()
    if compute_dtype == torch.float32:
        # IEEE fp32 dots, also when TF32 is enabled globally: TF32 drifts diffusion
        # roll-outs (~1 A), and Triton 3.6 failed to compile the TF32 weight-gradient
        # kernel on an H200 (c=32, OF3's test_of3_model with the extension forced).
        precision = "ieee"
    else:
        precision = "ieee" if interpret else None
    return {
        "INPUT_PRECISION": precision,
        "FAST_SIGMOID": compute_dtype != torch.float32 and not interpret,
        "INTERPRETER": interpret,
    }


def _candidate_configs(configs, prune, w_ab: torch.Tensor) -> list[triton.Config]:
    """The configs the autotuner may pick for weights like ``w_ab`` (buffers whose
    size depends on the config are sized for all of them)."""
    if not prune:
        return configs
    return prune["early_config_prune"](configs, {"W_AB": w_ab})


def stack_ab(w_a: torch.Tensor, w_b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[2H, c]`` in ``dtype``: ``w_a`` in rows ``[0, H)``, ``w_b`` in rows
    ``[H, 2H)``, the layout the kernels take the two SwiGLU projections in."""
    return torch.cat((w_a, w_b)).to(dtype).contiguous()


def _weight_splits(m: int, h: int, block_m: int, block_h: int, num_sms: int) -> int:
    """Row splits of the weight-gradient kernel: (hidden chunks x splits) fills the
    GPU with exactly one wave of equal programs."""
    return max(1, min(num_sms // triton.cdiv(h, block_h), triton.cdiv(m, block_m)))


# How the backward reduces the weight gradients over the rows:
# - "gemm": the input kernel, which recomputes ``[a | b]`` and ``dh`` for ``dx``
#   anyway, also writes them (as ``[da | db]``, ``h``, with ``xn`` and the masked
#   ``dy``) for a chunk of rows, and two cuBLAS GEMMs with fp32 output reduce the
#   chunk: 8 GEMM-equivalents of backward work instead of 11, at the price of
#   ``HIDDEN_CHUNK_BYTES`` of buffers and a few launches per chunk;
# - "kernel": ``_swiglu_transition_bwd_weight_kernel`` recomputes them a second time
#   and reduces in registers (no buffers, one launch);
# - "auto": "gemm" from ``GEMM_MIN_CHUNKS`` full chunks of rows up, else "kernel".
#   On the H200 (one run, docs/benchmarks.md) the pair transition's
#   forward + backward took 3.29 ms with "gemm" against 5.36 with "kernel" at
#   N = 768, but 1.62 against 1.46 at N = 384 (3 chunks).
WEIGHT_GRAD_PATH = "auto"
GEMM_MIN_CHUNKS = 4
# Bytes of the per-chunk buffers of the "gemm" path ([rows, 2c + 3H], compute dtype).
HIDDEN_CHUNK_BYTES = 256 * 2**20


def _hidden_chunk_rows(m: int, c: int, h: int, itemsize: int, num_sms: int) -> int:
    """Rows per chunk of the "gemm" path: whole waves of the input kernel's largest
    row block (128 rows per program) within :data:`HIDDEN_CHUNK_BYTES`."""
    wave = 128 * num_sms
    waves = max(1, HIDDEN_CHUNK_BYTES // ((2 * c + 3 * h) * itemsize * wave))
    return max(1, min(m, waves * wave))


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in the compute dtype:
    the product is accumulated in fp32 and added unrounded (cuBLAS's fp32-output
    GEMM for 16-bit inputs on CUDA; upcast operands elsewhere)."""
    if a.dtype == torch.float32:
        with cuda_tf32(False):  # IEEE fp32, as the kernels (see ``_kernel_flags``)
            acc.addmm_(a, b)
    elif a.is_cuda:
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.addmm_(a.float(), b.float())


def swiglu_transition_fwd(
    x: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    w_ab: torch.Tensor,
    w_out: torch.Tensor,
    mask: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel.

    Args:
        x: ``[M, c]``, unit column stride, any float dtype.
        ln_weight, ln_bias: ``[c]`` or both ``None`` (no LayerNorm).
        w_ab: ``[2H, c]`` from :func:`stack_ab`, contiguous, in the compute
            dtype; w_out: ``[c, H]`` contiguous, same dtype.
        mask: ``[M]`` contiguous or ``None``.

    Returns:
        ``(y [M, c] in the compute dtype, mean [M] fp32, rstd [M] fp32)``; mean and
        rstd are ``None`` without LayerNorm.
    """
    m, c = x.shape
    h = w_out.shape[1]
    normalize = ln_weight is not None
    y = torch.empty((m, c), device=x.device, dtype=w_ab.dtype)
    mean = rstd = None
    if normalize:
        mean = torch.empty(m, device=x.device, dtype=torch.float32)
        rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if m == 0:
        return y, mean, rstd

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]),)

    _fwd_kernel[grid](
        x, ln_weight if normalize else x, ln_bias if normalize else x,
        w_ab, w_out,
        mask if mask is not None else x, y,
        mean if normalize else y, rstd if normalize else y,
        m, c, h, x.stride(0), y.stride(0), eps,
        NORMALIZE=normalize, HAS_MASK=mask is not None,
        BLOCK_C=_block_c(c), **_kernel_flags(w_ab.dtype),
    )  # fmt: skip
    return y, mean, rstd


def _bwd_input_rows(
    r0, rows, min_block_m, x, ln_w, ln_b, w_ab, w_out, mask, dy, mean, rstd, dx,
    dln_w_part, dln_b_part, hidden, need_dx, need_dln, store_hidden, common,
) -> None:  # fmt: skip
    """Launch the input kernel on rows ``[r0, r0 + rows)``: their ``dx`` and LayerNorm
    partial sums, and with ``store_hidden`` their ``xn, dy * mask, [da | db], h``
    into the first ``rows`` rows of the ``hidden`` buffers (``x`` stands in for an
    unused per-row tensor). The kernel offsets the per-row tensors itself, so a
    chunk costs no slicing on the host. ``r0`` is a multiple of every candidate
    ``BLOCK_M``, so the partial-sum rows of the chunk start at ``r0 // min_block_m``."""
    if rows == 0:
        return
    p0 = r0 // min_block_m if need_dln else 0

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]),)

    _bwd_input_kernel[grid](
        x, ln_w, ln_b, w_ab, w_out, mask, dy, mean, rstd, dx, dln_w_part,
        dln_b_part, *hidden, r0, p0, r0 + rows, x.shape[1], w_out.shape[1],
        x.stride(0), dy.stride(0), dx.stride(0) if need_dx else 0,
        STORE_DX=need_dx, LN_GRAD=need_dln, NEED_DXN=need_dx or need_dln,
        STORE_HIDDEN=store_hidden, **common,
    )  # fmt: skip


def swiglu_transition_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    w_ab: torch.Tensor,
    w_out: torch.Tensor,
    mask: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
    need_dx: bool = True,
    need_dln: bool = True,
    need_dw_ab: bool = True,
    need_dw_out: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """Launch the backward kernels for the gradients asked for.

    Arguments as in :func:`swiglu_transition_fwd`, plus ``dy [M, c]`` (unit column
    stride) and the forward's ``mean``/``rstd``. ``w_a``/``w_b`` gradients come back
    separated again.

    Returns:
        ``(dx [M, c] in x.dtype, dln_weight [c], dln_bias [c], dw_a [H, c],
        dw_b [H, c], dw_out [c, H])``, the parameter gradients in fp32; an entry is
        ``None`` when it was not asked for (``need_dln`` covers both LayerNorm
        parameters, ``need_dw_ab`` both SwiGLU projections).
    """
    m, c = x.shape
    h = w_out.shape[1]
    normalize = ln_weight is not None
    need_dln = need_dln and normalize
    dev = x.device
    flags = _kernel_flags(w_ab.dtype)
    common = dict(
        NORMALIZE=normalize, HAS_MASK=mask is not None, BLOCK_C=_block_c(c), **flags
    )
    ln_w = ln_weight if normalize else x
    ln_b = ln_bias if normalize else x
    mean_ = mean if normalize else x
    rstd_ = rstd if normalize else x
    mask_ = mask if mask is not None else x
    dx = dln_w = dln_b = dw_a = dw_b = dw_ab = dw_out = None

    by_gemm = False
    if need_dw_ab or need_dw_out:
        num_sms = _num_sms(dev.index if dev.type == "cuda" else None)
        chunk = _hidden_chunk_rows(m, c, h, w_ab.element_size(), num_sms)
        by_gemm = WEIGHT_GRAD_PATH == "gemm" or (
            WEIGHT_GRAD_PATH == "auto" and m >= GEMM_MIN_CHUNKS * chunk
        )
    if need_dx or need_dln or by_gemm:
        dx = torch.empty_like(x) if need_dx else None
        min_block_m = min(
            cfg.kwargs["BLOCK_M"]
            for cfg in _candidate_configs(BWD_INPUT_CONFIGS, BWD_INPUT_PRUNE, w_ab)
        )
        parts = triton.cdiv(m, min_block_m) if need_dln else 1
        dln_w_part = torch.zeros((parts, c), device=dev, dtype=torch.float32)
        dln_b_part = torch.zeros((parts, c), device=dev, dtype=torch.float32)
        if by_gemm:
            hidden = [
                torch.empty((chunk, width), device=dev, dtype=w_ab.dtype)
                for width in (c, c, 2 * h, h)
            ]
            dw_ab_acc = torch.zeros((2 * h, c), device=dev, dtype=torch.float32)
            dw_out_acc = torch.zeros((c, h), device=dev, dtype=torch.float32)
        else:
            chunk = max(m, 1)
            hidden = [x] * 4  # unused pointers
        for r0 in range(0, m, chunk):
            rows = min(chunk, m - r0)
            _bwd_input_rows(
                r0, rows, min_block_m, x, ln_w, ln_b, w_ab, w_out, mask_, dy,
                mean_, rstd_, dx if need_dx else x, dln_w_part, dln_b_part, hidden,
                need_dx, need_dln, by_gemm, common,
            )  # fmt: skip
            if by_gemm:  # the buffers hold a full chunk; only the last is shorter
                xn, dym, dab, hid = (
                    hidden if rows == chunk else [t[:rows] for t in hidden]
                )
                if need_dw_ab:
                    _add_matmul(dw_ab_acc, dab.t(), xn)
                if need_dw_out:
                    _add_matmul(dw_out_acc, dym.t(), hid)
        if need_dln:
            dln_w = dln_w_part.sum(0)
            dln_b = dln_b_part.sum(0)
        if by_gemm:
            dw_ab, dw_out = dw_ab_acc, dw_out_acc

    if (need_dw_ab or need_dw_out) and not by_gemm:
        splits = max(
            _weight_splits(m, h, cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_H"], num_sms)
            for cfg in _candidate_configs(BWD_WEIGHT_CONFIGS, BWD_WEIGHT_PRUNE, w_ab)
        )
        shape_ab = (splits, 2 * h, c) if need_dw_ab else (1, 1, 1)
        dw_ab_part = torch.zeros(shape_ab, device=dev, dtype=torch.float32)
        shape_ch = (splits, c, h) if need_dw_out else (1, 1, 1)
        dw_out_part = torch.zeros(shape_ch, device=dev, dtype=torch.float32)

        def grid_weight(meta):
            return (
                triton.cdiv(h, meta["BLOCK_H"]),
                _weight_splits(m, h, meta["BLOCK_M"], meta["BLOCK_H"], num_sms),
            )

        if m > 0:
            _bwd_weight_kernel[grid_weight](
                x, ln_w, ln_b, w_ab, w_out, mask_, dy, mean_, rstd_,
                dw_ab_part, dw_out_part,
                m, c, h, x.stride(0), dy.stride(0),
                NEED_DW_AB=need_dw_ab, NEED_DW_OUT=need_dw_out, **common,
            )  # fmt: skip
        dw_ab, dw_out = dw_ab_part.sum(0), dw_out_part.sum(0)

    if need_dw_ab:  # [2H, c]: w_a's rows, then w_b's (stack_ab)
        dw_a, dw_b = (g.contiguous() for g in dw_ab.split(h))
    return dx, dln_w, dln_b, dw_a, dw_b, dw_out if need_dw_out else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[*, c]`` as ``[M, c]`` with unit column stride (a view when possible)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


class SwiGLUTransitionFunction(torch.autograd.Function):
    """Autograd function of the fused SwiGLU transition.

    ``apply(x, ln_weight, ln_bias, w_a, w_b, w_out, mask, eps, compute_dtype)``;
    ``ln_weight = ln_bias = None`` skips the LayerNorm. Saves ``x``, the weights in
    the compute dtype and the fp32 LayerNorm statistics; recomputes the rest.
    Parameter gradients come back in the parameters' dtypes (fp32 accumulation).
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        ln_weight: torch.Tensor | None,
        ln_bias: torch.Tensor | None,
        w_a: torch.Tensor,
        w_b: torch.Tensor,
        w_out: torch.Tensor,
        mask: torch.Tensor | None,
        eps: float,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        x2d = _rows(x)
        weights = (
            stack_ab(w_a, w_b, compute_dtype),
            w_out.to(compute_dtype).contiguous(),
        )
        mask1d = None
        if mask is not None:
            mask1d = mask.expand(x.shape[:-1]).reshape(-1)
            if not mask1d.is_floating_point():
                mask1d = mask1d.float()
            mask1d = mask1d.contiguous()
        y, mean, rstd = swiglu_transition_fwd(
            x2d, ln_weight, ln_bias, *weights, mask1d, eps
        )
        ctx.save_for_backward(x2d, ln_weight, ln_bias, *weights, mask1d, mean, rstd)
        ctx.x_shape = x.shape
        ctx.param_dtypes = tuple(
            p.dtype if p is not None else None
            for p in (ln_weight, ln_bias, w_a, w_b, w_out)
        )
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2d, ln_weight, ln_bias, w_ab, w_out, mask1d, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dln_w, dln_b, dw_a, dw_b, dw_out = swiglu_transition_bwd(
            _rows(dy), x2d, ln_weight, ln_bias, w_ab, w_out, mask1d, mean, rstd,
            need_dx=need[0], need_dln=need[1] or need[2],
            need_dw_ab=need[3] or need[4], need_dw_out=need[5],
        )  # fmt: skip
        grads = [dln_w, dln_b, dw_a, dw_b, dw_out]
        for i, dtype in enumerate(ctx.param_dtypes):
            if grads[i] is not None:
                grads[i] = grads[i].to(dtype) if need[i + 1] else None
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return (dx, *grads, None, None, None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype OF3 would use: the autocast dtype inside autocast, else
    ``x.dtype``."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _fused_ok(x: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    if not runs_on(x):
        return False, f"tensor on {x.device} and the Triton interpreter is off"
    if x.dtype not in _FUSED_DTYPES or dtype not in _FUSED_DTYPES:
        return False, f"dtype {x.dtype} / compute dtype {dtype}"
    if x.shape[-1] > MAX_FUSED_CHANNELS:
        return False, f"c={x.shape[-1]} > {MAX_FUSED_CHANNELS}"
    return True, ""


def _check_shapes(x, ln_weight, ln_bias, w_a, w_b, w_out) -> None:
    c = x.shape[-1]
    h = w_a.shape[0]
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError("pass both LayerNorm parameters or neither")
    if ln_weight is not None and (ln_weight.shape != (c,) or ln_bias.shape != (c,)):
        raise ValueError(f"LayerNorm parameters must be [{c}]")
    if w_a.shape != (h, c) or w_b.shape != (h, c) or w_out.shape != (c, h):
        raise ValueError(
            f"weights must be w_a, w_b [H, {c}] and w_out [{c}, H]; got "
            f"{tuple(w_a.shape)}, {tuple(w_b.shape)}, {tuple(w_out.shape)}"
        )


def _row_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The mask as one value per row (``[*]``): OF3's ``_transition`` passes it as
    ``[*, 1]``; both the fused path and the torch fallback take ``[*]``."""
    if mask is not None and mask.dim() == x.dim() and mask.shape[-1] == 1:
        return mask[..., 0]
    return mask


def _swiglu(caller, x, ln_weight, ln_bias, w_a, w_b, w_out, mask, eps):
    """:func:`swiglu_transition` (LayerNorm parameters given) or :func:`swiglu_mlp`
    (both ``None``: no LayerNorm): checks, then the fused function or the torch
    fallback."""
    _check_shapes(x, ln_weight, ln_bias, w_a, w_b, w_out)
    mask = _row_mask(mask, x)
    dtype = compute_dtype(x)
    ok, why = _fused_ok(x, dtype)
    if not ok:
        logger.debug("%s: torch path (%s)", caller, why)
        return swiglu_transition_reference(
            x, ln_weight, ln_bias, w_a, w_b, w_out, mask, eps,
            normalize=ln_weight is not None,
        ).to(dtype)
    return SwiGLUTransitionFunction.apply(
        x, ln_weight, ln_bias, w_a, w_b, w_out, mask, eps, dtype
    )


def swiglu_transition(
    x: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    w_a: torch.Tensor,
    w_b: torch.Tensor,
    w_out: torch.Tensor,
    mask: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """OF3's SwiGLU transition, fused: ``(silu(LN(x) w_a^T) * (LN(x) w_b^T)) w_out^T``
    times ``mask``.

    Args:
        x: ``[*, c]``, fp32 / bf16 / fp16.
        ln_weight, ln_bias: ``[c]``, OF3's ``layer_norm.weight`` / ``.bias``.
        w_a, w_b: ``[n*c, c]``, OF3's ``swiglu.linear_a.weight`` /
            ``swiglu.linear_b.weight`` (``nn.Linear`` layout, no bias).
        w_out: ``[c, n*c]``, OF3's ``linear_out.weight``.
        mask: ``[*]`` (= ``x.shape[:-1]``, broadcastable, or with a trailing 1), or
            ``None``. No gradient flows to it.
        eps: LayerNorm epsilon.

    Returns:
        ``[*, c]`` in the compute dtype: ``x.dtype``, or the autocast dtype inside
        ``torch.autocast`` (OF3's ``Linear`` runs in the autocast dtype there too).
        LayerNorm statistics and all matmul accumulation are fp32; as in OF3 the
        normalised rows and ``silu(a) * b`` are rounded to the compute dtype before
        their matmuls. fp32 matmuls use IEEE fp32, whatever
        ``torch.backends.cuda.matmul.allow_tf32`` says.

    Falls back to :func:`swiglu_transition_reference` (OF3's eager math, same
    numerics; its result cast to the compute dtype) for ``c > 128``, other dtypes,
    or a CPU tensor without the Triton interpreter.
    """
    if ln_weight is None or ln_bias is None:
        raise ValueError(
            "swiglu_transition needs both LayerNorm parameters (swiglu_mlp is the "
            "transition without its LayerNorm)"
        )
    return _swiglu("swiglu_transition", x, ln_weight, ln_bias, w_a, w_b, w_out, mask,
                   eps)


def swiglu_mlp(
    x: torch.Tensor,
    w_a: torch.Tensor,
    w_b: torch.Tensor,
    w_out: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(silu(x w_a^T) * (x w_b^T)) w_out^T`` times ``mask``: the SwiGLU transition
    without its LayerNorm, for inputs normalised elsewhere (the AdaLN output in OF3's
    ``ConditionedTransitionBlock``, whose ``swiglu.linear_a/b`` and ``linear_out``
    weights go here unchanged). Shapes, dtypes and fallbacks as in
    :func:`swiglu_transition`.
    """
    return _swiglu("swiglu_mlp", x, None, None, w_a, w_b, w_out, mask, 0.0)
