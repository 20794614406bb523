"""The ``of3-megafold`` command line: info, and readable configuration errors."""

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from of3_megafold.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_info_lists_every_extension_and_its_keys():
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    for name in (
        "smooth_lddt",
        "evoflash_attention",
        "evofusion_transitions",
        "evofusion_triangle_multiplication",
        "rollout_graphs",
        "precomputed_features",
    ):
        assert name in result.output
    assert "EvoPipeWeightedPDBDataset" in result.output
    assert (
        "model_update.custom.architecture.loss_module.diffusion.smooth_lddt_backend"
        in (result.output)
    )


def test_info_json():
    result = CliRunner().invoke(main, ["info", "--json"])
    assert result.exit_code == 0
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert rows["smooth_lddt"]["installed"] is True
    assert rows["smooth_lddt"]["docs"] == "docs/extensions/smooth_lddt.md"
    assert isinstance(rows["evoflash_attention"]["available"], bool)


@pytest.fixture
def runner_yaml(tmp_path):
    """The demo runner YAML with its dataset paths pointing at empty stand-ins:
    enough for OF3's validator, which checks that paths exist."""
    demo = (ROOT / "runner_yamls" / "demo.yml").read_text()
    data = tmp_path / "data"
    for sub in ("alignments", "structure_files", "reference_mols"):
        (data / sub).mkdir(parents=True)
    (data / "dataset_cache.json").write_text("{}")
    (data / "components.cif").write_text("")
    text = demo.replace("${OF3_MEGAFOLD_DEMO}", str(data)).replace(
        "${OF3_MEGAFOLD_OUTPUT}", str(tmp_path / "out")
    )
    path = tmp_path / "runner.yml"
    path.write_text(text)
    return path


def _overlay(tmp_path, custom) -> Path:
    path = tmp_path / "overlay.yml"
    path.write_text(yaml.safe_dump({"model_update": {"custom": custom}}))
    return path


def _train_overlaid(runner_yaml, tmp_path, overlay: dict, *options):
    """``train --runner-yaml`` with ``overlay`` (a whole runner section, not only
    the kit's keys) written beside it and merged on top."""
    path = tmp_path / "overlay.yml"
    path.write_text(yaml.safe_dump(overlay))
    return CliRunner().invoke(
        main,
        ["train", "--runner-yaml", str(runner_yaml), "--overlay", str(path), *options],
    )


def test_bad_kit_value_is_one_readable_error(runner_yaml, tmp_path):
    overlay = _overlay(
        tmp_path,
        {
            "architecture": {
                "loss_module": {"diffusion": {"smooth_lddt_backend": "bal_query"}}
            }
        },
    )
    result = CliRunner().invoke(
        main, ["train", "--runner-yaml", str(runner_yaml), "--overlay", str(overlay)]
    )
    assert result.exit_code == 1
    assert "smooth_lddt_backend" in result.output
    assert "'bal_query'" in result.output
    assert "'dense', 'ball_query', 'fused'" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_demo_checks_its_overlays_before_writing(tmp_path):
    """Without --runner-yaml (the demo) a bad kit value fails the same way, before
    the demo writes its runner YAML or builds its data set."""
    overlay = _overlay(
        tmp_path,
        {
            "architecture": {
                "loss_module": {"diffusion": {"smooth_lddt_backend": "nonsense"}}
            }
        },
    )
    out = tmp_path / "demo"
    result = CliRunner().invoke(
        main, ["train", "--overlay", str(overlay), "--output-dir", str(out)]
    )
    assert result.exit_code == 1, result.output
    assert "smooth_lddt_backend" in result.output and "'nonsense'" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def _one_error_line(output: str) -> str:
    """The ``Error:`` line of a failed command, checked to be its last line and
    the only one."""
    lines = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and output.rstrip().endswith(lines[0]), output
    assert "Traceback" not in output
    return lines[0]


def test_unknown_key_is_one_line_with_its_path(runner_yaml, tmp_path):
    """OF3's locked config refuses the key (as in OF3); the message names where it
    is in the YAML and OF3's guess, on one line."""
    overlay = _overlay(
        tmp_path, {"settings": {"memory": {"train": {"use_evoflash_attentoin": True}}}}
    )
    out = tmp_path / "out"
    for command in (
        ["train", "--runner-yaml", str(runner_yaml)],
        ["predict", "--runner-yaml", str(runner_yaml), "--sequence", "MKV"],
    ):
        result = CliRunner().invoke(
            main, [*command, "--overlay", str(overlay), "--output-dir", str(out)]
        )
        assert result.exit_code == 1, result.output
        assert _one_error_line(result.output) == (
            "Error: model_update.custom.settings.memory.train.use_evoflash_attentoin: "
            "no such key in OF3's model config; did you mean use_evoflash_attention?"
        )
        assert not out.exists()


