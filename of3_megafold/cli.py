"""`of3-megafold`: OF3's own commands with the kit active, plus `info`, `bench`,
`precompute` and `test-of3`.

``train`` and ``predict`` take the options of ``run_openfold train|predict`` plus
``--overlay``; they call :func:`of3_megafold.activate` first, so the kit's keys in
``model_update.custom`` are honoured. ``train`` with no ``--runner-yaml`` runs the
demo on the embedded tiny data set, ``predict`` with none predicts with the model
the demo trained (:mod:`of3_megafold.demo.predict`). Configuration errors end
with one readable message and a non-zero exit status, not a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import click

from of3_megafold.errors import KitConfigError, one_line_errors

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
``run(out_json, quick)`` writing ``<out-dir>/<module>.json``. ``bench step`` (one
training step on random features, :func:`of3_megafold.bench.step.step_command`) and
``bench train`` (OF3's training loop, :func:`of3_megafold.bench.train.train_command`)
and ``bench predict`` (OF3's inference, :func:`of3_megafold.bench.predict.
predict_command`) are commands of their own."""


def _default_bench_dir() -> Path:
    """Where ``bench <module>`` appends rows unless told, as ``bench step`` does:
    :func:`~of3_megafold.bench.common.benchmark_dir` (imported here, not at the
    CLI's import: it imports torch)."""
    from of3_megafold.bench.common import benchmark_dir

    return benchmark_dir()


def _kit_errors():
    """The kit's own errors as one line and exit status 1, progress bars ended
    first (:func:`~of3_megafold.errors.one_line_errors`)."""
    return one_line_errors(before=_end_progress_bars)


def _end_progress_bars() -> None:
    """Close the progress bars still drawn (Lightning's, when training stopped), so
    the error starts on a line of its own rather than after a bar's last state."""
    if "tqdm" not in sys.modules:
        return
    from tqdm import tqdm

    bars = list(getattr(tqdm, "_instances", ()))
    for bar in bars:
        bar.close()
    if bars:  # a bar that does not stay (leave=False) closes without a newline
        click.echo("", err=True)


