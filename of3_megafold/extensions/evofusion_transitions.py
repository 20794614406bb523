"""EvoFusion in OF3's transitions: LayerNorm + SwiGLU + output Linear, fused.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_evofusion_transitions``
(default false). With a key on, every ``SwiGLUTransition`` of that model (pairformer
pair and single, MSA module, template stack, diffusion conditioning) runs
:func:`swiglu_transition`, and every ``ConditionedTransitionBlock`` (diffusion and
atom transformers) runs its SwiGLU and output projection through
:func:`swiglu_mlp` after OF3's AdaLN. The forward keeps only the input (and the
LayerNorm statistics); the backward recomputes the ``[*, n*c]`` hidden activations.
Parameter names are unchanged, so OF3 checkpoints load as they are.

With a key on, OF3's ``LayerNorm`` on a 16-bit input (the pair and MSA stacks'
activations: triangle attention and multiplication, outer product mean, attention
with pair bias) also runs :func:`~of3_megafold.kernels.layer_norm.layer_norm`: the
same fp32 statistics and result as OF3's, read and written in the input's dtype.
OF3 makes an fp32 copy of the input, normalises it into a second fp32 tensor and
casts that back, forward and backward; on the H200 that round trip was about 3.8 of
the 8 ms that the triangle-attention module spent outside the attention core at
N=1024 (docs/benchmarks.md, "Attention modules"). fp32 inputs keep OF3's LayerNorm.

Transitions that compute in fp32 (no autocast around them, fp32 input: OF3's
diffusion conditioning and the atom transformer in a bf16-mixed run) run OF3's own
math under activation checkpointing instead: the forward keeps only the inputs and
the backward recomputes the transition with OF3's fp32 GEMMs. The kernels take fp32
too, but with IEEE dots they run on CUDA cores; on the H200 they cost 1.7 s more per
384-token training step than OF3's GEMMs (docs/benchmarks.md, "Full training step").
A ``SwiGLUTransition`` whose fp32 hidden activations exceed
:data:`RECOMPUTE_CHUNK_BYTES` is recomputed in chunks of its dim -3 (rows of the pair
representation), each chunk under its own checkpoint, so its backward holds one
chunk's hidden activations at a time. OF3 trains its confidence head in fp32: at 1472
tokens that head's pair transition held about 30 GiB in its backward, the training
step's memory peak.
"""

from __future__ import annotations

from typing import Any

from of3_megafold import registry
from of3_megafold.kernels.backend import runs_on, triton_backend

NAME = "evofusion_transitions"
FLAG = "use_evofusion_transitions"


def _enabled(module: Any) -> bool:
    return registry.module_enabled(module, NAME, FLAG)


def _has_bias(*linears) -> bool:
    return any(linear.bias is not None for linear in linears)


def _path(module: Any, x) -> str:
    """``"kernel"`` (the key on, OF3's bias-free Linears, 16-bit compute, a tensor
    the kernels take), ``"recompute"`` (the key on, fp32 compute, gradients wanted:
    OF3's math under activation checkpointing, see above) or ``"of3"``."""
    swiglu = module.swiglu
    if not _enabled(module) or _has_bias(
        swiglu.linear_a, swiglu.linear_b, module.linear_out
    ):
        return "of3"  # before the imports: key-off calls stay as cheap as OF3's
    import torch

    from of3_megafold.kernels.swiglu_transition import compute_dtype

    if compute_dtype(x) == torch.float32:
        return "recompute" if torch.is_grad_enabled() else "of3"
    if not runs_on(x):  # CPU tensors on a GPU machine
        registry.log_device_fallback(NAME, x.device.type)
        return "of3"
    return "kernel"


# Most fp32 hidden activations (``[rows, n*c]``, one of SwiGLU's two halves) that
# one checkpointed chunk of a recomputed SwiGLUTransition may produce.
RECOMPUTE_CHUNK_BYTES = 256 * 2**20


