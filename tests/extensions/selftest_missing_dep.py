"""A module that cannot be imported: it needs a package that is not installed
(as OF3's data pipeline does on a model-only install)."""

import of3_megafold_no_such_package  # noqa: F401


def compute(x):
    return x
