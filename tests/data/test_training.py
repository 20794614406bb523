"""OF3's own training loop on EvoPipe's dataset adapter (demo set, CPU, 2 steps)."""

from of3_megafold.data.feature_store import build_feature_store
from of3_megafold.demo.build import demo_dataset_paths
from of3_megafold.demo.train import DEFAULT_RUNNER_YAML, run_demo_training


def test_two_training_steps_read_the_feature_store(demo_dataset, tmp_path):
    from of3_megafold import activate

    activate()  # registers EvoPipeWeightedPDBDataset, as the CLI does
    paths = demo_dataset_paths(demo_dataset)
    store = build_feature_store(
        paths["dataset_cache_file"],
        paths["target_structures_directory"],
        tmp_path / "store",
        conformers=2,
        reference_mol_dir=paths["reference_molecule_directory"],
        progress=False,
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
