"""EvoPipe's dataset adapter: OF3's ``WeightedPDBDataset`` reading a feature store.

Registered into OF3's dataset registries (by :func:`register`, which
:func:`of3_megafold.activate` calls) as ``EvoPipeWeightedPDBDataset``, with one
config field more than ``WeightedPDBDataset``::

    dataset_configs:
      train:
        pdb:
          dataset_class: EvoPipeWeightedPDBDataset
          weight: 1.0
          config:
            feature_store: /data/of3/feature_store   # of3-megafold precompute --out
            feature_store_verify: sizes   # or checksums (reads the whole store)

Building the dataset checks every entry of the store (sizes, or with
``feature_store_verify: checksums`` also SHA-256s), so a damaged store stops the run
before its first step. Each sample takes its tokenized structure from the store
instead of parsing and tokenizing it (see :mod:`of3_megafold.data.feature_store`)
and then runs OF3's own steps unchanged: cropping (random), reference conformers
(random), MSA and template sampling (random), featurization. Same random state,
same sample as ``WeightedPDBDataset``. A store built with a conformer pool (``precompute
--conformers P``) also replaces each fresh ETKDG conformer by one drawn from the
molecule's pool; molecules missing from the pool get a fresh one, as in OF3.
"""

from __future__ import annotations

import contextvars
import functools
from pathlib import Path
from typing import Any, Literal

DATASET_CLASS = "EvoPipeWeightedPDBDataset"

_ACTIVE_STORE: contextvars.ContextVar = contextvars.ContextVar(
    "of3_megafold_feature_store", default=None
)


def crop_stored_structure(
    atom_array: Any,
    crop_config: dict,
    preferred_chain_or_interface: str | list[str] | None,
):
    """The random tail of OF3's ``process_target_structure_of3`` on a tokenized
    structure: crop, token count, permutation labels, uniquified atom names.

    Returns OF3's ``ProcessedTargetStructure``.
    """
    import numpy as np
    from openfold3.core.data.pipelines.sample_processing.structure import (
        ProcessedTargetStructure,
    )
    from openfold3.core.data.primitives.permutation.mol_labels import (
        assign_mol_permutation_ids,
    )
    from openfold3.core.data.primitives.structure.cropping import (
        crop_chainwise_and_set_crop_mask,
    )
    from openfold3.core.data.primitives.structure.labels import (
        assign_uniquified_atom_names,
    )

    atom_array, crop_strategy = crop_chainwise_and_set_crop_mask(
        atom_array=atom_array,
        crop_config=crop_config,
        preferred_chain_or_interface=preferred_chain_or_interface,
    )
    token_crop = crop_config["token_crop"]
    if token_crop["enabled"]:
        n_tokens = token_crop["token_budget"]
    else:
        n_tokens = np.unique(atom_array.token_id).shape[0]
    atom_array = assign_mol_permutation_ids(atom_array, retokenize=True)
    atom_array = assign_uniquified_atom_names(atom_array)
    return ProcessedTargetStructure(
        atom_array_gt=atom_array, crop_strategy=crop_strategy, n_tokens=n_tokens
    )


def _dispatching(original):
    """OF3's ``process_target_structure_of3``, served from the active store inside
    an EvoPipe dataset's call and unchanged everywhere else."""

    @functools.wraps(original)
    def process_target_structure_of3(*args, **kwargs):
        store = _ACTIVE_STORE.get()
        if store is None:
            return original(*args, **kwargs)
        return crop_stored_structure(
            store.structure(kwargs["pdb_id"]),
            kwargs["crop_config"],
            kwargs["preferred_chain_or_interface"],
        )

    process_target_structure_of3.__wrapped__ = original
    process_target_structure_of3._of3_megafold_evopipe = True
    return process_target_structure_of3


def pooled_conformer(pool: Any, mol: Any):
    """OF3's ``ConformerResult`` for ``mol`` with a conformer drawn from ``pool``
    (a :class:`~of3_megafold.data.feature_store.ConformerPool` of this molecule)."""
    import random

    from openfold3.core.data.primitives.structure.conformer import (
        ConformerGenerationError,
        ConformerResult,
    )
    from rdkit import Chem
    from rdkit.Geometry import Point3D

    from of3_megafold.data.feature_store import atom_names

    index = random.randrange(len(pool.strategies))
    strategy = pool.strategies[index]
    if strategy is None:  # this generation failed at build time: OF3's fallback
        raise ConformerGenerationError("pooled conformer generation had failed")
    where = {name: i for i, name in enumerate(pool.names)}
    out = Chem.Mol(mol)
    out.RemoveAllConformers()
    conformer = Chem.Conformer(out.GetNumAtoms())
    for atom_index, name in enumerate(atom_names(mol)):
        x, y, z = (float(v) for v in pool.coords[index, where[name]])
        conformer.SetAtomPosition(atom_index, Point3D(x, y, z))
    conf_id = out.AddConformer(conformer, assignId=True)
    return ConformerResult(mol=out, conf_id=conf_id, strategy=strategy)


