"""`of3-megafold`: OF3's own commands with the kit active, plus `info`, `bench`,
`precompute` and `test-of3`.

``train`` and ``predict`` take the same options as ``run_openfold train|predict``;
they call :func:`of3_megafold.activate` first, so the kit's keys in
``model_update.custom`` are honoured. ``train`` with no ``--runner-yaml`` runs the
demo on the embedded tiny data set. Configuration errors end with one readable
message and a non-zero exit status, not a traceback.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from contextlib import contextmanager
from pathlib import Path

import click

from of3_megafold.errors import KitError

BENCHMARKS = {
    "attention": ("attention_core", "attention_module"),
    "attention-core": ("attention_core",),
    "attention-module": ("attention_module",),
    "smooth-lddt": ("smooth_lddt",),
    "transition": ("transition",),
    "triangle-multiplication": ("triangle_multiplication",),
    "features": ("features",),
}
"""``of3-megafold bench <what>`` -> modules of ``of3_megafold.bench``, each with
``run(out_json, quick)`` writing ``<out-dir>/<module>.json``. ``bench step`` is the
training-step harness's own command (:func:`of3_megafold.bench.step.step_command`)."""


def _default_bench_dir() -> Path:
    """Where ``bench <module>`` appends rows unless told, as ``bench step`` does:
    :func:`~of3_megafold.bench.common.benchmark_dir` (imported here, not at the
    CLI's import: it imports torch)."""
    from of3_megafold.bench.common import benchmark_dir

    return benchmark_dir()


