"""``round_to(x, dtype)``: an fp32 tile converted to ``dtype`` the way the GPU does;
``dot(a, b)``: a 16-bit tensor-core product with fp32 accumulation, likewise.

The Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests; Triton 3.9's
``runtime/interpreter.py``) truncates fp32 -> bf16 instead of rounding to nearest
even, and its ``tl.dot`` multiplies bf16 operands' raw bit patterns as integers. Under
the interpreter ``round_to`` rounds with integer arithmetic first, so the (then exact)
conversion gives what a GPU gives, and ``dot`` widens its operands to fp32 (exact
products of the rounded inputs, as the tensor cores form them); on a GPU they are
``x.to(dtype)`` and ``tl.dot(a, b)``. The choice is made when this module is
imported, like every kernel's interpreter check.
"""

import triton
import triton.language as tl

from .backend import interpreter_enabled

if interpreter_enabled():

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def dot(a, b):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

else:

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """``x.to(dtype)``, rounding to nearest even."""
        return x.to(dtype)

    @triton.jit
    def dot(a, b):
        """``a @ b`` of 16-bit tiles, accumulated in fp32."""
        return tl.dot(a, b)
