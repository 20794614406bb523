"""Predict with the model the demo trained: the other half of the demo.

``of3-megafold predict`` with no ``--runner-yaml`` (and no OF3 checkpoint option)
runs OF3's inference (:func:`of3_megafold.inference.run_inference`) with

- the demo training's last checkpoint, ``<demo_dir>/checkpoints/last.ckpt``
  (``of3-megafold train`` writes it; ``demo_dir`` is its ``--output-dir``);
- the model settings that checkpoint was trained with: ``model_update.custom``
  of ``<demo_dir>/runner.yml``, under OF3's ``predict`` preset;
- ``runner_yamls/demo_predict.yml`` for the rest: query-only MSAs, no templates,
  the demo set's ``components.cif``, mmCIF and JSON outputs;
- one structure of the demo set as the query (:data:`DEFAULT_QUERY_ENTRY`), unless
  the user names one.

It writes under ``<demo_dir>/predict/``: ``<query>/seed_<seed>/`` with one
``*_model.cif``, ``*_confidences.json`` and ``*_confidences_aggregated.json`` per
diffusion sample, OF3's ``summary.txt``, ``experiment_config.json`` and
``model_config.json``, and ``runner.yml`` (the resolved inference YAML, reusable with
``of3-megafold predict --runner-yaml``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import yaml

from of3_megafold.demo.build import PREPROCESSING_METADATA_FILE, STRUCTURES_DIR
from of3_megafold.demo.train import (
    DATASET_PLACEHOLDER,
    OUTPUT_PLACEHOLDER,
    RESOLVED_YAML_NAME,
    resolve_device,
)
from of3_megafold.errors import KitConfigError, KitError

DEFAULT_PREDICT_YAML = (
    Path(__file__).resolve().parents[2] / "runner_yamls" / "demo_predict.yml"
)
"""``runner_yamls/demo_predict.yml`` of the kit's source tree."""

PREDICT_DIR_NAME = "predict"
RUNNER_COPY_NAME = "runner.yml"
CHECKPOINTS_DIR_NAME = "checkpoints"
LAST_CHECKPOINT_NAME = "last.ckpt"
"""Lightning's ``save_last`` file, which ``runner_yamls/demo.yml`` asks for."""

DEFAULT_QUERY_ENTRY = "1ubq"
"""The demo set's structure predicted by default: ubiquitin, one 76-residue chain."""

POLYMER_TYPES = ("PROTEIN", "RNA", "DNA")


class DemoCheckpointMissingError(KitError, FileNotFoundError):
    """The demo training has not been run (or not into this directory)."""


def demo_checkpoint(demo_dir: Path) -> tuple[Path, Path]:
    """The demo training's last checkpoint and its resolved runner YAML.

    Args:
        demo_dir: the demo training's output directory (``train --output-dir``).

    Returns:
        ``(<demo_dir>/checkpoints/last.ckpt, <demo_dir>/runner.yml)``.

    Raises:
        DemoCheckpointMissingError: either file is missing.
    """
    checkpoint = Path(demo_dir) / CHECKPOINTS_DIR_NAME / LAST_CHECKPOINT_NAME
    trained_yaml = Path(demo_dir) / RESOLVED_YAML_NAME
    for path in (checkpoint, trained_yaml):
        if not path.is_file():
            raise DemoCheckpointMissingError(
                f"{path} not found: no demo training in {demo_dir}. Run "
                "`of3-megafold train` first (or pass --demo-dir, the directory "
                "the demo training wrote to)."
            )
    return checkpoint, trained_yaml


def demo_predict_runner(
    trained_yaml: Path,
    dataset_dir: Path,
    output_dir: Path,
    *,
    accelerator: str = "auto",
    predict_yaml: Path | None = None,
) -> dict[str, Any]:
    """The inference runner dict for the demo's model.

    Fills ``runner_yamls/demo_predict.yml``'s placeholders (``${OF3_MEGAFOLD_DEMO}``:
    ``dataset_dir``, ``${OF3_MEGAFOLD_OUTPUT}``: ``output_dir``), sets the device
    and precision as the demo training does (:func:`resolve_device`), and takes
    ``model_update.custom`` from the trained run's YAML, so the model built is the
    one the checkpoint holds (its presets are replaced by the predict YAML's).

    Args:
        trained_yaml: the demo training's ``runner.yml``.
        dataset_dir: a built demo set (for ``components.cif``).
        output_dir: where predictions go.
        accelerator: ``auto``, ``cpu`` or ``gpu``.
        predict_yaml: the inference YAML; None for ``runner_yamls/demo_predict.yml``.

    Returns:
        A runner dict for OF3's ``InferenceExperimentConfig``.
    """
    path = Path(predict_yaml) if predict_yaml is not None else DEFAULT_PREDICT_YAML
    if not path.is_file():
        raise KitError(
            f"inference YAML {path} not found (the demo's lives in the kit's source "
            "tree, runner_yamls/demo_predict.yml)"
        )
    text = string.Template(path.read_text()).safe_substitute(
        {
            DATASET_PLACEHOLDER: str(Path(dataset_dir).resolve()),
            OUTPUT_PLACEHOLDER: str(Path(output_dir).resolve()),
        }
    )
    runner = yaml.safe_load(text)
    trained = yaml.safe_load(Path(trained_yaml).read_text())
    if not isinstance(runner, dict) or not isinstance(trained, dict):
        raise KitConfigError(f"{path} or {trained_yaml}: not a YAML mapping")

    device, precision = resolve_device(accelerator)
    trainer_args = runner.setdefault("pl_trainer_args", {})
    trainer_args["accelerator"] = device
    trainer_args["precision"] = precision
    model_update = runner.setdefault("model_update", {})
    model_update["custom"] = (trained.get("model_update") or {}).get("custom") or {}
    return runner


def entry_query(dataset_dir: Path, entry: str = DEFAULT_QUERY_ENTRY) -> dict:
    """An OF3 query for the polymer chains of one demo-set structure.

    Sequences come from OF3's preprocessing (``structure_files/<entry>/<entry>.fasta``),
    molecule types from its ``metadata.json``; chains with the same type and
    sequence become one entry with several chain ids, as in OF3's query format.
    Ligands are left out.

    Returns:
        ``{"queries": {entry: {"chains": [...]}}}``, for ``InferenceQuerySet``.
    """
    from openfold3.core.data.io.sequence.fasta import get_chain_id_to_seq_from_fasta

    dataset_dir = Path(dataset_dir)
    metadata = json.loads((dataset_dir / PREPROCESSING_METADATA_FILE).read_text())
    chains_meta = metadata["structure_data"].get(entry, {}).get("chains")
    if not chains_meta:
        raise KitError(f"{entry!r} is not a structure of the demo set {dataset_dir}")
    fasta = dataset_dir / STRUCTURES_DIR / entry / f"{entry}.fasta"
    chains: dict[tuple[str, str], list[str]] = {}
    for chain_id, sequence in get_chain_id_to_seq_from_fasta(fasta).items():
        molecule_type = chains_meta[chain_id]["molecule_type"]
        if molecule_type in POLYMER_TYPES:
            chains.setdefault((molecule_type, sequence), []).append(chain_id)
    return {
        "queries": {
            entry: {
                "chains": [
                    {
                        "molecule_type": molecule_type.lower(),
                        "chain_ids": chain_ids,
                        "sequence": sequence,
                    }
                    for (molecule_type, sequence), chain_ids in chains.items()
                ]
            }
        }
    }