def _recomputed(original, *args):
    """``original(*args)`` keeping only its inputs for the backward."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(original, *args, use_reentrant=False)


def _recompute_step(module: Any, x) -> int | None:
    """Slices of ``x``'s dim -3 per checkpointed chunk of ``module``'s recomputed
    transition, or None for one checkpoint over all of ``x`` (at most
    :data:`RECOMPUTE_CHUNK_BYTES` of hidden activations, fewer than 3 dims, or
    empty)."""
    if x.dim() < 3 or x.numel() == 0:
        return None
    rows_per_slice = x.numel() // (x.shape[-1] * x.shape[-3])
    slice_bytes = rows_per_slice * module.swiglu.linear_a.out_features * 4  # fp32
    if slice_bytes * x.shape[-3] <= RECOMPUTE_CHUNK_BYTES:
        return None
    return max(1, RECOMPUTE_CHUNK_BYTES // slice_bytes)


def _recomputed_in_chunks(original, module: Any, x, mask):
    """``original(module, x, mask)`` (x ``[*, A, R, c]``, mask broadcastable to
    ``[*, A, R, 1]``) keeping only its inputs for the backward, as checkpointed
    chunks of dim -3 when one would hold more than :data:`RECOMPUTE_CHUNK_BYTES` of
    hidden activations: the backward then recomputes and differentiates one chunk
    at a time. Per row the math is OF3's; the weights' gradients are sums over the
    chunks."""
    import torch

    step = _recompute_step(module, x)
    rows = (*x.shape[:-1], 1)
    if step is None or torch.broadcast_shapes(mask.shape, rows) != rows:
        return _recomputed(original, module, x, mask)
    masks = mask.expand(*x.shape[:-1], mask.shape[-1]).split(step, dim=-3)
    chunks = [
        _recomputed(original, module, xs, ms)
        for xs, ms in zip(x.split(step, dim=-3), masks, strict=True)
    ]
    return torch.cat(chunks, dim=-3)


def _patch_swiglu_transition(original):
    def _transition(self, x, mask):
        path = _path(self, x)
        if path == "of3":
            return original(self, x, mask)
        if path == "recompute":
            return _recomputed_in_chunks(original, self, x, mask)
        from of3_megafold.kernels.swiglu_transition import swiglu_transition

        swiglu, norm = self.swiglu, self.layer_norm
        return swiglu_transition(
            x,
            norm.weight,
            norm.bias,
            swiglu.linear_a.weight,
            swiglu.linear_b.weight,
            self.linear_out.weight,
            mask,
            eps=norm.eps,
        )

    return _transition


def _patch_conditioned_transition(original):
    def _transition(self, a, s, mask):
        path = _path(self, a)
        if path == "of3":
            return original(self, a, s, mask)
        if path == "recompute":
            return _recomputed(original, self, a, s, mask)
        from of3_megafold.kernels.swiglu_transition import swiglu_mlp

        swiglu = self.swiglu
        b = swiglu_mlp(
            self.layer_norm(a, s),
            swiglu.linear_a.weight,
            swiglu.linear_b.weight,
            self.linear_out.weight,
        )
        return self.sigmoid(self.linear_g(s)) * b * mask

    return _transition


def _patch_layer_norm(original):
    def forward(self, x):
        if _enabled(self):
            from of3_megafold.kernels.layer_norm import function as kernels

            if kernels.supports(x):
                return kernels.layer_norm(x, self.weight, self.bias, self.eps)
            if x.dtype in kernels.DTYPES and not runs_on(x):
                registry.log_device_fallback(NAME, x.device.type)
        return original(self, x)

    return forward


_TRANSITION = "openfold3.core.model.layers.transition"

EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="fused LayerNorm + SwiGLU + output Linear in every SwiGLU transition (and "
        "SwiGLU + output Linear after AdaLN in conditioned transitions); hidden "
        "activations recomputed, not stored. Also OF3's LayerNorm on 16-bit "
        "activations without its fp32 copies.",
        summary="Fused LayerNorm + SwiGLU + output Linear transitions that "
        "recompute their wide hidden activations; 16-bit LayerNorms without fp32 "
        "copies",
        requires=("triton",),
        device_check=triton_backend,
        patches=(
            registry.Patch(
                f"{_TRANSITION}:SwiGLUTransition._transition",
                _patch_swiglu_transition,
            ),
            registry.Patch(
                f"{_TRANSITION}:ConditionedTransitionBlock._transition",
                _patch_conditioned_transition,
            ),
            registry.Patch(
                "openfold3.core.model.primitives.normalization:LayerNorm.forward",
                _patch_layer_norm,
            ),
        ),
    )
)
