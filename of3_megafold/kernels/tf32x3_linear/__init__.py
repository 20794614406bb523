"""An fp32 ``linear`` at fp32 accuracy on TF32 tensor cores (3xTF32), forward and
backward: each fp32 operand is split into a TF32 part and the rest, and three
TF32 products of the parts replace one fp32 product (see ``function``)."""

from .function import split_tf32, tf32x3_linear
from .reference import split_tf32_reference, tf32x3_linear_reference

__all__ = [
    "split_tf32",
    "split_tf32_reference",
    "tf32x3_linear",
    "tf32x3_linear_reference",
]
