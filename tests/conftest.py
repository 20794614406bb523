"""Shared test set-up.

Without a CUDA device the Triton kernels run under the Triton interpreter on CPU.
The variable must be set before any ``@triton.jit`` function is defined, so it is
set here, before any test module imports the kit's kernels.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def interpreted_kernels():
    """Skip unless the kit's kernels take CPU tensors here. Without the interpreter
    (a GPU machine) CPU tensors take OF3's own path, so a kit-vs-OF3 comparison
    would compare OF3 with itself."""
    from of3_megafold.kernels.backend import runs_on

    if not runs_on(torch.empty(0)):
        pytest.skip("the kernels take CPU tensors only with TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    """A demo set built from the installed openfold3's test data, in a tmp dir, once
    per test session (the demo and EvoPipe tests share it)."""
    from of3_megafold.demo.build import ensure_demo_dataset

    return ensure_demo_dataset(tmp_path_factory.mktemp("demo-cache"), progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: two OpenMP threads on a 2-core
    machine shared with other jobs spin-wait into 10x slowdowns of small models."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
