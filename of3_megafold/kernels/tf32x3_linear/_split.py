"""The split kernel: one pass over an fp32 tensor writes its TF32 part and the
rest (``reference.split_tf32_reference``)."""

import triton
import triton.language as tl


@triton.jit
def _split_tf32_kernel(x_ptr, hi_ptr, lo_ptr, n, HALF: tl.constexpr,
                       MASK: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    bits = (x.to(tl.int32, bitcast=True) + HALF) & MASK
    hi = bits.to(tl.float32, bitcast=True)
    tl.store(hi_ptr + offsets, hi, mask=inside)
    tl.store(lo_ptr + offsets, x - hi, mask=inside)
