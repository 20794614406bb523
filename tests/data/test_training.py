"""OF3's own training loop on EvoPipe's dataset adapter (demo set, CPU, 2 steps)."""

import yaml

from of3_megafold.data.feature_store import build_feature_store
from of3_megafold.demo.build import demo_dataset_paths
from of3_megafold.demo.train import DEFAULT_RUNNER_YAML, run_demo_training


def _evopipe_yaml(demo_dataset, tmp_path, **build_options):
    """demo.yml on EvoPipe's dataset adapter, over a store built from the demo set."""
    paths = demo_dataset_paths(demo_dataset)
    store = build_feature_store(
        paths["dataset_cache_file"],
        paths["target_structures_directory"],
        tmp_path / "store",
        reference_mol_dir=paths["reference_molecule_directory"],
        progress=False,
        **build_options,
    )
    stock_line = "      dataset_class: WeightedPDBDataset\n"
    text = DEFAULT_RUNNER_YAML.read_text()
    assert text.count(stock_line) == 1
    text = text.replace(
        stock_line,
        "      dataset_class: EvoPipeWeightedPDBDataset\n",
    ).replace(
        "      config:\n        crop:",
        f"      config:\n        feature_store: {store}\n        crop:",
    )
    runner_yaml = tmp_path / "evopipe.yml"
    runner_yaml.write_text(text)
    return runner_yaml, store


def test_two_training_steps_read_the_feature_store(demo_dataset, tmp_path):
    from of3_megafold import activate

    activate()  # registers EvoPipeWeightedPDBDataset, as the CLI does
    runner_yaml, _ = _evopipe_yaml(demo_dataset, tmp_path, conformers=2)

    # demo.yml loads samples in a data-loader worker (num_workers: 1): the adapter
    # must work there too.
    result = run_demo_training(
        runner_yaml,
        tmp_path / "run",
        steps=2,
        accelerator="cpu",
        dataset_dir=demo_dataset,
        progress=False,
    )
    assert "EvoPipeWeightedPDBDataset" in result["runner_yaml"].read_text()
    assert result["steps"] == 2
    assert result["loss_problems"] == [], result["losses"]


def test_an_entry_damaged_during_training_is_one_error_line(
    demo_dataset, tmp_path, monkeypatch
):
    """An entry that breaks after the dataset checked the store (here: the check
    is skipped) fails in a data-loader worker; the user sees the kit's line."""
    from click.testing import CliRunner

    from of3_megafold.cli import main
    from of3_megafold.data import feature_store
    from of3_megafold.demo.train import resolve_runner_yaml

    runner_yaml, store = _evopipe_yaml(demo_dataset, tmp_path)
    for entry in (store / "structures").iterdir():
        entry.write_bytes(entry.read_bytes()[:-1])
    resolved = resolve_runner_yaml(
        runner_yaml, demo_dataset, tmp_path / "run", accelerator="cpu"
    )
    runner_yaml.write_text(yaml.safe_dump(resolved))
    monkeypatch.setattr(feature_store, "verify_feature_store", lambda *a, **k: [])

    args = ["train", "--runner-yaml", str(runner_yaml), "--steps", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert errors[0].startswith("Error: entry ")
    assert f"of the feature store {store} is damaged" in errors[0]
    assert "bytes, the manifest says" in errors[0]
    assert "Traceback" not in result.output
