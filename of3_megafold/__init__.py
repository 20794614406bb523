"""of3-megafold: Triton kernels and patches that make OpenFold3 train faster.

Importing this package imports neither Triton nor DeepSpeed nor OpenFold3;
:func:`activate` does the work.
"""

__version__ = "0.1.0"