@contextmanager
def _user_errors():
    """Turn configuration mistakes into one readable message and exit status 1."""
    import pydantic
    import yaml

    try:
        with _kit_errors():
            yield
    except yaml.YAMLError as err:
        raise click.ClickException(_yaml_message(err)) from err
    except pydantic.ValidationError as err:
        raise click.ClickException(_validation_message(err)) from err
    except (KeyError, TypeError, ValueError, FileNotFoundError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise click.ClickException(
            f"runner YAML could not be applied: {message}"
        ) from err


def _yaml_message(err) -> str:
    """A YAML parser's error on one line: file, line, column and the problem."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None or mark is None:
        return "YAML could not be parsed: " + " ".join(str(err).split())
    context = f" ({err.context})" if getattr(err, "context", None) else ""
    return (
        f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: YAML could "
        f"not be parsed: {problem}{context}"
    )


def _validation_message(err, root: tuple[str, ...] = ()) -> str:
    """OF3's pydantic validation errors on one line: each field's dotted path (from
    ``root``, the section of the runner YAML that was validated), what is wrong
    and, for a scalar, the value given."""
    parts = []
    for error in err.errors():
        where = ".".join(str(part) for part in (*root, *error["loc"]))
        given = error.get("input")
        value = (
            f" (got {given!r})"
            if isinstance(given, str | int | float | bool) or given is None
            else ""
        )
        parts.append(f"{where}: {error['msg']}{value}" if where else error["msg"])
    return "runner YAML is not valid: " + "; ".join(parts)


def _locked_key_message(err: KeyError, custom: dict) -> str | None:
    """OF3's "config is locked" error for an unknown ``model_update.custom`` key as
    one line with the key's path in the YAML and OF3's suggestion, or ``None`` for
    any other ``KeyError``."""
    text = str(err.args[0]) if err.args else ""
    key = re.match(r'Key "([^"]+)" does not exist', text)
    if key is None:
        return None
    path = _key_path(custom, key.group(1)) or [key.group(1)]
    guess = re.search(r'Did you mean "([^"]+)"', text)
    hint = f"; did you mean {guess.group(1)}?" if guess else ""
    return (
        f"model_update.custom.{'.'.join(path)}: no such key in OF3's model config{hint}"
    )


def _key_path(tree: dict, key: str) -> list[str] | None:
    """The first path of mapping keys in ``tree`` that ends at ``key``."""
    for name, value in tree.items():
        if name == key:
            return [name]
        if isinstance(value, dict):
            below = _key_path(value, key)
            if below is not None:
                return [name, *below]
    return None


def _load_runner_yaml(path: Path, seed: int | None, data_seed: int | None) -> dict:
    from openfold3.core.config import config_utils

    with _user_errors():
        runner = config_utils.load_yaml(path)
        if not isinstance(runner, dict):
            raise click.ClickException(f"{path}: not a YAML mapping")
    if seed is not None:
        _section(runner, "experiment_settings")["seed"] = seed
    if data_seed is not None:
        _section(runner, "data_module_args")["data_seed"] = data_seed
    return runner


def _section(runner: dict, key: str) -> dict:
    """The runner YAML's ``key`` section, made empty when absent; a command-line
    option that writes into it is refused when the YAML gave it another type."""
    section = runner.setdefault(key, {})
    if not isinstance(section, dict):
        raise KitConfigError(f"{key}: must be a mapping of options (got {section!r})")
    return section


def _output_dir_of(runner: dict) -> str | None:
    """``experiment_settings.output_dir`` when it names a folder; ``None`` for any
    other shape, which OF3's validator then reports."""
    settings = runner.get("experiment_settings")
    folder = settings.get("output_dir") if isinstance(settings, dict) else None
    return str(folder) if isinstance(folder, str | Path) else None


class _DropDeepSpeedCpuNotice(logging.Filter):
    """DeepSpeed (imported by OpenFold3) logs "Setting accelerator to CPU" to
    stdout whenever it finds no GPU; on a CPU machine that is expected, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def _quiet_third_party_stdout() -> None:
    """Keep DeepSpeed's CPU notice off stdout. DeepSpeed configures its logger when
    it is imported, but keeps filters added to it before."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(
        isinstance(f, _DropDeepSpeedCpuNotice) for f in deepspeed_logger.filters
    ):
        deepspeed_logger.addFilter(_DropDeepSpeedCpuNotice())


def _pin_deepspeed_accelerator() -> None:
    """Hand the accelerator DeepSpeed detected here to child processes.

    Data-loader workers (forkserver/spawn) import DeepSpeed afresh, without the
    filter above; with ``DS_ACCELERATOR`` set they take that choice instead of
    detecting again and printing the CPU notice once per worker.
    """
    if "deepspeed" not in sys.modules or "DS_ACCELERATOR" in os.environ:
        return
    from deepspeed.accelerator import get_accelerator

    os.environ["DS_ACCELERATOR"] = get_accelerator().device_name()


@click.group()
@click.version_option(package_name="of3-megafold")
def main() -> None:
    """OpenFold3 training with the of3-megafold kit (kernels, memory, parallelism)."""
    _quiet_third_party_stdout()


def _overlaid(base: dict, overlays: tuple[Path, ...]) -> dict:
    """Deep-merge overlay YAMLs (e.g. ``runner_yamls/all_on.yml``) onto a runner.

    A relative ``pl_trainer_args.deepspeed_config_path`` in an overlay names a
    file next to the overlay (``runner_yamls/sp_cpu2_zero2.yml`` ships its
    DeepSpeed JSON beside it); it is made absolute here, so it holds from any
    working directory and in the merged YAML the run writes.
    """
    from openfold3.core.config import config_utils

    for overlay in overlays:
        with _user_errors():
            extra = config_utils.load_yaml(overlay)
        if not isinstance(extra, dict):
            raise click.ClickException(f"{overlay}: not a YAML mapping")
        _resolve_next_to(extra, Path(overlay).resolve().parent)
        config_utils.deep_update(base, extra)
    return base


