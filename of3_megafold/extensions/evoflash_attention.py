"""EvoFlash-3D in OF3's ``Attention``: attention with pair bias on one fused kernel.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_evoflash_attention``
(default false). With a key on, ``Attention.forward`` of every module of that model
(triangle attention start/end in the pairformer, MSA module, template stack and
confidence pairformer; ``AttentionPairBias`` on the single representation;
``DiffusionAttentionPairBias`` with its bias shared over the diffusion samples)
runs its core on :func:`evoflash_attention`: the ``[*, H, Q, K]`` logits are never
stored. ``TriangleAttention.forward`` is replaced as a whole
(:func:`fused_triangle_attention_forward`): its five projections run as one GEMM whose
output the kernel reads through strided views; calls it does not take (OF3's
inference chunking, OF3's kernel flags) keep OF3's forward, whose ``Attention`` call
still runs on the kernel. Parameter names are unchanged, so OF3 checkpoints load as
they are.

The key is mutually exclusive with OF3's own kernel flags
(``use_deepspeed_evo_attention``, ``use_cueq_triangle_kernels``,
``use_triton_triangle_kernels``, ``use_lma``) in the same mode; note OF3's ``eval``
section turns ``use_triton_triangle_kernels`` on by default.

The kernel takes equal query and key lengths. ``CrossAttentionPairBias`` (OF3's local
atom attention: blocks of 32 queries against 128 keys, a few MB of logits) therefore
keeps OF3's path; whether a kernel would pay there was not measured.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from of3_megafold import registry
from of3_megafold.errors import KitConfigError
from of3_megafold.kernels.backend import triton_backend

NAME = "evoflash_attention"
FLAG = "use_evoflash_attention"
OF3_KERNEL_FLAGS = (
    "use_deepspeed_evo_attention",
    "use_cueq_triangle_kernels",
    "use_triton_triangle_kernels",
    "use_lma",
)

KEYS = registry.memory_flag_keys(
    FLAG,
    "run triangle, single and diffusion attention on the fused EvoFlash-3D Triton "
    "kernel (no [*, H, N, N] logits stored). Exclusive with OF3's kernel flags in "
    "the same section.",
)


def _flatten_bias(bias: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """``[*, h, q, k]`` broadcastable to ``lead + [H, Q, K]`` -> ``[B, s, h, q, k]``.

    ``lead`` is the query's batch shape; its last dim is the kernel's S, the others
    fold into B. ``s`` stays 1 where the bias is shared over S (a stride-0 view).
    """
    bias = bias.reshape((1,) * (len(lead) + 3 - bias.dim()) + bias.shape)
    outer = lead[:-1]
    s = bias.shape[len(outer)]
    bias = bias.expand(*outer, s, *bias.shape[-3:])
    return bias.reshape(math.prod(outer), s, *bias.shape[-3:])


def split_biases(
    biases: list[torch.Tensor], lead: torch.Size
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sort OF3's bias list into the kernel's mask bias and pair bias.

    A bias with singleton head and query dims (``[*, 1, 1, K]``) is a mask; anything
    else is a pair bias. Several of a kind are summed.

    Returns:
        ``mask_bias [B, S|1, 1, 1, K]`` and ``pair_bias [B, S|1, H|1, Q, K]``, each
        ``None`` when absent.
    """
    masks = [b for b in biases if b.shape[-3] == 1 and b.shape[-2] == 1]
    pairs = [b for b in biases if not (b.shape[-3] == 1 and b.shape[-2] == 1)]

    def combine(group):
        if not group:
            return None
        flat = [_flatten_bias(b, lead) for b in group]
        return flat[0] if len(flat) == 1 else sum(flat[1:], flat[0])

    return combine(masks), combine(pairs)


