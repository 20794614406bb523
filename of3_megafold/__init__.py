"""of3-megafold: Triton kernels and patches that make OpenFold3 train faster.

Importing this package imports neither Triton nor DeepSpeed nor OpenFold3;
:func:`activate` registers the kit's runner-YAML keys and patches into OpenFold3.
"""

from of3_megafold.activation import activate, deactivate, is_active

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "is_active"]