@contextmanager
def _user_errors():
    """Turn configuration mistakes into one readable message and exit status 1."""
    import pydantic
    import yaml

    try:
        yield
    except KitError as err:
        raise click.ClickException(str(err)) from err
    except yaml.YAMLError as err:  # the message names the file, line and column
        raise click.ClickException(f"YAML could not be parsed:\n{err}") from err
    except pydantic.ValidationError as err:
        raise click.ClickException(f"runner YAML is not valid:\n{err}") from err
    except (KeyError, TypeError, ValueError, FileNotFoundError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise click.ClickException(
            f"runner YAML could not be applied: {message}"
        ) from err


def _load_runner_yaml(path: Path, seed: int | None, data_seed: int | None) -> dict:
    from openfold3.core.config import config_utils

    with _user_errors():
        runner = config_utils.load_yaml(path)
        if not isinstance(runner, dict):
            raise click.ClickException(f"{path}: not a YAML mapping")
    if seed is not None:
        runner.setdefault("experiment_settings", {})["seed"] = seed
    if data_seed is not None:
        runner.setdefault("data_module_args", {})["data_seed"] = data_seed
    return runner


@click.group()
@click.version_option(package_name="of3-megafold")
def main() -> None:
    """OpenFold3 training with the of3-megafold kit (kernels, memory, parallelism)."""


def _overlaid(base: dict, overlays: tuple[Path, ...]) -> dict:
    """Deep-merge overlay YAMLs (e.g. ``runner_yamls/all_on.yml``) onto a runner."""
    from openfold3.core.config import config_utils

    for overlay in overlays:
        with _user_errors():
            extra = config_utils.load_yaml(overlay)
        if not isinstance(extra, dict):
            raise click.ClickException(f"{overlay}: not a YAML mapping")
        config_utils.deep_update(base, extra)
    return base


def check_model_update(runner: dict) -> None:
    """Build the model config a runner would build, before anything is written.

    OF3's own validator creates the output directory; checking the model update
    first means a bad key or value stops the run with nothing on disk.
    """
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    update = ModelUpdate.model_validate(runner.get("model_update") or {})
    OF3ProjectEntry().get_model_config_with_update(update)


def _write_yaml(runner: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(runner, sort_keys=False))
    tmp.replace(path)
    return path


@main.command()
@click.option(
    "--runner-yaml",
    "--runner_yaml",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="OF3 runner YAML (with the kit's keys under model_update.custom). "
    "Without it: the demo on the embedded tiny data set (runner_yamls/demo.yml).",
)
@click.option(
    "--overlay",
    "overlays",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML merged on top of the runner YAML (repeatable), e.g. "
    "runner_yamls/all_on.yml.",
)
@click.option("--seed", type=int, help="Initial seed for all processes.")
@click.option("--data-seed", "--data_seed", type=int, help="Seed for the data.")
@click.option("--use_tf32", type=bool, default=False, help="Use TF32 matmuls.")
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs") / "demo",
    show_default=True,
    help="Demo only: where the checkpoint, losses.csv and losses.png go.",
)
@click.option("--steps", type=int, help="Demo only: number of training steps.")
def train(runner_yaml, overlays, seed, data_seed, use_tf32, output_dir, steps) -> None:
    """Train OpenFold3 with the kit active (same options as `run_openfold train`)."""
    from of3_megafold import activate
    from of3_megafold.parallel import launch

    with _user_errors():
        activate()
    if use_tf32:
        from openfold3.run_openfold import _enable_tf32

        _enable_tf32()
    if runner_yaml is None:
        from of3_megafold.demo.train import DEFAULT_RUNNER_YAML

        demo_yaml = DEFAULT_RUNNER_YAML
        demo = _overlaid(_load_runner_yaml(DEFAULT_RUNNER_YAML, None, None), overlays)
        with _user_errors():  # before anything is written or built
            check_model_update(demo)
            world = launch.plan_world(demo, accelerator="auto")
        if overlays:
            demo_yaml = _write_yaml(demo, output_dir / "runner.overlaid.yml")
        with _user_errors():  # one process per rank of the YAML's world
            launch.run_demo(
                world,
                demo_yaml,
                output_dir,
                steps=steps,
                seed=seed,
                data_seed=data_seed,
            )
        return

    from openfold3.entry_points.experiment_runner import TrainingExperimentRunner
    from openfold3.entry_points.validator import TrainingExperimentConfig
    from openfold3.run_openfold import _configure_torch_backend

    _configure_torch_backend()
    runner_dict = _overlaid(_load_runner_yaml(runner_yaml, seed, data_seed), overlays)
    with _user_errors():
        check_model_update(runner_dict)
        expt_config = TrainingExperimentConfig.model_validate(runner_dict)
        world = launch.plan_world(runner_dict)
    if world.world_size > 1:  # one process per rank (of3_megafold.parallel.launch)
        try:
            launch.run_training(world, runner_dict, use_tf32)
        except KitError as err:
            raise click.ClickException(str(err)) from err
        return
    with _user_errors():
        expt_runner = TrainingExperimentRunner(expt_config)
    expt_runner.setup()
    expt_runner.run()


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def predict(ctx: click.Context) -> None:
    """Run `run_openfold predict` with the kit active (same options)."""
    from openfold3.run_openfold import predict as of3_predict

    from of3_megafold import activate

    with _user_errors():
        activate()
        of3_predict.main(args=ctx.args, prog_name="of3-megafold predict")


@main.command()
@click.option(
    "--dataset-cache",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="dataset_paths.<name>.dataset_cache_file of the runner YAML.",
)
@click.option(
    "--structures",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="dataset_paths.<name>.target_structures_directory.",
)
@click.option(
    "--format",
    "structure_format",
    type=click.Choice(["npz", "pkl"]),
    default="npz",
    show_default=True,
    help="dataset_paths.<name>.target_structure_file_format.",
)
@click.option(
    "--out", required=True, type=click.Path(path_type=Path), help="Store directory."
)
@click.option(
    "--conformers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Conformer pool size per reference molecule; 0 keeps OF3's fresh "
    "conformer per sample (samples identical to stock OF3's).",
)
@click.option(
    "--reference-mols",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="dataset_paths.<name>.reference_molecule_directory (needed with "
    "--conformers).",
)
@click.option("--force", is_flag=True, help="Replace an existing store.")
def precompute(
    dataset_cache, structures, structure_format, out, conformers, reference_mols, force
) -> None:
    """Build an EvoPipe feature store (docs/extensions/precomputed_features.md).

    Then train with `dataset_class: EvoPipeWeightedPDBDataset` and
    `config.feature_store: <out>` in place of `WeightedPDBDataset`.
    """
    from of3_megafold.data.feature_store import build_feature_store

    with _user_errors():
        path = build_feature_store(
            dataset_cache,
            structures,
            out,
            structure_format,
            conformers=conformers,
            reference_mol_dir=reference_mols,
            force=force,
        )
    click.echo(f"feature store written to {path}")


