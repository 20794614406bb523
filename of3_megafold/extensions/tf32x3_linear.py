"""TF32x3 linear: OF3's fp32 ``Linear`` layers at fp32 accuracy on TF32 tensor cores.

Keys: ``model_update.custom.settings.memory.{train,eval}.use_tf32x3_linear``
(default false).

OF3 runs the diffusion module (the rollout and the training diffusion), the
confidence heads in training and a few other layers in fp32: under
``autocast(dtype=float32)`` or with a ``Linear`` of ``precision=torch.float32``. With
torch's default float32 matmul precision ("highest", which OF3 keeps in training)
those GEMMs run on the GPU's CUDA cores, about 7x slower than its TF32 tensor cores,
and they are the largest item of a kit step's GPU time after attention at 768 tokens
(docs/benchmarks.md). TF32 itself keeps 10 mantissa bits and drifts the diffusion
rollout (about 1 A); 3xTF32 (:mod:`of3_megafold.kernels.tf32x3_linear`) keeps fp32's
accuracy in three TF32 GEMMs.

With a key on, an OF3 ``Linear`` whose GEMM would run in fp32 runs
:func:`~of3_megafold.kernels.tf32x3_linear.tf32x3_linear` instead, forward and
backward, when:

- its weight (and bias) are fp32 and its input is on a device the kernels run on;
- OF3's own forward would compute in fp32: ``precision=torch.float32``, or no
  ``precision``, an fp32 input and autocast off or at fp32 (a bf16 input, or autocast
  at bf16, keeps OF3's 16-bit GEMM);
- torch's float32 matmul precision is "highest": at "high" or "medium" the user has
  chosen TF32 or bf16 GEMMs, and OF3's call runs them;
- the GEMM has at least ``MIN_MNK`` multiply-adds (``M * N * K``) and its two
  weight dims are at least ``MIN_WIDTH``: a smaller GEMM is bound by its launch, a
  narrower one by memory, and there three GEMMs and the splits cost more than one.

Everything else runs OF3's forward. The result is OF3's to fp32 rounding, not
element for element (tests/kernels/test_tf32x3_linear.py).
"""

from __future__ import annotations

import torch

from of3_megafold import registry
from of3_megafold.kernels.backend import runs_on, triton_backend

NAME = "tf32x3_linear"
FLAG = "use_tf32x3_linear"

MIN_MNK = 2**28
"""Smallest GEMM (multiply-adds) the kit takes: 2^28 is ~8 us of fp32 CUDA-core work
on an H200 (67 TFLOP/s), where a launch costs ~3 us; OF3's diffusion-module GEMMs at
384 tokens and 48 samples (``[18432, 768] @ [768, 768]``) have 2^33.4."""

MIN_WIDTH = 256
"""Narrowest ``K`` and ``N`` the kit takes. The three GEMMs read their operand and
read and write the fp32 output once each, ~12 (3K + 6N) bytes per row; one fp32
CUDA-core GEMM computes 2 K N flops per row. At an H200's 4.8 TB/s and 67 TFLOP/s
the passes cost less than the arithmetic they save only where K = N > ~190: the
atom transformer's 128-wide GEMMs stay OF3's (``bench linear``'s ``atom`` case)."""


def fp32_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as the fp32 tensor OF3's ``Linear.forward`` multiplies, if that GEMM
    runs in fp32 and the kit takes it (the module docstring's rules); else None."""
    weight, bias = module.weight, module.bias
    if weight.dtype != torch.float32 or (
        bias is not None and bias.dtype != torch.float32
    ):
        return None
    if torch.get_float32_matmul_precision() != "highest":
        return None
    precision = getattr(module, "precision", None)
    if precision is None:
        device = x.device.type
        if x.dtype != torch.float32 or (
            torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) != torch.float32
        ):
            return None
    elif precision != torch.float32:
        return None
    n, k = weight.shape
    if min(n, k) < MIN_WIDTH or (x.numel() // k) * n * k < MIN_MNK:
        return None
    if not runs_on(x):  # CPU tensors on a GPU machine
        registry.log_device_fallback(NAME, x.device.type)
        return None
    return x.float()


def _patch_linear_forward(original):
    def forward(self, input):
        x = None
        if registry.module_enabled(self, NAME, FLAG):
            x = fp32_input(self, input)
        if x is None:
            return original(self, input)
        from of3_megafold.kernels.tf32x3_linear import tf32x3_linear

        return tf32x3_linear(x, self.weight, self.bias).to(input.dtype)

    return forward


EXTENSION = registry.register(
    registry.memory_flag_extension(
        NAME,
        FLAG,
        help="run OF3's large fp32 Linear GEMMs (the diffusion transformer's) as three "
        "TF32 tensor-core GEMMs of split operands (3xTF32): fp32 accuracy, not OF3's "
        "bits",
        summary="OF3's fp32 Linear GEMMs on TF32 tensor cores at fp32 accuracy "
        "(3xTF32)",
        device_check=triton_backend,
        patches=(
            registry.Patch(
                "openfold3.core.model.primitives.linear:Linear.forward",
                _patch_linear_forward,
            ),
        ),
    )
)
