"""The demo runner YAML and two real OF3 training steps on the demo set (CPU)."""

import csv
import math
import os

import pytest

from of3_megafold.demo.build import demo_dataset_paths
from of3_megafold.demo.train import (
    ALWAYS_REPORTED_LOSSES,
    DEFAULT_RUNNER_YAML,
    is_loss_key,
    loss_problems,
    resolve_runner_yaml,
    run_demo_training,
)


def test_demo_yaml_validates_and_builds_the_small_model(demo_dataset, tmp_path):
    from openfold3.entry_points.validator import TrainingExperimentConfig
    from openfold3.projects.of3_all_atom.project_entry import OF3ProjectEntry

    assert "${OF3_MEGAFOLD_DEMO}" in DEFAULT_RUNNER_YAML.read_text()
    runner = resolve_runner_yaml(
        None, demo_dataset, tmp_path, steps=3, accelerator="cpu", seed=7
    )
    config = TrainingExperimentConfig.model_validate(runner)

    assert runner["dataset_paths"]["demo"] == demo_dataset_paths(demo_dataset.resolve())
    assert config.experiment_settings.output_dir == tmp_path.resolve()
    assert config.pl_trainer_args.accelerator == "cpu"
    assert config.pl_trainer_args.precision == "32-true"
    assert config.data_module_args.epoch_len == 3
    assert config.data_module_args.data_seed == 7
    assert (
        runner["dataset_configs"]["train"]["demo"]["config"]["crop"]["token_crop"][
            "token_budget"
        ]
        == 48
    )

    model = OF3ProjectEntry().get_model_config_with_update(config.model_update)
    arch = model.architecture
    assert (arch.shared.c_s, arch.shared.c_z) == (32, 16)
    assert arch.pairformer.c_s == 32  # the width reached every stack
    assert arch.shared.diffusion.no_samples == 2
    assert arch.loss_module.diffusion.chunk_size is None
    assert arch.msa.msa_module.no_blocks >= 2
    assert arch.pairformer.no_blocks <= 2


