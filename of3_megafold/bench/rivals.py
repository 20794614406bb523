"""Other projects' kernels for the same math, timed next to the kit's.

None of them is a dependency of the kit. A benchmark asks :func:`unavailable` first;
when a rival is missing it writes a row that says which package is missing and how
to get it, and goes on with the rest.

- ``cueq``: cuEquivariance's ``triangle_attention`` (NVIDIA; packages
  ``cuequivariance-torch`` and ``cuequivariance-ops-torch-cu12`` or ``-cu13``). It
  takes Q/K/V as ``[B, S, H, N, D]`` and a boolean key mask ``[B, S, 1, 1, N]``;
  outside Blackwell it reads the pair bias in fp32 and casts it itself.
- ``deepspeed``: DeepSpeed's ``DS4Sci_EvoformerAttention`` (CUTLASS). DeepSpeed
  compiles it on first use, so it needs ``nvcc`` and the CUTLASS headers
  (``nvidia-cutlass``, or ``CUTLASS_PATH``). It takes the kit's layout,
  ``[B, S, N, H, D]``, and the biases ``[mask_bias, pair_bias]`` in Q's dtype.
- ``liger``: Liger-Kernel's LayerNorm and ``silu(a) * b`` kernels. Composed with
  torch's linears they make OF3's ``SwiGLUTransition``, the way a Liger user would
  write it.

OF3 itself calls the first two through ``use_cueq_triangle_kernels`` and
``use_deepspeed_evo_attention``: the module benchmark times those flags.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import torch

# name -> (modules that must import, what to install)
_PACKAGES = {
    "cueq": (
        ("cuequivariance_torch", "cuequivariance_ops_torch"),
        "pip install cuequivariance-torch cuequivariance-ops-torch-cu12 (or -cu13)",
    ),
    "deepspeed": (
        ("deepspeed",),
        "pip install deepspeed nvidia-cutlass (its evoformer op builds on first use)",
    ),
    "liger": (("liger_kernel",), "pip install liger-kernel"),
}
RIVALS = tuple(_PACKAGES)


def unavailable(name: str) -> str | None:
    """Why rival ``name`` cannot run here, or None if it can."""
    modules, fix = _PACKAGES[name]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return f"{name}: {', '.join(missing)} not installed ({fix})"
    if not torch.cuda.is_available():
        return f"{name}: needs a CUDA device"
    return None


class AttentionCall(NamedTuple):
    """A rival attention kernel in the kit's terms.

    ``to_native(q, k, v, mask_bias, pair_bias)`` puts the kit's inputs (Q/K/V
    ``[B, S, N, H, D]``, ``mask_bias [B, S, 1, 1, N]``, ``pair_bias [B, 1, H, N, N]``)
    into the rival's layout, differentiably; ``forward`` runs the rival on those;
    ``from_native`` maps its output (or an output gradient) back, and ``to_native_out``
    maps a ``[B, S, N, H, D]`` output gradient into the rival's layout.
    """

    to_native: Callable[..., tuple]
    forward: Callable[..., torch.Tensor]
    from_native: Callable[[torch.Tensor], torch.Tensor]
    to_native_out: Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _swap_tokens_and_heads(t: torch.Tensor) -> torch.Tensor:
    """``[B, S, N, H, D]`` <-> ``[B, S, H, N, D]``, contiguous."""
    return t.transpose(2, 3).contiguous()


def cueq_attention_call() -> AttentionCall:
    from cuequivariance_torch.primitives.triangle import triangle_attention

    def to_native(q, k, v, mask_bias, pair_bias):
        q, k, v = (_swap_tokens_and_heads(t) for t in (q, k, v))
        return q, k, v, mask_bias == 0, pair_bias

    def forward(q, k, v, keep, pair_bias):
        return triangle_attention(q, k, v, bias=pair_bias, mask=keep)

    return AttentionCall(
        to_native, forward, _swap_tokens_and_heads, _swap_tokens_and_heads
    )


def deepspeed_attention_call() -> AttentionCall:
    from deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention

    def to_native(q, k, v, mask_bias, pair_bias):
        return q, k, v, mask_bias.to(q.dtype), pair_bias.to(q.dtype)

    def forward(q, k, v, mask_bias, pair_bias):
        return DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair_bias])

    return AttentionCall(to_native, forward, _identity, _identity)


ATTENTION_CALLS = {"cueq": cueq_attention_call, "deepspeed": deepspeed_attention_call}


def liger_swiglu_transition(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``f(x, mask) -> y``: OF3's ``SwiGLUTransition`` ``module`` (its parameters,
    its LayerNorm eps) with Liger's LayerNorm and ``silu(a) * b`` kernels and torch's
    linears in the input's dtype, as OF3's ``Linear`` runs under bf16 training."""
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    ln, swiglu, out = module.layer_norm, module.swiglu, module.linear_out

    def forward(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xn = LigerLayerNormFunction.apply(x, ln.weight, ln.bias, ln.eps)
        a = torch.nn.functional.linear(xn, swiglu.linear_a.weight.to(dtype))
        b = torch.nn.functional.linear(xn, swiglu.linear_b.weight.to(dtype))
        y = torch.nn.functional.linear(
            LigerSiLUMulFunction.apply(a, b), out.weight.to(dtype)
        )
        return y * mask.unsqueeze(-1).to(dtype)

    return forward