def _resolve_next_to(overlay: dict, folder: Path) -> None:
    """An overlay's relative ``deepspeed_config_path``, made absolute in ``folder``."""
    trainer_args = overlay.get("pl_trainer_args")
    if not isinstance(trainer_args, dict):
        return
    config_path = trainer_args.get("deepspeed_config_path")
    if isinstance(config_path, str) and not Path(config_path).is_absolute():
        trainer_args["deepspeed_config_path"] = str(folder / config_path)


def check_model_update(runner: dict) -> None:
    """Build the model config a runner would build, before anything is written.

    OF3's own validator creates the output directory; checking the model update
    first means a bad key or value stops the run with nothing on disk.
    """
    import pydantic
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    try:
        update = ModelUpdate.model_validate(runner.get("model_update") or {})
    except pydantic.ValidationError as err:
        raise KitConfigError(_validation_message(err, ("model_update",))) from err
    try:
        OF3ProjectEntry().get_model_config_with_update(update)
    except KeyError as err:
        message = _locked_key_message(
            err, (runner.get("model_update") or {}).get("custom") or {}
        )
        if message is None:
            raise
        raise KitConfigError(message) from err


@contextmanager
def _new_folder_removed_on_failure(folder: str | Path | None):
    """OF3's validator creates ``experiment_settings.output_dir`` while it checks
    the rest; when the checks fail, remove what was created for it here, as long
    as nothing was written into it."""
    created = None
    if folder is not None:
        for candidate in (Path(folder), *Path(folder).parents):
            if candidate.exists():
                break
            created = candidate
    try:
        yield
    except BaseException:
        empty = (
            created is not None
            and created.is_dir()
            and not any(p.is_file() for p in created.rglob("*"))
        )
        if empty:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _write_yaml(runner: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(runner, sort_keys=False))
    tmp.replace(path)
    return path


_overlay_option = click.option(
    "--overlay",
    "overlays",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML merged on top of the runner YAML (repeatable), e.g. "
    "runner_yamls/all_on.yml.",
)
"""``train``'s and ``predict``'s ``--overlay``."""


@main.command()
@click.option(
    "--runner-yaml",
    "--runner_yaml",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="OF3 runner YAML (with the kit's keys under model_update.custom). "
    "Without it: the demo on the embedded tiny data set (runner_yamls/demo.yml).",
)
@_overlay_option
@click.option("--seed", type=int, help="Initial seed for all processes.")
@click.option("--data-seed", "--data_seed", type=int, help="Seed for the data.")
@click.option("--use_tf32", type=bool, default=False, help="Use TF32 matmuls.")
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    show_default="outputs/demo for the demo; the YAML's output_dir otherwise",
    help="Where the run writes (with --runner-yaml: replaces "
    "experiment_settings.output_dir).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    help="Optimizer steps (with --runner-yaml: sets pl_trainer_args.max_steps "
    "and lifts max_epochs).",
)
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
        _train_demo(overlays, seed, data_seed, output_dir, steps)
        return

    from openfold3.entry_points.validator import TrainingExperimentConfig

    with _user_errors():
        runner_dict = _overlaid(
            _load_runner_yaml(runner_yaml, seed, data_seed), overlays
        )
        apply_run_options(runner_dict, output_dir, steps)
    # before any process starts or anything is written
    with _user_errors(), _new_folder_removed_on_failure(_output_dir_of(runner_dict)):
        check_model_update(runner_dict)
        TrainingExperimentConfig.model_validate(runner_dict)
        world = launch.plan_world(runner_dict)
    _pin_deepspeed_accelerator()
    # One process per rank of the YAML's world (in this process when it is one);
    # the kit's errors, e.g. a damaged feature-store entry met in a worker, as
    # one line.
    with _kit_errors():
        launch.run_training(world, runner_dict, use_tf32)


