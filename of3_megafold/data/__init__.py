"""EvoPipe: precomputed per-sample features and the dataset adapter that reads them.

- :mod:`.feature_store`: ``build_feature_store`` (``of3-megafold precompute``) and
  ``FeatureStore``;
- :mod:`.dataset`: ``EvoPipeWeightedPDBDataset``, registered into OF3's dataset
  registries by :func:`of3_megafold.activate`.

Unlike the model extensions of :mod:`of3_megafold.registry` (keys under
``model_update.custom``), EvoPipe is chosen in the runner YAML's dataset section;
:func:`info_row` describes it for ``of3-megafold info``.
"""

from __future__ import annotations

import importlib.util

NAME = "precomputed_features"
REQUIRES = ("openfold3", "biotite", "rdkit")


def info_row() -> dict:
    """EvoPipe's row of ``of3-megafold info`` (same fields as the extensions')."""
    missing = [p for p in REQUIRES if importlib.util.find_spec(p) is None]
    reason = f"missing Python packages: {', '.join(missing)}" if missing else ""
    return {
        "name": NAME,
        "summary": "EvoPipe: tokenized structures (and optionally a conformer pool) "
        "precomputed once by `of3-megafold precompute`; the dataset adapter runs "
        "only the random steps",
        "installed": not missing,
        "available": not missing,  # CPU-only data code: runs wherever it imports
        "reason": reason,
        "docs": "docs/extensions/precomputed_features.md",
        "keys": [
            {
                "yaml": "dataset_configs.<mode>.<name>.dataset_class",
                "default": "WeightedPDBDataset",
                "help": "EvoPipeWeightedPDBDataset reads a feature store",
            },
            {
                "yaml": "dataset_configs.<mode>.<name>.config.feature_store",
                "default": None,
                "help": "the store directory (of3-megafold precompute --out)",
            },
        ],
    }