def test_malformed_yaml_is_one_readable_error(runner_yaml, tmp_path):
    overlay = tmp_path / "broken.yml"
    overlay.write_text("model_update: [1, 2\n")
    for args in (
        ["--runner-yaml", str(overlay)],
        ["--runner-yaml", str(runner_yaml), "--overlay", str(overlay)],
    ):
        result = CliRunner().invoke(main, ["train", *args])
        assert result.exit_code == 1, result.output
        line = _one_error_line(result.output)
        assert line.startswith(f"Error: {overlay}, line 2, column 1: YAML could not")
        assert "expected ',' or ']'" in line
    assert not (tmp_path / "out").exists()


def test_invalid_runner_field_is_one_line(runner_yaml, tmp_path):
    """OF3's pydantic validation: each field's path, the problem and the value."""
    out = tmp_path / "out"
    result = _train_overlaid(
        runner_yaml,
        tmp_path,
        {
            "data_module_args": {"batch_size": "two"},
            "experiment_settings": {"seed": "x"},
        },
        "--output-dir",
        str(out),
    )
    assert result.exit_code == 1, result.output
    line = _one_error_line(result.output)
    assert line.startswith("Error: runner YAML is not valid: ")
    assert "data_module_args.batch_size: Input should be a valid integer" in line
    assert "(got 'two')" in line and "experiment_settings.seed: " in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("update", "options", "expected"),
    [
        (
            {"experiment_settings": "x"},
            [],
            "Error: runner YAML is not valid: experiment_settings: ",
        ),
        (
            {"experiment_settings": "x"},
            ["--output-dir", "out"],
            "Error: experiment_settings: must be a mapping of options (got 'x')",
        ),
        (
            {"experiment_settings": {"output_dir": 5}},
            [],
            "Error: runner YAML is not valid: experiment_settings.output_dir: ",
        ),
        (
            {"model_update": {"custom": 5}},
            [],
            "Error: runner YAML is not valid: model_update.custom: Input should be "
            "a valid dictionary (got 5)",
        ),
    ],
    ids=["section-not-a-mapping", "option-into-it", "folder-not-a-path", "model"],
)
def test_misshapen_sections_are_one_line(
    runner_yaml, tmp_path, update, options, expected
):
    """A section or value of the wrong type, whether OF3's validator or a
    command-line option meets it first: one line with its path, never a
    traceback."""
    result = _train_overlaid(runner_yaml, tmp_path, update, *options)
    assert result.exit_code == 1, result.output
    assert _one_error_line(result.output).startswith(expected), result.output


def test_refused_yaml_keeps_an_existing_output_folder(runner_yaml, tmp_path):
    """Only a folder made for the refused run is removed: one that was there
    before stays, with what it holds."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("earlier run")
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (out, empty):
        result = _train_overlaid(
            runner_yaml,
            tmp_path,
            {"data_module_args": {"batch_size": "two"}},
            "--output-dir",
            str(folder),
        )
        assert result.exit_code == 1, result.output
        assert folder.is_dir()
    assert (out / "kept.txt").read_text() == "earlier run"


def _model_config(runner: dict):
    """The model config a runner dict asks for, built as OF3's runner builds it."""
    from openfold3.entry_points.validator import TrainingExperimentConfig
    from openfold3.projects.of3_all_atom.project_entry import OF3ProjectEntry

    expt = TrainingExperimentConfig.model_validate(runner)
    config = OF3ProjectEntry().get_model_config_with_presets(expt.model_update.presets)
    config.update(expt.model_update.custom)
    return config


def test_every_overlay_in_runner_yamls_validates(runner_yaml):
    """Each shipped overlay merges into a runner and passes OF3's and the kit's
    checks (availability aside: the kernels need a GPU or the interpreter)."""
    from openfold3.core.config import config_utils

    from of3_megafold import activate, registry

    activate()
    # Whole runners (demo.yml, demo_predict.yml, train_full.yml) are not overlays.
    overlays = sorted(
        p
        for p in (ROOT / "runner_yamls").glob("*.yml")
        if "experiment_settings" not in config_utils.load_yaml(p)
    )
    assert len(overlays) >= 4
    for overlay in overlays:
        runner = config_utils.load_yaml(runner_yaml)
        config_utils.deep_update(runner, config_utils.load_yaml(overlay))
        config = _model_config(runner)
        for extension in registry.EXTENSIONS.values():
            extension.check_config(config)
        if overlay.name == "all_on.yml":
            # sequence_parallel needs several devices: not part of all_on.
            assert all(
                e.requested(config)
                for e in registry.EXTENSIONS.values()
                if e.name != "sequence_parallel"
            )


