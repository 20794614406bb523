"""EvoFlash-3D self-attention fed by its own q/k/v(/gate) projection.

:func:`evoflash_attention_projected` computes
``softmax(scale q k^T + mask_bias + pair_bias) v``, times ``sigmoid(g)`` when
gated, with ``[q | k | v | g] = x weight^T + bias`` computed inside. A projection
larger than :data:`CHUNK_BYTES` is never saved: the forward runs it per chunk of S
slices and keeps only ``x``, the output and the row statistics; the backward
recomputes each chunk's projection, runs the attention backward into one packed
gradient and turns that into the input, weight and bias gradients before the next
chunk. Peak memory then holds one chunk's projection and its gradient (about
:data:`CHUNK_BYTES` each) instead of the whole ``[B, S, N, P, H, D]`` pair: at
triangle attention N=1024 (4 heads x 32, gated) those are 1 GiB each in bf16. The
price is one more projection GEMM per chunk. A projection that fits in one chunk is
saved for the backward, as a plain autograd graph would (so activation
checkpointing drops it).
"""

from __future__ import annotations

import torch

from ..backend import cdiv
from .function import _as_5d, _Inputs, _require_device, evoflash_bwd, evoflash_fwd

# Projection bytes per chunk: 256 rows of triangle attention at N=1024 (gated,
# 4 heads x 32, bf16). Calls up to it run as one chunk.
CHUNK_BYTES = 256 * 2**20

Rows = tuple[slice, slice]  # the (b, s) slices of a chunk
WHOLE: Rows = (slice(None), slice(None))  # the one chunk of a call that fits


def chunks(B: int, S: int, slice_bytes: int) -> list[Rows]:
    """The ``(b, s)`` slices of the chunks of a ``[B, S, ...]`` input whose
    projection takes ``slice_bytes`` per S slice: one chunk when it all fits in
    :data:`CHUNK_BYTES`, else per ``b`` equal runs of S slices (each chunk a
    contiguous slab of the input)."""
    if B * S == 0:
        return []
    if B * S * slice_bytes <= CHUNK_BYTES:
        return [WHOLE]
    step = cdiv(S, cdiv(S * slice_bytes, CHUNK_BYTES))
    return [(slice(b, b + 1), slice(s, min(S, s + step)))
            for b in range(B) for s in range(0, S, step)]