def apply_run_options(runner: dict, output_dir: Path | None, steps: int | None) -> None:
    """``--output-dir`` and ``--steps`` on a runner YAML: the output directory, and
    a stop after ``steps`` optimizer steps however many epochs that takes."""
    if output_dir is not None:
        _section(runner, "experiment_settings")["output_dir"] = str(output_dir)
    if steps is not None:
        trainer_args = _section(runner, "pl_trainer_args")
        trainer_args["max_steps"] = steps
        trainer_args["max_epochs"] = -1


def _train_demo(overlays, seed, data_seed, output_dir, steps) -> None:
    """``train`` without ``--runner-yaml``: the demo on the embedded data set."""
    from of3_megafold.demo.build import ensure_demo_dataset
    from of3_megafold.demo.train import DEFAULT_RUNNER_YAML, removed_on_failure
    from of3_megafold.parallel import launch

    output_dir = Path("outputs") / "demo" if output_dir is None else output_dir
    demo_yaml = DEFAULT_RUNNER_YAML
    demo = _overlaid(_load_runner_yaml(DEFAULT_RUNNER_YAML, None, None), overlays)
    with _user_errors():  # before anything is written or built
        check_model_update(demo)
        world = launch.plan_world(demo, accelerator="auto")
    with _kit_errors():  # an unwritable cache is not the runner YAML's fault
        dataset_dir = ensure_demo_dataset()  # once, not by every rank
    _pin_deepspeed_accelerator()
    with _user_errors(), removed_on_failure(output_dir):
        if overlays:
            demo_yaml = _write_yaml(demo, output_dir / "runner.overlaid.yml")
        launch.run_demo(  # one process per rank of the YAML's world
            world,
            demo_yaml,
            output_dir,
            steps=steps,
            seed=seed,
            data_seed=data_seed,
            dataset_dir=dataset_dir,
        )