def evoflash_forward(
    attention: Any,
    q_x: torch.Tensor,
    kv_x: torch.Tensor,
    biases: list[torch.Tensor],
    high_precision: bool,
) -> torch.Tensor:
    """OF3's ``Attention.forward`` with the core on the EvoFlash-3D kernel.

    Args:
        attention: OF3's ``Attention`` module (its projections and gating are used
            as they are).
        q_x, kv_x: ``[*, N, C]`` query and key/value inputs (same ``N``).
        biases: OF3's bias list, each broadcastable to ``[*, H, N, N]``.
        high_precision: OF3's ``use_high_precision`` (fp32 core).

    Returns:
        ``[*, N, C_q]``, as OF3's ``Attention.forward``.
    """
    from of3_megafold.kernels.evoflash import evoflash_attention

    heads, c = attention.no_heads, attention.c_hidden
    lead = q_x.shape[:-2] if q_x.dim() > 2 else torch.Size([1])
    n = q_x.shape[-2]
    b = math.prod(lead[:-1])
    q, k, v = (
        linear(x).view(b, lead[-1], n, heads, c)
        for linear, x in (
            (attention.linear_q, q_x),
            (attention.linear_k, kv_x),
            (attention.linear_v, kv_x),
        )
    )
    in_dtype = q.dtype
    if high_precision:
        q, k, v = q.float(), k.float(), v.float()
    mask_bias, pair_bias = split_biases(biases, lead)
    o = evoflash_attention(
        q,
        k,
        v,
        mask_bias=mask_bias,
        pair_bias=pair_bias,
        scale=1.0 / math.sqrt(c),
        high_precision=high_precision,
    )
    # As OF3's ``_attention``: the core's result in the projections' dtype.
    o = o.to(in_dtype)
    return attention._wrap_up(o.view(*q_x.shape[:-1], heads, c), q_x)


_ALIGN = 16
"""Each layer's block of the fused projection is padded to a multiple of this many
rows, so every view of its output starts 16-element aligned and the row stride is a
multiple of 16 elements, as in a contiguous projection (Triton specialises its loads
on both)."""


def _fused_projection(
    x: torch.Tensor, linears: list[torch.nn.Linear]
) -> list[torch.Tensor]:
    """Several OF3 ``Linear`` layers on the same input as one GEMM.

    The weights (and biases, zeros standing in for a layer without one) are
    concatenated here, at every call, so the module's parameters and OF3 checkpoints
    stay as they are; each layer's block is padded with zero rows to a multiple of
    16. The dtype rules are OF3's ``Linear.forward``: a bf16 input runs on bf16
    weights with autocast off; anything else is a plain ``F.linear``, which autocast
    casts as it casts OF3's layers. OF3's DeepSpeed case (a bf16 input stays under
    autocast) computes the same numbers.

    Args:
        x: ``[*, C_in]``.
        linears: layers with ``C_in`` inputs and no ``precision`` of their own.

    Returns:
        ``[*, C_out_i]`` per layer: column views of one ``[*, R]`` result (``R`` the
        padded total), not copies. Autograd's split backward writes their gradients
        into one ``[*, R]`` buffer for the single weight-gradient GEMM.
    """
    weights, biases, widths = [], [], []
    with_bias = any(linear.bias is not None for linear in linears)
    for linear in linears:
        w = linear.weight
        rows = w.shape[0]
        pad = -rows % _ALIGN
        weights += [w, w.new_zeros(pad, w.shape[1])]
        if with_bias:
            bias = linear.bias if linear.bias is not None else w.new_zeros(rows)
            biases += [bias, w.new_zeros(pad)]
        widths += [rows, pad]
    weight = torch.cat(weights)
    bias = torch.cat(biases) if with_bias else None
    if x.dtype is torch.bfloat16:
        with torch.autocast(x.device.type, enabled=False):
            bias = bias.to(x.dtype) if bias is not None else None
            out = F.linear(x, weight.to(x.dtype), bias)
    else:
        out = F.linear(x, weight, bias)
    return list(out.split(widths, dim=-1)[::2])


