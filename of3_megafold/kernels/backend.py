"""Can Triton kernels run here? Shared by every Triton-backed extension.

Kernels run on a CUDA GPU of compute capability 8.0 or newer (Ampere, Hopper, ...),
or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``, slow: tests and
small shapes only). The interpreter flag is read when a kernel is defined, so it must
be set before the kit's kernel modules are imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_CAPABILITY = (8, 0)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU
    (the values Triton itself reads as true)."""
    value = os.environ.get("TRITON_INTERPRET", "0").lower()
    return value in ("1", "true", "yes", "on", "y")


def runs_on(t: torch.Tensor) -> bool:
    """Whether the kernels can take ``t``: a CUDA tensor, or a CPU tensor under the
    interpreter. On a GPU machine without the interpreter, CPU tensors cannot (OF3's
    CPU tests and CPU inference run there too): callers fall back to OF3's path."""
    return t.is_cuda or (interpreter_enabled() and t.device.type == "cpu")


@contextlib.contextmanager
def cuda_tf32(enabled: bool):
    """Context in which torch's CUDA fp32 matmuls use TF32 iff ``enabled``
    (``torch.backends.cuda.matmul.allow_tf32``), restored on exit."""
    import torch

    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = previous


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (plain Python: recent Triton wraps its own
    ``triton.cdiv`` for use inside kernels, which costs microseconds per call on
    the host, and launchers call it several times per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1), in plain Python (see :func:`cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def multiprocessors(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (launchers size persistent and
    split grids by it; under the interpreter they pick a small stand-in instead)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Context that makes ``t``'s CUDA device the current one (Triton launches on
    the current device); does nothing for CPU tensors."""
    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def cuda_device(without: str) -> tuple[bool, str]:
    """``(ok, reason)`` for what needs a CUDA device itself (not the Triton
    interpreter): ``without`` says, when there is none, why and what runs instead."""
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA device; {without}"
    return True, f"CUDA: {torch.cuda.get_device_name()}"


def triton_backend() -> tuple[bool, str]:
    """``(ok, reason)``: whether the kit's Triton kernels can run in this process."""
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed; pip install triton (Linux)"
    if interpreter_enabled():
        return True, "Triton interpreter on the CPU (TRITON_INTERPRET=1; slow)"
    import torch

    if not torch.cuda.is_available():
        return False, (
            "no CUDA device; run on a GPU of compute capability >= 8.0, or set "
            "TRITON_INTERPRET=1 before starting Python to run the kernels on the "
            "CPU (slow)"
        )
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) < MIN_CAPABILITY:
        return False, (
            f"{name} has compute capability {major}.{minor}; the kernels need "
            f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
        )
    return True, f"CUDA: {name} (sm_{major}{minor})"