@main.command()
@click.option(
    "--runner-yaml",
    "--runner_yaml",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="OF3 inference runner YAML. Without it (and without --inference-ckpt-*): "
    "the demo's model (runner_yamls/demo_predict.yml).",
)
@_overlay_option
@click.option(
    "--query-json",
    "--query_json",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="OF3 query JSON. Demo default: one structure of the demo set (1ubq).",
)
@click.option(
    "--sequence",
    "sequences",
    multiple=True,
    help="A protein chain's sequence, in place of --query-json (repeatable: "
    "chains A, B, ... of one query named 'query').",
)
@click.option(
    "--inference-ckpt-path",
    "--inference_ckpt_path",
    type=click.Path(exists=True, path_type=Path),
    help="Model checkpoint (as in run_openfold predict).",
)
@click.option(
    "--inference-ckpt-name",
    "--inference_ckpt_name",
    help="Name of an OF3 checkpoint in $OPENFOLD_CACHE (as in run_openfold predict).",
)
@click.option(
    "--num-diffusion-samples",
    "--num_diffusion_samples",
    type=click.IntRange(min=1),
    help="Diffusion samples per query.",
)
@click.option(
    "--num-model-seeds",
    "--num_model_seeds",
    type=click.IntRange(min=1),
    help="Model seeds per query.",
)
@click.option(
    "--use-msa-server", "--use_msa_server", type=bool, help="ColabFold MSA server."
)
@click.option("--use-templates", "--use_templates", type=bool, help="Use templates.")
@click.option(
    "--output-dir",
    "--output_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where predictions go. Demo default: <demo-dir>/predict.",
)
@click.option("--use_tf32", type=bool, default=True, help="Use TF32 matmuls.")
@click.option(
    "--demo-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs") / "demo",
    show_default=True,
    help="Demo only: the demo training's --output-dir (its checkpoint and model).",
)
@click.pass_context
def predict(
    ctx: click.Context,
    runner_yaml,
    overlays,
    query_json,
    sequences,
    inference_ckpt_path,
    inference_ckpt_name,
    num_diffusion_samples,
    num_model_seeds,
    use_msa_server,
    use_templates,
    output_dir,
    use_tf32,
    demo_dir,
) -> None:
    """Predict structures with OF3 and the kit active (`run_openfold predict`'s
    options, plus --overlay and --sequence).

    With no --runner-yaml and no --inference-ckpt-*: the demo's last checkpoint
    predicts one structure of the demo set (or the query given) into
    outputs/demo/predict/. Exits 1 naming the queries that failed.
    """
    import signal

    from of3_megafold.inference import PredictionInterrupted, stop_on_signals

    # From the start: a SIGTERM during the imports or the set-up stops it too.
    with stop_on_signals() as received:
        try:
            _predict(
                runner_yaml,
                overlays,
                query_json,
                sequences,
                inference_ckpt_path,
                inference_ckpt_name,
                num_diffusion_samples=num_diffusion_samples,
                num_model_seeds=num_model_seeds,
                use_msa_server=use_msa_server,
                use_templates=use_templates,
                output_dir=output_dir,
                use_tf32=use_tf32,
                demo_dir=demo_dir,
            )
        except KeyboardInterrupt as stop:
            if isinstance(stop, PredictionInterrupted):
                signum, message = stop.signum, str(stop)
            elif "signum" in received:
                signum = received["signum"]
                message = f"{signal.Signals(signum).name} received before prediction"
            else:
                raise
            click.echo(f"Error: {message}", err=True)
            ctx.exit(128 + signum)


def _predict(
    runner_yaml: Path | None,
    overlays: tuple[Path, ...],
    query_json: Path | None,
    sequences: tuple[str, ...],
    inference_ckpt_path: Path | None,
    inference_ckpt_name: str | None,
    *,
    output_dir: Path | None,
    use_tf32: bool,
    demo_dir: Path,
    **options,
) -> None:
    import logging
    import os

    from openfold3.core.config import config_utils
    from openfold3.entry_points.import_utils import (
        _configure_torch_backend,
        _enable_tf32,
    )
    from openfold3.entry_points.parameters import DEFAULT_CACHE_PATH

    from of3_megafold import activate, inference
    from of3_megafold.demo import predict as demo

    if query_json is not None and sequences:
        raise click.UsageError("give --query-json or --sequence, not both")
    demo_run = runner_yaml is None and not (inference_ckpt_path or inference_ckpt_name)
    if not demo_run and query_json is None and not sequences:
        raise click.UsageError(
            "give --query-json or --sequence (or neither, and "
            "no --runner-yaml, for the demo)"
        )
    with _user_errors():
        if demo_run:
            checkpoint, trained_yaml = demo.demo_checkpoint(demo_dir)
        activate()
    _configure_torch_backend()
    if use_tf32:
        _enable_tf32()
    logging.basicConfig(level=logging.INFO)  # as run_openfold predict

    default_yaml = None
    if demo_run:
        from of3_megafold.demo.build import ensure_demo_dataset

        with _user_errors():
            dataset_dir = ensure_demo_dataset()
            output_dir = output_dir or Path(demo_dir) / demo.PREDICT_DIR_NAME
            runner = demo.demo_predict_runner(trained_yaml, dataset_dir, output_dir)
        runner["inference_ckpt_path"] = str(checkpoint)
    else:
        # run_openfold predict's user defaults: $OPENFOLD_CACHE/runner.yml first.
        cache_yaml = Path(os.environ.get("OPENFOLD_CACHE") or DEFAULT_CACHE_PATH)
        cache_yaml = cache_yaml / "runner.yml"
        runner = {}
        if cache_yaml.is_file():
            default_yaml = cache_yaml.resolve()
            runner = _load_runner_yaml(cache_yaml, None, None)
        if runner_yaml is not None:
            config_utils.deep_update(runner, _load_runner_yaml(runner_yaml, None, None))
    runner = _overlaid(runner, overlays)

    with _user_errors():
        check_model_update(runner)
        if query_json is not None:
            query_set = inference.load_query_set(query_json)
        elif sequences:
            query_set = inference.load_query_set(inference.sequence_query(sequences))
        else:
            query_set = inference.load_query_set(demo.entry_query(dataset_dir))
        result = inference.run_inference(
            runner,
            query_set,
            inference_ckpt_path=inference_ckpt_path,
            inference_ckpt_name=inference_ckpt_name,
            output_dir=None if demo_run else output_dir,
            user_default_runner_yaml_path=default_yaml,
            runner_copy=demo.RUNNER_COPY_NAME if demo_run else None,
            **options,
        )
    extra = {"checkpoint": checkpoint} if demo_run else {}
    inference.print_summary(
        result, "Demo prediction" if demo_run else "Prediction", **extra
    )
    if result.failed_queries:
        raise click.ClickException(
            f"{len(result.failed_queries)} of {len(result.queries)} queries failed: "
            f"{', '.join(result.failed_queries)} (tracebacks in "
            f"{result.output_dir / 'logs'}/predict_err_rank*.log)"
        )