def info_rows() -> list[dict]:
    """One row per extension (and EvoPipe's dataset adapter): installed, available,
    reason, YAML keys."""
    import of3_megafold.extensions  # noqa: F401
    from of3_megafold import data, registry

    rows = []
    for ext in registry.EXTENSIONS.values():
        installed, why_not_installed = ext.installed()
        available, reason = ext.available()
        rows.append(
            {
                "name": ext.name,
                "summary": ext.summary,
                "installed": installed,
                "available": available,
                "reason": reason if installed else why_not_installed,
                "docs": ext.docs,
                "keys": [
                    {"yaml": k.yaml_path, "default": k.default, "help": k.help}
                    for k in ext.keys
                ],
            }
        )
    rows.append(data.info_row())
    return rows


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def info(as_json: bool) -> None:
    """Show every extension: installed, available here, why not, and its keys."""
    rows = info_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    width = shutil.get_terminal_size((100, 20)).columns
    name_width = max([24, *(len(row["name"]) + 2 for row in rows)])
    header = f"{'extension':<{name_width}}{'installed':<11}{'available':<11}reason"
    click.echo(header)
    click.echo("-" * min(width, 100))
    for row in rows:
        yes = {True: "yes", False: "no"}
        click.echo(
            f"{row['name']:<{name_width}}{yes[row['installed']]:<11}"
            f"{yes[row['available']]:<11}{row['reason']}"
        )
        if row["docs"]:
            click.echo(f"{'':4}docs: {row['docs']}")
        for key in row["keys"]:
            click.echo(f"{'':4}{key['yaml']} (default {key['default']!r})")
            for line in textwrap.wrap(key["help"], width=min(width, 100) - 8):
                click.echo(f"{'':8}{line}")
    if not rows:
        click.echo("(no extensions registered)")


def _module_bench(what: str) -> click.Command:
    @click.command(what, help=f"Benchmark {what}: the kit and stock OF3 side by side.")
    @click.option(
        "--out-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=_default_bench_dir,
        show_default="docs/benchmarks of the checkout, else of the working directory",
        help="Rows are appended to <out-dir>/<benchmark>.json.",
    )
    @click.option("--quick", is_flag=True, help="A tiny smoke run (works on CPU).")
    def command(out_dir: Path, quick: bool) -> None:
        import importlib

        from of3_megafold import activate

        activate()
        for name in BENCHMARKS[what]:
            module = importlib.import_module(f"of3_megafold.bench.{name}")
            out = out_dir / f"{name}.json"
            with _user_errors():
                rows = module.run(out, quick=quick)
            click.echo(f"{len(rows)} rows appended to {out}")

    return command


class _BenchGroup(click.Group):
    """Builds its commands on demand, so the CLI does not import torch to start."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*BENCHMARKS, "step"])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.list_commands(ctx):
            return None
        if name == "step":
            from of3_megafold.bench.step import step_command

            return step_command
        return _module_bench(name)


@main.group(cls=_BenchGroup)
def bench() -> None:
    """Compare the kit with stock OpenFold3 side by side, in one process."""


@main.command(
    "test-of3",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--extensions",
    default="none",
    show_default=True,
    help="Extensions to force on: none, all, or name[:variant],...",
)
@click.option(
    "--subset",
    type=click.Choice(["all", "ci"]),
    default="all",
    show_default=True,
    help="The whole suite, or the files that exercise what the kit replaces.",
)
@click.pass_context
def test_of3(ctx: click.Context, extensions: str, subset: str) -> None:
    """Run OpenFold3's own test suite with the kit active (extra args go to pytest)."""
    from of3_megafold.of3_suite import CI_SUBSET, run_of3_suite

    files = CI_SUBSET if subset == "ci" else ()
    with _user_errors():
        status = run_of3_suite(extensions, files, tuple(ctx.args))
    ctx.exit(status)


if __name__ == "__main__":
    main()