def test_unavailable_gpu_is_refused(demo_dataset, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from of3_megafold.errors import KitError

    with pytest.raises(KitError, match="no CUDA device"):
        resolve_runner_yaml(None, demo_dataset, tmp_path, accelerator="gpu")


def test_loss_keys_are_told_from_metrics():
    assert is_loss_key("train/loss")
    assert is_loss_key("train/smooth_lddt_loss")
    assert not is_loss_key("train/lddt_intra_protein_step")
    assert not is_loss_key("step")


def _healthy_row(step):
    return {"step": step, "pdb_id": "1ubq", "sampled": "1", "seconds": 1.0} | {
        name: 1.5 for name in ALWAYS_REPORTED_LOSSES
    }


def test_loss_check_flags_the_permutation_fallback_record():
    assert loss_problems([_healthy_row(1), _healthy_row(2)]) == []
    # What OF3 logs after "Critical error in permutation alignment, turning off
    # losses": every weight is zero, so only the total is reported, as 0.
    fallback = {"step": 2, "pdb_id": "1ubq", "sampled": "1", "seconds": 1.0}
    fallback["loss"] = 0.0
    assert loss_problems([_healthy_row(1), fallback])
    assert loss_problems([_healthy_row(1) | {"mse_loss": math.nan}])
    assert loss_problems([])


def test_two_training_steps_on_cpu_train_on_every_loss(demo_dataset, tmp_path):
    result = run_demo_training(
        None,
        tmp_path / "run",
        steps=2,
        accelerator="cpu",
        dataset_dir=demo_dataset,
        progress=False,
    )

    assert result["steps"] == 2
    assert result["loss_problems"] == [], result["losses"]
    for row in result["losses"]:
        reported = {k: v for k, v in row.items() if is_loss_key(f"train/{k}")}
        assert set(ALWAYS_REPORTED_LOSSES) <= set(reported)
        assert all(math.isfinite(v) and v != 0.0 for v in reported.values()), row

    assert result["checkpoint"] is not None and result["checkpoint"].is_file()
    assert result["losses_png"].stat().st_size > 0
    with open(result["losses_csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(float(r["loss"]) > 0 for r in rows)
    assert (tmp_path / "run" / "runner.yml").is_file()


def test_a_run_with_losses_switched_off_fails_the_check(
    demo_dataset, tmp_path, monkeypatch
):
    """Force OF3's permutation-alignment fallback; the loss check must catch it."""
    from openfold3.core.utils import permutation_alignment

    def broken_alignment(*args, **kwargs):
        raise RuntimeError("alignment broken on purpose")

    monkeypatch.setattr(
        permutation_alignment, "multi_chain_permutation_alignment", broken_alignment
    )
    monkeypatch.setattr(permutation_alignment, "naive_alignment", broken_alignment)

    result = run_demo_training(
        None,
        tmp_path / "run",
        steps=1,
        accelerator="cpu",
        dataset_dir=demo_dataset,
        progress=False,
    )
    assert result["steps"] == 1
    assert result["loss_problems"]
    assert result["final_losses"] == {"loss": 0.0}


def test_data_seed_overrides_the_seed_for_the_data(demo_dataset, tmp_path):
    runner = resolve_runner_yaml(
        None, demo_dataset, tmp_path, accelerator="cpu", seed=7, data_seed=11
    )
    assert runner["experiment_settings"]["seed"] == 7
    assert runner["data_module_args"]["data_seed"] == 11


LOSS_COLUMNS_SKIPPED = ("seconds",)  # wall time: the one column that may differ


@pytest.fixture(scope="module")
def two_cli_runs(demo_dataset, tmp_path_factory):
    """``of3-megafold train --steps 3`` (the demo as a user runs it, CPU) twice into
    the same output folder, with the same seed: stdout, exit status, and the loss
    CSV and checkpoint folder after each run."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo-cli") / "run"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # as a user's
    env |= {"OF3_MEGAFOLD_CACHE": str(demo_dataset.parent), "CUDA_VISIBLE_DEVICES": ""}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "of3_megafold.cli", "train", "--steps", "3",
             "--output-dir", str(out)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        runs.append(
            {
                "returncode": done.returncode,
                "stdout": done.stdout,
                "stderr": done.stderr,
                "losses": (out / "losses.csv").read_text().splitlines()
                if done.returncode == 0
                else None,
                "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir())
                if done.returncode == 0
                else None,
            }
        )
    return runs


def _without_wall_time(lines: list[str]) -> list[list[str]]:
    rows = list(csv.reader(lines))
    keep = [i for i, name in enumerate(rows[0]) if name not in LOSS_COLUMNS_SKIPPED]
    return [[row[i] for i in keep] for row in rows]


def test_the_demo_command_trains_and_keeps_stdout_clean(two_cli_runs):
    first = two_cli_runs[0]
    assert first["returncode"] == 0, first["stderr"][-3000:]
    assert "Demo training: 3 steps" in first["stdout"]
    assert "Setting accelerator" not in first["stdout"] + first["stderr"]
    assert len(first["losses"]) == 4  # header and three steps


def test_the_same_seed_gives_the_same_losses(two_cli_runs):
    first, second = two_cli_runs
    assert second["returncode"] == 0, second["stderr"][-3000:]
    assert _without_wall_time(first["losses"]) == _without_wall_time(second["losses"])


def test_a_rerun_replaces_its_checkpoints(two_cli_runs):
    first, second = two_cli_runs
    assert first["checkpoints"] == ["demo-step3.ckpt", "last.ckpt"]
    assert second["checkpoints"] == first["checkpoints"]  # no last-v1.ckpt


def test_a_previous_runs_checkpoints_are_cleared(demo_dataset, tmp_path):
    from of3_megafold.demo.train import CHECKPOINTS_DIR, _clear_checkpoints

    checkpoints = tmp_path / CHECKPOINTS_DIR
    checkpoints.mkdir()
    for name in ("demo-step20.ckpt", "last.ckpt", "notes.txt"):
        (checkpoints / name).write_text("")
    _clear_checkpoints(tmp_path)
    assert [p.name for p in checkpoints.iterdir()] == ["notes.txt"]


def test_a_failed_run_removes_only_the_folder_it_created(tmp_path):
    from of3_megafold.demo.train import CHECKPOINTS_DIR, removed_on_failure

    def fail_in(folder, checkpoint=False):
        with pytest.raises(RuntimeError), removed_on_failure(folder):
            (folder / "runner.yml").write_text("")
            if checkpoint:
                (folder / CHECKPOINTS_DIR).mkdir()
                (folder / CHECKPOINTS_DIR / "last.ckpt").write_text("")
            raise RuntimeError("training failed")

    fail_in(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    fail_in(tmp_path / "old")
    assert (tmp_path / "old" / "runner.yml").exists()  # not ours to delete
    fail_in(tmp_path / "trained", checkpoint=True)
    assert (tmp_path / "trained" / CHECKPOINTS_DIR / "last.ckpt").exists()