@main.command()
@click.option(
    "--dataset-cache",
    type=click.Path(exists=True, path_type=Path),
    help="dataset_paths.<name>.dataset_cache_file of the runner YAML.",
)
@click.option(
    "--structures",
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
@click.option("--out", type=click.Path(path_type=Path), help="Store directory.")
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
@click.option(
    "--verify",
    "verify_store",
    type=click.Path(path_type=Path),
    help="Check the size and SHA-256 of every entry of this store instead of "
    "building one; one line per damaged entry, exit status 1 if any.",
)
def precompute(
    dataset_cache,
    structures,
    structure_format,
    out,
    conformers,
    reference_mols,
    force,
    verify_store,
) -> None:
    """Build an EvoPipe feature store (docs/extensions/precomputed_features.md).

    Then train with `dataset_class: EvoPipeWeightedPDBDataset` and
    `config.feature_store: <out>` in place of `WeightedPDBDataset`.
    """
    if verify_store is not None:
        if dataset_cache or structures or out:
            raise click.UsageError(
                "--verify checks a store; it takes no --dataset-cache, "
                "--structures or --out"
            )
        _verify_store(verify_store)
        return
    missing = [
        name
        for name, value in (
            ("--dataset-cache", dataset_cache),
            ("--structures", structures),
            ("--out", out),
        )
        if value is None
    ]
    if missing:
        raise click.UsageError(f"building a store needs {', '.join(missing)}")
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


def _verify_store(store: Path) -> None:
    """``precompute --verify``: every damaged entry on its own line, then exit 1."""
    from of3_megafold.data.feature_store import verify_feature_store

    with _kit_errors():
        damaged = verify_feature_store(store)
    for line in damaged:
        click.echo(line, err=True)
    if damaged:
        raise click.ClickException(
            f"{len(damaged)} damaged entries in the feature store {store}; rebuild "
            f"it with `of3-megafold precompute ... --out {store} --force`"
        )
    click.echo(f"feature store {store}: every entry has its recorded size and SHA-256")


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
        return sorted([*BENCHMARKS, "predict", "step", "train"])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.list_commands(ctx):
            return None
        if name == "step":
            from of3_megafold.bench.step import step_command

            return step_command
        if name == "train":
            from of3_megafold.bench.train import train_command

            return train_command
        if name == "predict":
            from of3_megafold.bench.predict import predict_command

            return predict_command
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