def _rows(t: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """A chunk's part of a ``[B|1, S|1, ...]`` tensor (broadcast dims kept whole;
    the tensor itself for :data:`WHOLE`, no view op on a host-bound call)."""
    if t is None or rows is WHOLE:
        return t
    b, s = rows
    return t[b if t.shape[0] > 1 else slice(None), s if t.shape[1] > 1 else slice(None)]


def _project(x, weight, bias, rows: Rows) -> torch.Tensor:
    """A chunk's projection ``[b, s, N, P, H, D]``."""
    P, H, D, C = weight.shape
    xr = _rows(x, rows)
    return torch.nn.functional.linear(
        xr, weight.reshape(-1, C), bias.reshape(-1) if bias is not None else None
    ).view(*xr.shape[:-1], P, H, D)


def _kernel_inputs(qkv, mask, pair_bias, rows: Rows, checked: _Inputs | None = None):
    """A chunk's kernel inputs and its gate (None when ungated): checked here, or
    the forward's ``checked`` ones (kept without tensors) given these tensors."""
    q, k, v, *gate = qkv.unbind(3)
    mask, pair_bias = _rows(mask, rows), _rows(pair_bias, rows)
    inp = (_Inputs(q, k, v, mask, pair_bias) if checked is None
           else checked.with_tensors(q, k, v, mask, pair_bias))
    return inp, gate[0] if gate else None


def _add(total: torch.Tensor | None, part: torch.Tensor, several: bool) -> torch.Tensor:
    """``total + part``: in fp32 over several chunks, ``part`` as it is for one."""
    if not several:
        return part
    part = part.float()
    return part if total is None else total.add_(part)


def _finish(total: torch.Tensor | None, like: torch.Tensor, shape) -> torch.Tensor:
    """A gradient summed over the chunks in ``like``'s dtype and ``shape`` (zeros
    when no chunk ran: an empty output)."""
    if total is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return total.to(like.dtype).reshape(shape)


class EvoFlashProjectedAttentionFunction(torch.autograd.Function):
    """Autograd function behind :func:`evoflash_attention_projected`.

    Saves ``x``, the weights, the mask, the (contiguous) pair bias, the gated
    output and per chunk the row statistics, slice flags and key-mask ranges, and
    the projection when it is one chunk. The mask gets no gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask_bias, pair_bias, scale, deterministic):
        # dots in x's dtype whatever autocast says, here and in the backward (which
        # autograd may run under another autocast state than the forward's)
        with torch.autocast(x.device.type, enabled=False):
            return EvoFlashProjectedAttentionFunction._forward(
                ctx, x, weight, bias, mask_bias, pair_bias, scale, deterministic)

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return EvoFlashProjectedAttentionFunction._backward(ctx, do)

    @staticmethod
    def _forward(ctx, x, weight, bias, mask_bias, pair_bias, scale, deterministic):
        x = x.contiguous()
        mask = _as_5d(mask_bias) if mask_bias is not None else None
        pb = _as_5d(pair_bias) if pair_bias is not None else None
        if pb is not None and pb.stride(-1) != 1:
            pb = pb.contiguous()  # once, not per chunk (OF3's is a permuted view)
        B, S, N, _ = x.shape
        _, H, D, _ = weight.shape
        ctx.scale = scale if scale is not None else D ** -0.5
        ctx.deterministic = deterministic
        ctx.bias_shape = pair_bias.shape if pair_bias is not None else None
        o = x.new_empty((B, S, N, H, D))
        ctx.chunks = chunks(B, S, N * weight.shape[:3].numel() * x.element_size()
                            ) if o.numel() else []
        stats, qkv, ctx.inputs = [], None, []
        for rows in ctx.chunks:
            qkv = _project(x, weight, bias, rows)
            inp, gate = _kernel_inputs(qkv, mask, pb, rows)
            ctx.inputs.append(inp.with_tensors(None, None, None, None, None))
            _, *chunk_stats = evoflash_fwd(inp, ctx.scale, False, gate,
                                           out=_rows(o, rows))
            stats += chunk_stats
        # One chunk: its projection is saved (recomputing it would only cost time).
        # Saved, not kept on ctx: activation checkpointing (OF3 checkpoints its
        # pairformer blocks) drops only what goes through save_for_backward, and a
        # projection on ctx outlives the checkpoint (+15.7 GiB in a 384-token
        # training step). The cost is a higher backward peak outside
        # checkpointing: the input gradient is allocated while the projection lives.
        kept = qkv if len(ctx.chunks) == 1 else None
        ctx.save_for_backward(x, weight, bias, mask, pb, o, kept, *stats)
        return o

    @staticmethod
    def _backward(ctx, do):
        x, weight, bias, mask, pb, o, kept, *stats = ctx.saved_tensors
        need_x, need_w, need_b, _, need_pb = ctx.needs_input_grad[:5]
        need_proj = need_x or need_w or need_b
        several = len(ctx.chunks) > 1
        C = x.shape[-1]
        w2d = weight.reshape(-1, C)
        dx = None
        if need_x and several:  # one chunk: allocated by its GEMM
            dx = torch.empty_like(x)
        elif need_x and not ctx.chunks:  # an empty output
            dx = torch.zeros_like(x)
        dw = db = dpb = None
        if need_pb and several:
            dpb = torch.zeros(pb.shape, dtype=torch.float32, device=pb.device)
        for i, rows in enumerate(ctx.chunks):
            qkv = kept if kept is not None else _project(x, weight, bias, rows)
            inp, gate = _kernel_inputs(qkv, mask, pb, rows, ctx.inputs[i])
            # dQ, dK, dV and the gate gradient land in one tensor of the projection's
            # layout (the gate's even when only the pair bias needs a gradient)
            dqkv = torch.empty_like(qkv)
            _, _, _, dpb_rows = evoflash_bwd(
                inp, _rows(do, rows), _rows(o, rows), *stats[4 * i:4 * i + 4],
                ctx.scale, False, ctx.deterministic, need_proj, need_proj, need_pb,
                gate, dqkv.unbind(3), dbias_dtype=torch.float32 if several else None,
            )
            del qkv, inp, gate
            grad = dqkv.view(-1, w2d.shape[0])
            if need_x and several:
                torch.mm(grad, w2d, out=_rows(dx, rows).view(-1, C))
            elif need_x:
                dx = torch.mm(grad, w2d).view(x.shape)
            if need_w:
                dw = _add(dw, grad.t() @ _rows(x, rows).reshape(-1, C), several)
            if need_b:
                db = _add(db, grad.sum(0, dtype=torch.float32), several)
            if need_pb and several:
                _rows(dpb, rows).add_(dpb_rows)
            elif need_pb:
                dpb = dpb_rows
            del dqkv, grad
        dw = _finish(dw, weight, weight.shape) if need_w else None
        db = _finish(db, bias, bias.shape) if need_b else None
        dpb = _finish(dpb, pb, ctx.bias_shape) if need_pb else None
        return dx, dw, db, None, dpb, None, None


def evoflash_attention_projected(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask_bias: torch.Tensor | None = None,
    pair_bias: torch.Tensor | None = None,
    scale: float | None = None,
    deterministic: bool = True,
) -> torch.Tensor:
    """Self-attention with pair bias from ``x`` and the stacked projections.

    Args:
        x: ``[B, S, N, C]`` (fp32, bf16 or fp16): the attention's input, e.g. the
            LayerNorm'd pair representation of triangle attention.
        weight: ``[P, H, D, C]`` in ``x``'s dtype: the q, k, v (and, with
            ``P = 4``, gate) projections' weights stacked, each ``[H * D, C]`` seen
            per head.
        bias: optional ``[P, H, D]`` in ``x``'s dtype (zeros for a projection
            without one).
        mask_bias, pair_bias, scale, deterministic: as in
            :func:`~.function.evoflash_attention` (dots in ``x``'s dtype, tf32 for
            fp32; fp32 softmax and accumulation).

    Returns:
        ``[B, S, N, H, D]`` in ``x``'s dtype:
        ``softmax(scale q k^T + mask_bias + pair_bias) v``, times ``sigmoid(g)``
        with ``P = 4`` (in fp32 in the kernel's epilogue, rounded once).
    """
    _require_device(x, "evoflash_attention_projected")
    if x.dim() != 4 or weight.dim() != 4 or weight.shape[0] not in (3, 4):
        raise ValueError(
            f"x must be [B, S, N, C] and weight [3 or 4, H, D, C], got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"weight's C ({weight.shape[-1]}) is not x's ({x.shape[-1]})")
    if bias is not None and bias.shape != weight.shape[:3]:
        raise ValueError(f"bias must be {tuple(weight.shape[:3])}, got "
                         f"{tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"weight and bias must have x's dtype {x.dtype}")
    return EvoFlashProjectedAttentionFunction.apply(
        x, weight, bias, mask_bias, pair_bias, scale, deterministic
    )
