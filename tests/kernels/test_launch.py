"""TunedKernel: the autotuner's choice reused, heuristics applied, one entry per key."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from of3_megafold.kernels.backend import interpreter_enabled

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreter_enabled()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


@triton.jit
def _axpy_kernel(X, Y, n, alpha, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(X + offs)
        tl.store(Y + offs, x * alpha + 1.0)
    else:
        x = tl.load(X + offs, mask=offs < n)
        tl.store(Y + offs, x * alpha + 2.0, mask=offs < n)


def _kernels():
    """Fresh wrappers (each test gets its own autotuner cache)."""
    heuristic = triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})(
        _axpy_kernel
    )
    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(
        heuristic
    )
    return heuristic, tuned


def _run(kernel, x: torch.Tensor, alpha: float) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    kernel[lambda meta: (-(-n // meta["BLOCK"]),)](X=x, Y=y, n=n, alpha=alpha)
    return y


def _expected(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha + (1.0 if x.numel() % 16 == 0 else 2.0)


@pytest.mark.parametrize("autotuned", [True, False], ids=["autotune", "fixed"])
def test_launches_match_and_reuse_the_choice(autotuned, monkeypatch):
    from of3_megafold.kernels._launch import TunedKernel

    heuristic, tuned = _kernels()
    kernel = TunedKernel(tuned) if autotuned else TunedKernel(heuristic, {"BLOCK": 16})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = [
        torch.randn(n, device=device, dtype=dtype)
        for n, dtype in ((32, torch.float32), (17, torch.float32), (32, torch.float64))
    ]
    for x in inputs:  # first launch of each key: through Triton's wrappers
        torch.testing.assert_close(_run(kernel, x, 3.0), _expected(x, 3.0))
    # one entry per (autotuning key values, dtypes): n=32 fp32, n=17 fp32, n=32 fp64;
    # a fixed config has no key values: fp32, fp64 (EVEN still differs per launch)
    assert len(kernel._chosen) == (3 if autotuned else 2)

    def no_wrappers(*args, **kwargs):
        raise AssertionError("a tuned key went through Triton's wrappers again")

    monkeypatch.setattr(type(kernel._entry), "run", no_wrappers)
    for x in inputs:  # later launches: the JIT function, heuristics applied here
        torch.testing.assert_close(_run(kernel, x, -0.5), _expected(x, -0.5))