def _conformer_dispatching(original):
    """OF3's ``multistrategy_compute_conformer``, drawing from the active store's
    conformer pool inside an EvoPipe dataset's call (when the store has one and
    knows the molecule) and unchanged everywhere else."""
    from of3_megafold.data.feature_store import conformer_key

    @functools.wraps(original)
    def multistrategy_compute_conformer(mol, *args, **kwargs):
        store = _ACTIVE_STORE.get()
        if store is not None and store.pools:
            pool = store.pools.get(conformer_key(mol))
            if pool is not None:
                return pooled_conformer(pool, mol)
        return original(mol, *args, **kwargs)

    multistrategy_compute_conformer.__wrapped__ = original
    multistrategy_compute_conformer._of3_megafold_evopipe = True
    return multistrategy_compute_conformer


def _install_dispatch() -> None:
    """Route OF3's structure step and conformer generation through the dispatchers
    above (once per process; also in data-loader workers, which may not have run
    ``activate``)."""
    from openfold3.core.data.framework.single_datasets import base_of3
    from openfold3.core.data.pipelines.sample_processing import conformer

    for module, name, make in (
        (base_of3, "process_target_structure_of3", _dispatching),
        (conformer, "multistrategy_compute_conformer", _conformer_dispatching),
    ):
        current = getattr(module, name)
        if not getattr(current, "_of3_megafold_evopipe", False):
            setattr(module, name, make(current))


@functools.cache
def register() -> None:
    """Add ``EvoPipeWeightedPDBDataset`` and its config to OF3's registries."""
    from openfold3.core.data.framework.single_datasets.abstract_single import (
        register_dataset,
    )
    from openfold3.core.data.framework.single_datasets.pdb import WeightedPDBDataset
    from openfold3.projects.of3_all_atom.config.dataset_configs import (
        DatasetConfigRegistry,
        register_dataset_config,
    )

    from of3_megafold.data.feature_store import VERIFY_MODES, FeatureStore

    parent_config = DatasetConfigRegistry.get("WeightedPDBDataset")

    class EvoPipeWeightedPDBConfig(parent_config):
        """``WeightedPDBDataset``'s config plus the feature store directory and
        how much of it to check when the dataset is built (``sizes`` of every
        entry, or also their ``checksums``)."""

        feature_store: Path
        feature_store_verify: Literal[VERIFY_MODES] = "sizes"

    # OF3's decorator registers and returns None: call it, keep the class.
    register_dataset_config(DATASET_CLASS)(EvoPipeWeightedPDBConfig)

    class EvoPipeWeightedPDBDataset(WeightedPDBDataset):
        """``WeightedPDBDataset`` whose tokenized structures come from a feature
        store (``config.feature_store``), checked against the dataset cache."""

        def __init__(self, dataset_config) -> None:
            super().__init__(dataset_config)
            self.feature_store = FeatureStore.open(
                dataset_config.feature_store,
                self._dataset_cache_file,
                verify=dataset_config.feature_store_verify,
            )

        def create_structure_features(self, pdb_id: str, *args, **kwargs):
            _install_dispatch()
            token = _ACTIVE_STORE.set(self.feature_store)
            try:
                return super().create_structure_features(pdb_id, *args, **kwargs)
            finally:
                _ACTIVE_STORE.reset(token)

    EvoPipeWeightedPDBDataset.__name__ = DATASET_CLASS
    EvoPipeWeightedPDBDataset.__qualname__ = DATASET_CLASS
    EvoPipeWeightedPDBDataset.__module__ = __name__
    globals()[DATASET_CLASS] = register_dataset(EvoPipeWeightedPDBDataset)
    globals()["EvoPipeWeightedPDBConfig"] = EvoPipeWeightedPDBConfig
    EvoPipeWeightedPDBConfig.__module__ = __name__


def training_dataset(
    dataset_paths: dict, dataset_class: str, token_budget: int, **config: Any
):
    """One OF3 training dataset built the way OF3's data module builds it from a
    runner YAML's ``dataset_configs.train.<name>`` (name ``demo``, weight 1.0):
    ``dataset_paths`` as in ``dataset_paths.<name>``, a token crop of
    ``token_budget``, ``config`` the other fields of its ``config`` section (e.g.
    ``feature_store``). Used by the tests and ``bench features``."""
    from openfold3.core.data.framework.single_datasets.abstract_single import (
        DATASET_REGISTRY,
    )
    from openfold3.projects.of3_all_atom.config.dataset_configs import (
        TrainingDatasetSpec,
    )

    register()
    spec = TrainingDatasetSpec.model_validate(
        {
            "name": "demo",
            "dataset_class": dataset_class,
            "mode": "train",
            "weight": 1.0,
            "config": {
                "crop": {"token_crop": {"token_budget": token_budget}},
                "dataset_paths": dataset_paths,
                **config,
            },
        }
    )
    return DATASET_REGISTRY[dataset_class](spec.config)


def __getattr__(name: str):
    # The classes exist once OF3 is importable; unpickling a dataset in a data-loader
    # worker looks them up here, so build them on first access.
    if name in (DATASET_CLASS, "EvoPipeWeightedPDBConfig"):
        register()
        return globals()[name]
    raise AttributeError(name)
