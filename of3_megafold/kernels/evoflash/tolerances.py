"""Accuracy contract of EvoFlash, used by its tests.

A kernel result ``x`` passes against the float64 reference ``x64`` if

    max|x - x64| <= FACTOR * max|x_torch - x64| + FLOOR[kind][grad] * max|x64|

where ``x_torch`` is plain torch (``evoflash_attention_reference``) in the same
precision: the input dtype, tf32 matmuls for fp32 inputs on a GPU, fp32 for
``high_precision``. The floor is relative, about one or two ulps of the output
dtype, for outputs where torch happens to be exact.

Gradients get twice the forward floor: the backward rounds P and dS to the input
dtype before its dots and sums S x N products per bias element, where torch keeps
the fp32/bf16 autograd of the full logits.
"""

FACTOR = 2.0

FLOOR = {
    # kind: (forward, backward) relative floors
    "fp32": (2e-6, 4e-6),  # exact fp32 dots (high precision, or the interpreter)
    "tf32": (2e-3, 4e-3),  # fp32 inputs on tensor cores: 10-bit mantissa products
    "bf16": (4e-3, 8e-3),
    "fp16": (1e-3, 2e-3),
}
