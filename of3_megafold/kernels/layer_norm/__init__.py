"""A LayerNorm for 16-bit activations with fp32 statistics, forward and backward in
Triton, without the fp32 copies of OF3's ``LayerNorm`` (see ``function``)."""

from .function import layer_norm
from .reference import layer_norm_reference

__all__ = ["layer_norm", "layer_norm_reference"]
