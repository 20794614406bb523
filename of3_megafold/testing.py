"""pytest plugin: run OpenFold3's own test suite with the kit active.

Usage::

    pytest -p of3_megafold.testing --pyargs openfold3.tests --skip-ccd-update \\
        --of3-megafold-extensions=all   # or: evoflash_attention,smooth_lddt:fused

``--of3-megafold-extensions`` takes ``none`` (the default: kit active, nothing
forced, which must give the same results as stock OF3), ``all``, or a comma list of
extension names, each optionally ``name:variant``. The named extensions are forced on
wherever OF3 builds or calls the modules they replace. The Triton kernels need a CUDA
device or ``TRITON_INTERPRET=1``; without a GPU this plugin sets the interpreter
before any kernel is defined.

OF3 tests whose premise a forced extension changes on purpose are skipped with the
reason (:data:`SKIPPED_WHEN_FORCED`); everything else runs as OF3 wrote it.
"""

from __future__ import annotations

import os

import pytest

OPTION = "--of3-megafold-extensions"

# extension -> {OF3 test node id suffix: why it cannot hold with the extension forced}
SKIPPED_WHEN_FORCED = {
    "smooth_lddt": {
        "test_diffusion_loss.py::TestBondLossMemory::"
        "test_sparse_uses_less_or_equal_reserved_memory": (
            "compares the memory of OF3's dense bond_loss with its bond_loss_sparse; "
            "forced, bond_loss is the kit's bonded-pairs version, which reserves less "
            "than either (its value is what test_bond_loss and "
            "test_bond_loss_sparse_matches_dense check)"
        ),
    },
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("of3-megafold")
    group.addoption(
        OPTION,
        default="none",
        help="extensions to force on: none, all, or name[:variant],... "
        "(default: none; the kit is active but inert)",
    )


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from of3_megafold import activate

    choice = config.getoption(OPTION)
    activate(force=() if choice == "none" else choice)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    from of3_megafold import registry

    for name, tests in SKIPPED_WHEN_FORCED.items():
        if name not in registry.FORCED.variants:
            continue
        for item in items:
            test = item.nodeid.split("[")[0]
            for suffix, reason in tests.items():
                if test.endswith(suffix):
                    item.add_marker(pytest.mark.skip(
                        reason=f"of3-megafold, {name} forced: {reason}"))


def pytest_report_header(config: pytest.Config) -> str:
    from of3_megafold import registry

    forced = registry.FORCED.variants
    described = (
        ", ".join(f"{n}:{v}" if v else n for n, v in forced.items()) or "none forced"
    )
    return f"of3-megafold: active, {described}"