def test_demo_yaml_needs_the_kit_for_its_keys(runner_yaml):
    """docs/demo.md: the resolved demo YAML runs with ``of3-megafold train``; stock
    OF3 rejects it (its locked config has no kit keys)."""
    from openfold3.core.config import config_utils

    from of3_megafold import activate, deactivate

    runner = config_utils.load_yaml(runner_yaml)
    deactivate()
    try:
        with pytest.raises(KeyError, match="locked"):
            _model_config(runner)
    finally:
        activate()
    config = _model_config(runner)
    assert config.settings.memory.train.use_evoflash_attention is False


def test_bench_lists_every_benchmark_and_step_options():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    for name in ("attention", "smooth-lddt", "transition", "step"):
        assert name in result.output
    step_help = CliRunner().invoke(main, ["bench", "step", "--help"])
    assert step_help.exit_code == 0
    assert "--max-crop" in step_help.output and "--provider" in step_help.output


def test_every_extension_names_an_existing_docs_page():
    for row in json.loads(CliRunner().invoke(main, ["info", "--json"]).output):
        assert (ROOT / row["docs"]).is_file(), row["name"]


@pytest.mark.parametrize("case", ["regular file", "under a regular file", "/proc"])
def test_demo_with_an_unwritable_cache_is_one_error_and_writes_nothing(
    tmp_path, monkeypatch, case
):
    regular = tmp_path / "a-file"
    regular.write_text("")
    cache = {
        "regular file": regular,
        "under a regular file": regular / "cache",
        "/proc": Path("/proc/of3-megafold-cache"),
    }[case]
    monkeypatch.setenv("OF3_MEGAFOLD_CACHE", str(cache))
    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["train", "--output-dir", str(out)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert str(cache) in errors[0]
    assert "set OF3_MEGAFOLD_CACHE to a writable directory" in errors[0]
    assert "runner YAML" not in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


class _RecordingRunner:
    """Stands in for OF3's ``TrainingExperimentRunner``: keeps the config."""

    configs: list = []

    def __init__(self, config):
        self.configs.append(config)
        self.pl_trainer_args = config.pl_trainer_args  # as OF3's runner keeps it

    def setup(self):
        pass

    def run(self):
        pass


def test_steps_and_output_dir_apply_to_a_runner_yaml(
    runner_yaml, tmp_path, monkeypatch
):
    from openfold3.entry_points import experiment_runner

    monkeypatch.setattr(experiment_runner, "TrainingExperimentRunner", _RecordingRunner)
    _RecordingRunner.configs.clear()
    out = tmp_path / "elsewhere"
    args = ["train", "--runner-yaml", str(runner_yaml)]
    result = CliRunner().invoke(main, [*args, "--steps", "1", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    (config,) = _RecordingRunner.configs
    assert config.experiment_settings.output_dir == out
    assert config.pl_trainer_args.max_steps == 1
    assert config.pl_trainer_args.max_epochs == -1  # the steps decide, not epochs

    result = CliRunner().invoke(main, args)  # without them: the YAML's own
    assert result.exit_code == 0, result.output
    config = _RecordingRunner.configs[-1]
    assert config.experiment_settings.output_dir == tmp_path / "out"
    assert not hasattr(config.pl_trainer_args, "max_steps")

    refused = CliRunner().invoke(main, [*args, "--steps", "0"])
    assert refused.exit_code == 2 and "--steps" in refused.output


@pytest.mark.parametrize(
    "args", [["--help"], ["train", "--help"], ["predict", "--help"]]
)
def test_no_deepspeed_notice_on_stdout(args):
    """DeepSpeed announces "Setting accelerator to CPU" on stdout when it is
    imported on a machine without a GPU (OF3's predict imports it)."""
    import subprocess
    import sys

    # A CLI run in this process may have set DS_ACCELERATOR; a user's shell has not.
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = subprocess.run(
        [sys.executable, "-m", "of3_megafold.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    assert "Setting accelerator" not in result.stdout


def test_an_output_dir_that_cannot_be_created_is_one_error(
    demo_dataset, tmp_path, monkeypatch
):
    monkeypatch.setenv("OF3_MEGAFOLD_CACHE", str(demo_dataset.parent))
    regular = tmp_path / "a-file"
    regular.write_text("")
    result = CliRunner().invoke(main, ["train", "--output-dir", str(regular / "out")])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: cannot create the output folder {regular / 'out'}: {regular} is a "
        "regular file, not a directory; choose a writable --output-dir"
    ]
    assert "runner YAML" not in result.output