class _SigmoidGate(torch.autograd.Function):
    """``o * sigmoid(g)``, OF3's gating, saving ``o`` and ``g`` for the backward.

    Autograd on OF3's two ops would also keep ``sigmoid(g)``; here ``o`` is already
    kept by the kernel and ``g`` is a view of the fused projection, which stays
    alive for Q, K and V, so the gate adds no saved tensor of its own. The backward
    recomputes ``sigmoid(g)`` and then follows autograd's formulas for OF3's ops,
    op for op (same dtypes, same roundings).
    """

    @staticmethod
    def forward(ctx, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(o, g)
        return o * torch.sigmoid(g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        o, g = ctx.saved_tensors
        gate = torch.sigmoid(g)
        grad_o = grad * gate if ctx.needs_input_grad[0] else None
        grad_g = None
        if ctx.needs_input_grad[1]:
            grad_g = torch.ops.aten.sigmoid_backward(grad * o, gate)
        return grad_o, grad_g


def _triangle_linears(module: Any) -> list[torch.nn.Linear]:
    """The layers of a ``TriangleAttention`` that read its LayerNorm output, in
    projection order: q, k, v, the gate (when gating), the triangle bias."""
    mha = module.mha
    gate = [mha.linear_g] if mha.linear_g is not None else []
    return [mha.linear_q, mha.linear_k, mha.linear_v, *gate, module.linear_z]


def fused_triangle_attention_forward(
    module: Any,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    transpose_bias: bool = False,
) -> torch.Tensor:
    """OF3's ``TriangleAttention.forward`` with one projection GEMM and the kernel.

    The same computation as OF3's (unchunked) module: ``LN(x)``, the mask bias
    ``inf * (mask - 1)``, the triangle bias ``LN(x) W_z`` as ``[*, 1, H, I, J]``
    (``[*, 1, H, J, I]`` with ``transpose_bias``), attention along ``J`` for every
    row ``i``, gating ``sigmoid(LN(x) W_g) * o`` and ``linear_o``. The ending node
    (``module.starting`` false) swaps the ``I``/``J`` axes of ``x`` and ``mask``
    first and of the result last, as OF3 does.

    What differs is the work around the core: ``linear_q``, ``linear_k``,
    ``linear_v``, ``linear_g`` and ``linear_z`` run as one GEMM on the LayerNorm
    output (:func:`_fused_projection`); Q, K, V, the gate and the triangle bias are
    strided views of its result, read by :func:`evoflash_attention` in place.
    A missing mask is no mask bias (OF3's all-ones mask adds zero).

    Args:
        module: OF3's ``TriangleAttention`` (its parameters are used as they are).
        x: ``[*, I, J, C_in]`` pair representation, ``I == J``.
        mask: optional ``[*, I, J]`` pair mask (1 keep, 0 masked).
        transpose_bias: OF3's flag (the pairformer's ending node passes a
            transposed ``x`` and sets it).

    Returns:
        ``[*, I, J, C_in]`` in the dtype OF3's module returns (bf16 under bf16
        autocast).
    """
    from of3_megafold.kernels.evoflash import evoflash_attention

    mha = module.mha
    heads, c = mha.no_heads, mha.c_hidden
    if not module.starting:
        x = x.transpose(-2, -3)
        mask = mask.transpose(-1, -2) if mask is not None else None
    x = module.layer_norm(x)
    *batch, n_i, n_j, _ = x.shape
    b = math.prod(batch)
    # [b, I, J, H*C] each (the gate only with gating), z [b, I, J, H]
    x = x.reshape(b, n_i, n_j, -1)
    q, k, v, *g, z = _fused_projection(x, _triangle_linears(module))
    q, k, v = (t.unflatten(-1, (heads, c)) for t in (q, k, v))

    mask_bias = None
    if mask is not None:
        mask_bias = (module.inf * (mask - 1)).expand(*batch, n_i, n_j)
        mask_bias = mask_bias.reshape(b, n_i, 1, 1, n_j)
    # [b, 1, H, I, J] ([b, 1, H, J, I] transposed), as OF3's permute of linear_z;
    # the kernel copies this strided view once (N^2 H elements)
    pair_bias = z.permute(0, 3, 2, 1) if transpose_bias else z.permute(0, 3, 1, 2)
    o = evoflash_attention(
        q,
        k,
        v,
        mask_bias=mask_bias,
        pair_bias=pair_bias.unsqueeze(1),
        scale=1.0 / math.sqrt(c),
    )
    # As OF3's Attention._wrap_up.
    if g:
        o = _SigmoidGate.apply(o, g[0].unflatten(-1, (heads, c)))
    o = mha.linear_o(o.flatten(-2)).reshape(*batch, n_i, n_j, -1)
    if not module.starting:
        o = o.transpose(-2, -3)
    return o


def _enabled(module: Any) -> bool:
    return registry.module_enabled(module, NAME, FLAG)


def _patch_attention_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        q_x, kv_x = call.arguments["q_x"], call.arguments["kv_x"]
        if not _enabled(self) or q_x.shape[-2] != kv_x.shape[-2]:
            return original(self, *args, **kwargs)
        high_precision = bool(call.arguments.get("use_high_precision", False))
        biases = call.arguments.get("biases") or []
        return evoflash_forward(self, q_x, kv_x, biases, high_precision)

    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original
    return forward


_FUSED_TRIANGLE_ARGS = ("self", "x", "mask", "transpose_bias", "inplace_safe")
"""``TriangleAttention.forward`` arguments the fused path takes (``inplace_safe``
only matters for OF3's chunking); any other argument must be at its default (None
or False): ``chunk_size`` and OF3's kernel flags go to OF3's forward."""


def _fusable(module: Any, arguments: dict[str, Any]) -> bool:
    others = (v for k, v in arguments.items() if k not in _FUSED_TRIANGLE_ARGS)
    x = arguments["x"]
    linears = _triangle_linears(module)
    return (
        all(v is None or v is False for v in others)
        and x.shape[-2] == x.shape[-3]
        and all(getattr(layer, "precision", None) is None for layer in linears)
    )


def _patch_triangle_attention_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        if not _enabled(self) or not _fusable(self, call.arguments):
            # OF3's forward; its ``self.mha`` call still takes the patched core.
            return original(self, *args, **kwargs)
        return fused_triangle_attention_forward(
            self,
            call.arguments["x"],
            call.arguments.get("mask"),
            bool(call.arguments.get("transpose_bias", False)),
        )

    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original
    return forward


def _validate(config: Any) -> None:
    for key in KEYS:
        if not key.read(config):
            continue
        section = config.settings.memory[key.path[2]]
        clashing = [flag for flag in OF3_KERNEL_FLAGS if section.get(flag)]
        if clashing:
            raise KitConfigError(
                f"{key.yaml_path} is on together with OF3's "
                f"{', '.join(clashing)} in settings.memory.{key.path[2]}; "
                "choose one attention kernel (set the others to false)"
            )


EXTENSION = registry.register(
    registry.Extension(
        name=NAME,
        summary="Fused attention with pair bias (forward and backward) for "
        "triangle, single and diffusion attention",
        keys=KEYS,
        requested=registry.any_key_on(KEYS),
        enable_update={"settings": {"memory": {"train": {FLAG: True}}}},
        requires=("triton",),
        device_check=triton_backend,
        patches=(
            registry.Patch(
                "openfold3.core.model.primitives.attention:Attention.forward",
                _patch_attention_forward,
            ),
            registry.Patch(
                "openfold3.core.model.layers.triangular_attention:"
                "TriangleAttention.forward",
                _patch_triangle_attention_forward,
            ),
        ),
        validate=_validate,
        docs="docs/extensions/evoflash_attention.md",
    )
)
