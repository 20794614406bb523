"""Run the demo: OF3's own training loop on the embedded tiny data set.

:func:`run_demo_training` builds (once) the demo data set, fills the dataset paths
into the runner YAML, and trains exactly as ``run_openfold train`` does
(``TrainingExperimentConfig`` -> ``TrainingExperimentRunner`` -> ``setup()`` ->
``run()``), with one extra Lightning callback, :class:`LossRecorder`, that keeps the
per-step loss breakdown OF3 logs. It writes:

``<output_dir>/runner.yml``
    the resolved runner YAML that was run (reusable with ``of3-megafold train
    --runner-yaml``; stock ``run_openfold train`` rejects the kit's keys in it);
``<output_dir>/checkpoints/``
    the Lightning checkpoint(s) OF3's ``checkpoint_config`` asks for;
``<output_dir>/losses.csv``
    one row per optimizer step: the pdb id and chain/interface sampled, the step's
    wall time, and every loss component OF3 reported;
``<output_dir>/losses.png``
    one panel per loss component.

In a run of several processes (``pl_trainer_args.devices``; the CLI starts them,
:mod:`of3_megafold.parallel.launch`) rank 0 writes these files, with its own
data-parallel replica's losses. The initial weights are drawn from
``experiment_settings.seed``, so a run is repeatable.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import os
import shutil
import string
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import yaml

from of3_megafold.demo.build import ensure_demo_dataset
from of3_megafold.errors import KitConfigError, KitError, unwritable_cause
from of3_megafold.parallel.cpu_deepspeed import use_cpu_deepspeed
from of3_megafold.parallel.launch import data_parallel_size, global_rank
from of3_megafold.parallel.rng import seed_model_init

logger = logging.getLogger(__name__)

DEFAULT_RUNNER_YAML = Path(__file__).resolve().parents[2] / "runner_yamls" / "demo.yml"
"""``runner_yamls/demo.yml`` of the kit's source tree."""

DATASET_PLACEHOLDER = "OF3_MEGAFOLD_DEMO"
OUTPUT_PLACEHOLDER = "OF3_MEGAFOLD_OUTPUT"

RESOLVED_YAML_NAME = "runner.yml"
CHECKPOINTS_DIR = "checkpoints"
"""Where Lightning's ``ModelCheckpoint`` writes without a logger (under OF3's
``default_root_dir``, the run's output directory)."""
LOSSES_CSV_NAME = "losses.csv"
LOSSES_PNG_NAME = "losses.png"

_TRAIN_PREFIX = "train/"


def is_loss_key(name: str) -> bool:
    """Whether a metric OF3 logs in training is a loss component.

    OF3's ``OpenFold3AllAtom._log`` logs each entry of the loss breakdown as
    ``train/<name>`` (``loss``, ``mse_loss``, ``smooth_lddt_loss``,
    ``distogram_loss``, ``plddt_loss``, ..., ``diffusion_loss``,
    ``confidence_loss``, ``scaled_distogram_loss``) and its structure metrics as
    ``train/<metric>_step``.
    """
    if not name.startswith(_TRAIN_PREFIX):
        return False
    name = name[len(_TRAIN_PREFIX) :]
    return name == "loss" or name.endswith("_loss")


class LossRecorder(pl.Callback):
    """Keeps, per optimizer step, the loss components OF3 logged in that step.

    Lightning's ``trainer.callback_metrics`` keeps the last value of every key ever
    logged, so a component OF3 did not report this step (a confidence loss switched
    off for an NMR structure, or every loss after OF3's permutation-alignment
    fallback) would show a stale value there. The recorder therefore listens to the
    module's ``log`` calls themselves, for the duration of the fit.

    Attributes:
        rows: one dict per optimizer step: ``step``, ``pdb_id``, ``sampled``,
            ``seconds`` and ``{loss_name: float}`` for each reported component.
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._logged: dict[str, float] = {}
        self._step_start = 0.0
        self._module: pl.LightningModule | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original_log = pl_module.log

        def recording_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if is_loss_key(name):
                self._logged[name[len(_TRAIN_PREFIX) :]] = float(value)
            return original_log(name, value, *args, **kwargs)

        # An instance attribute shadows the class method until on_fit_end.
        pl_module.log = recording_log
        self._module = pl_module

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_log()

    def on_exception(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        exception: BaseException,
    ) -> None:
        self._restore_log()

    def _restore_log(self) -> None:
        if self._module is not None and "log" in vars(self._module):
            del self._module.log
        self._module = None

    def on_train_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._logged = {}
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # OF3 logs the breakdown only on optimizer steps (gradient accumulation).
        if not self._logged:
            return
        self.rows.append(
            {
                "step": trainer.global_step,
                **batch_sample(batch),
                "seconds": round(time.perf_counter() - self._step_start, 3),
                **self._logged,
            }
        )

    def loss_names(self) -> list[str]:
        """Every component reported in any step; the total ``loss`` first."""
        names = {name for row in self.rows for name in row if name not in _ROW_META}
        return sorted(names, key=lambda name: (name != "loss", name))


_ROW_META = ("step", "pdb_id", "sampled", "seconds")


def batch_sample(batch: Any) -> dict[str, str]:
    """The structures a training batch was cropped from.

    Returns:
        ``pdb_id`` (the batch's PDB ids, comma-separated) and ``sampled`` (the
        chain or interface OF3's sampler picked in each, as dataset-cache ids).
    """
    return {
        "pdb_id": ",".join(batch.get("pdb_id", [])),
        "sampled": ",".join(
            _datapoint_id(x) for x in batch.get("preferred_chain_or_interface", [])
        ),
    }


def _datapoint_id(sampled: str) -> str:
    """OF3's sampled chain (``"3"``) or interface (``"['3', '4']"``) as a cache id.

    Interfaces become ``"3_4"``, the key they have in the dataset cache.
    """
    return "_".join(part.strip(" '\"") for part in sampled.strip("[]").split(","))


ALWAYS_REPORTED_LOSSES = (
    "loss",
    "diffusion_loss",
    "mse_loss",
    "smooth_lddt_loss",
    "distogram_loss",
    "scaled_distogram_loss",
)
"""Components OF3 reports on every healthy training step with the demo's loss
weights. Confidence losses are reported only for structures with a resolution in
[0.1, 4] A, and the bond loss only when its weight is non-zero."""


def loss_problems(
    rows: list[dict[str, Any]], required: tuple[str, ...] = ALWAYS_REPORTED_LOSSES
) -> list[str]:
    """Why a run's loss record shows no real training signal; empty if it does.

    Flags steps where a required component is missing, and any reported component
    that is zero or not finite. OF3's permutation-alignment fallback (its "turning
    off losses" path) zeroes every loss weight: OF3 then reports only ``loss = 0``,
    which this catches.

    Args:
        rows: :attr:`LossRecorder.rows`.
        required: components every step must report.
    """
    if not rows:
        return ["no training step logged a loss"]
    problems = []
    for row in rows:
        losses = {k: v for k, v in row.items() if k not in _ROW_META}
        missing = [name for name in required if name not in losses]
        if missing:
            problems.append(f"step {row['step']} ({row['pdb_id']}): no {missing}")
        bad = {k: v for k, v in losses.items() if v == 0.0 or not math.isfinite(v)}
        if bad:
            problems.append(f"step {row['step']} ({row['pdb_id']}): {bad}")
    return problems


def write_losses_csv(recorder: LossRecorder, path: Path) -> Path:
    """One row per step; a component not reported in a step is left empty."""
    columns = [*_ROW_META, *recorder.loss_names()]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(recorder.rows)
    return path


def plot_losses(recorder: LossRecorder, path: Path, title: str = "") -> Path:
    """One small panel per loss component against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = recorder.loss_names()
    ncols = min(4, max(1, len(names)))
    nrows = max(1, math.ceil(len(names) / ncols))
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows), squeeze=False
    )
    for ax, name in zip(axes.flat, names, strict=False):
        points = [(row["step"], row[name]) for row in recorder.rows if name in row]
        steps, values = zip(*points, strict=True) if points else ((), ())
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def resolve_device(accelerator: str) -> tuple[str, str]:
    """Lightning ``(accelerator, precision)`` for ``auto``, ``cpu`` or ``gpu``.

    ``auto`` takes the GPU when CUDA sees one (bf16-mixed precision) and the CPU
    otherwise (32-true). ``gpu`` without a visible GPU raises.
    """
    import torch

    accelerator = accelerator.lower()
    if accelerator == "cuda":
        accelerator = "gpu"
    if accelerator not in ("auto", "cpu", "gpu"):
        raise KitConfigError(
            f"accelerator must be auto, cpu or gpu, got {accelerator!r}"
        )
    has_gpu = torch.cuda.is_available()
    if accelerator == "gpu" and not has_gpu:
        raise KitError(
            "accelerator='gpu' was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            "Use accelerator='auto' or 'cpu'."
        )
    if accelerator == "cpu" or not has_gpu:
        return "cpu", "32-true"
    return "gpu", "bf16-mixed"


def resolve_runner_yaml(
    runner_yaml: Path | None,
    dataset_dir: Path,
    output_dir: Path,
    *,
    steps: int | None = None,
    accelerator: str = "auto",
    seed: int | None = None,
    data_seed: int | None = None,
) -> dict[str, Any]:
    """Read a runner YAML and fill in what the demo decides at run time.

    Replaces ``${OF3_MEGAFOLD_DEMO}`` with ``dataset_dir`` and
    ``${OF3_MEGAFOLD_OUTPUT}`` with ``output_dir``; sets ``pl_trainer_args``
    accelerator and precision from ``accelerator`` (:func:`resolve_device`);
    ``steps`` becomes one epoch of ``steps`` samples per data-parallel replica
    (batch size 1; an SP group is one replica); checkpoints keep their names on
    a rerun (no ``-v1`` copies).

    Args:
        runner_yaml: the YAML; None for ``runner_yamls/demo.yml``.
        dataset_dir: a built demo set (:func:`ensure_demo_dataset`).
        output_dir: where the run writes.
        steps: optimizer steps; None keeps the YAML's.
        accelerator: ``auto``, ``cpu`` or ``gpu``.
        seed: overrides ``experiment_settings.seed`` (and the data seed, unless
            ``data_seed`` is given).
        data_seed: overrides ``data_module_args.data_seed``.

    Returns:
        The runner dict, ready for OF3's ``TrainingExperimentConfig``.
    """
    path = Path(runner_yaml) if runner_yaml is not None else DEFAULT_RUNNER_YAML
    if not path.is_file():
        raise KitError(
            f"runner YAML {path} not found"
            + (
                " (the demo YAML lives in the kit's source tree, runner_yamls/demo.yml;"
                " pass runner_yaml= explicitly when the kit is installed as a wheel)"
                if runner_yaml is None
                else ""
            )
        )
    text = string.Template(path.read_text()).safe_substitute(
        {
            DATASET_PLACEHOLDER: str(Path(dataset_dir).resolve()),
            OUTPUT_PLACEHOLDER: str(Path(output_dir).resolve()),
        }
    )
    runner = yaml.safe_load(text)
    if not isinstance(runner, dict):
        raise KitConfigError(f"{path}: not a YAML mapping")

    device, precision = resolve_device(accelerator)
    # A rerun in the same folder overwrites its checkpoints (run_demo_training
    # clears the last run's first) instead of writing last-v1.ckpt beside them.
    runner.setdefault("checkpoint_config", {})["enable_version_counter"] = False
    trainer_args = runner.setdefault("pl_trainer_args", {})
    trainer_args["accelerator"] = device
    trainer_args["precision"] = precision
    if steps is not None:
        if steps < 1:
            raise KitConfigError(f"steps must be >= 1, got {steps}")
        # One sample per data-parallel replica (an SP group shares its sample).
        replicas = data_parallel_size(runner)
        runner.setdefault("data_module_args", {})["epoch_len"] = steps * replicas
        trainer_args["max_epochs"] = 1
    if seed is not None:
        runner.setdefault("experiment_settings", {})["seed"] = seed
        runner.setdefault("data_module_args", {})["data_seed"] = seed
    if data_seed is not None:
        runner.setdefault("data_module_args", {})["data_seed"] = data_seed
    return runner


@contextlib.contextmanager
def _cpu_threads(device: str) -> Iterator[None]:
    """One intra-op thread for the training process on CPU, restored afterwards.

    The demo model is tiny: extra intra-op threads buy little, and they compete
    with the data-loader worker for the cores. Oversubscribed, OpenMP's spin-waits
    made a step 20x slower here (2 cores: 1.3 s with one thread, ~30 s with two
    beside the worker and other load).
    """
    import torch

    if device != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _wandb_disabled() -> Iterator[None]:
    previous = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "disabled"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = previous


def run_demo_training(
    runner_yaml: Path | None,
    output_dir: Path,
    steps: int | None = None,
    accelerator: str = "auto",
    *,
    seed: int | None = None,
    data_seed: int | None = None,
    dataset_dir: Path | None = None,
    progress: bool = True,
    recorder: LossRecorder | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> dict[str, Any]:
    """Train OF3 on the demo set; write a checkpoint, ``losses.csv`` and ``losses.png``.

    Runs OF3's own training path, as ``run_openfold train`` does. The kit's
    extensions take effect only if :func:`of3_megafold.activate` ran first (the
    ``of3-megafold`` CLI does that).

    Args:
        runner_yaml: OF3 runner YAML; None for ``runner_yamls/demo.yml``.
            ``${OF3_MEGAFOLD_DEMO}`` / ``${OF3_MEGAFOLD_OUTPUT}`` are filled in.
        output_dir: where everything goes (created).
        steps: optimizer steps; None keeps the YAML's (20 in ``demo.yml``).
        accelerator: ``auto`` (GPU with bf16-mixed if present, else CPU with
            32-true), ``cpu`` or ``gpu``.
        seed: model and data seed; None keeps the YAML's.
        data_seed: data seed, when it should differ from ``seed``.
        dataset_dir: a built demo set; None builds or reuses the cached one
            (:func:`ensure_demo_dataset`).
        progress: progress bars for the build and the training steps.
        recorder: the loss recorder to train with (a subclass may record more,
            e.g. :class:`of3_megafold.bench.train.TrainStepTimer`); None for a
            plain :class:`LossRecorder`.
        callbacks: further Lightning callbacks for the fit.

    Returns:
        ``output_dir``, ``runner_yaml`` (the resolved copy), ``dataset_dir``,
        ``checkpoint`` (path or None), ``losses_csv``, ``losses_png``, ``steps``
        (optimizer steps recorded), ``seconds`` (wall time of the fit),
        ``final_losses`` (``{name: value}`` of the last step), ``losses`` (all
        rows) and ``loss_problems`` (:func:`loss_problems`; empty when every step
        trained on real losses).
    """
    output_dir = Path(output_dir)
    # Inputs first: a data set that cannot be built, or a YAML that does not
    # resolve, stops the run before anything is written to output_dir.
    if dataset_dir is None:
        dataset_dir = ensure_demo_dataset(progress=progress)
    runner_dict = resolve_runner_yaml(
        runner_yaml,
        dataset_dir,
        output_dir,
        steps=steps,
        accelerator=accelerator,
        seed=seed,
        data_seed=data_seed,
    )
    with removed_on_failure(output_dir):
        result = _train(
            runner_dict,
            output_dir,
            Path(dataset_dir),
            progress,
            recorder=LossRecorder() if recorder is None else recorder,
            callbacks=callbacks,
        )
    if global_rank() == 0:  # one process reports the run
        _print_summary(result)
    return result


@contextlib.contextmanager
def removed_on_failure(output_dir: Path) -> Iterator[None]:
    """Create ``output_dir``; if the run fails before writing a checkpoint, remove
    it again when this call created it (no empty or half-written run folder).

    Raises:
        KitError: ``output_dir`` cannot be created (names it and the cause).
    """
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KitError(
            f"cannot create the output folder {output_dir}: "
            f"{unwritable_cause(output_dir, error)}; choose a writable --output-dir"
        ) from error
    try:
        yield
    except BaseException:
        if created and not any((output_dir / CHECKPOINTS_DIR).glob("*.ckpt")):
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def _clear_checkpoints(output_dir: Path) -> None:
    """Remove a previous demo run's checkpoints from ``output_dir/checkpoints``.

    Every demo run starts from fresh weights, so its checkpoints replace the last
    run's rather than sitting beside them (Lightning would name the new ones
    ``last-v1.ckpt``, ``demo-step20-v1.ckpt``, ...). Under DeepSpeed a checkpoint
    is a folder.
    """
    for checkpoint in (output_dir / CHECKPOINTS_DIR).glob("*.ckpt"):
        if checkpoint.is_dir() and not checkpoint.is_symlink():
            shutil.rmtree(checkpoint)
        else:
            checkpoint.unlink()


def _train(
    runner_dict: dict[str, Any],
    output_dir: Path,
    dataset_dir: Path,
    progress: bool,
    recorder: LossRecorder,
    callbacks: Sequence[pl.Callback],
) -> dict[str, Any]:
    """OF3's training path on a resolved runner dict; the result of
    :func:`run_demo_training`."""
    from openfold3.entry_points.experiment_runner import TrainingExperimentRunner
    from openfold3.entry_points.import_utils import _configure_torch_backend
    from openfold3.entry_points.validator import TrainingExperimentConfig

    resolved_yaml = output_dir / RESOLVED_YAML_NAME
    writer = global_rank() == 0  # one process writes the run's files
    if writer:
        _clear_checkpoints(output_dir)
        resolved_yaml.write_text(yaml.safe_dump(runner_dict, sort_keys=False))

    _configure_torch_backend()
    experiment_config = TrainingExperimentConfig.model_validate(runner_dict)
    start = time.perf_counter()
    device = runner_dict["pl_trainer_args"]["accelerator"]
    with _wandb_disabled(), _cpu_threads(device), warnings.catch_warnings():
        # OF3 logs every metric with logger=True; without wandb there is no
        # logger, and Lightning warns once per metric name. LossRecorder keeps
        # the losses.
        warnings.filterwarnings("ignore", message=r".*but have no logger configured")
        runner = TrainingExperimentRunner(experiment_config)
        seed_model_init(experiment_config.experiment_settings.seed)
        runner.setup()
        use_cpu_deepspeed(runner)
        # Before run(): OF3 builds the Trainer from this (cached) list there.
        runner.callbacks.extend([recorder, *callbacks])
        if not progress:
            _drop_progress_bars(runner)
        runner.run()
    seconds = time.perf_counter() - start

    checkpoint_callback = runner.trainer.checkpoint_callback
    checkpoint = None
    if checkpoint_callback is not None:
        checkpoint = (
            checkpoint_callback.last_model_path or checkpoint_callback.best_model_path
        ) or None

    losses_csv = output_dir / LOSSES_CSV_NAME
    losses_png = output_dir / LOSSES_PNG_NAME
    if writer:
        write_losses_csv(recorder, losses_csv)
        plot_losses(recorder, losses_png, title=f"OF3 demo training ({device})")
    problems = loss_problems(recorder.rows)
    if problems:
        logger.warning(
            "OF3 reported no usable training signal in some steps:\n  %s",
            "\n  ".join(problems),
        )
    final = recorder.rows[-1] if recorder.rows else {}
    final_losses = {k: final[k] for k in recorder.loss_names() if k in final}
    result = {
        "output_dir": output_dir,
        "runner_yaml": resolved_yaml,
        "dataset_dir": dataset_dir,
        "checkpoint": Path(checkpoint) if checkpoint else None,
        "losses_csv": losses_csv,
        "losses_png": losses_png,
        "steps": len(recorder.rows),
        "seconds": round(seconds, 1),
        "final_losses": final_losses,
        "losses": recorder.rows,
        "loss_problems": problems,
    }
    return result


def _drop_progress_bars(runner: Any) -> None:
    """Take out the progress bar OF3 always adds, and Lightning's default one."""
    from pytorch_lightning.callbacks import ProgressBar

    runner.callbacks[:] = [
        cb for cb in runner.callbacks if not isinstance(cb, ProgressBar)
    ]
    runner.pl_trainer_args.enable_progress_bar = False


def _print_summary(result: dict[str, Any]) -> None:
    final = ", ".join(f"{k} {v:.4g}" for k, v in result["final_losses"].items())
    print(
        f"\nDemo training: {result['steps']} steps in {result['seconds']:.0f} s\n"
        f"  data set     {result['dataset_dir']}\n"
        f"  runner YAML  {result['runner_yaml']}\n"
        f"  checkpoint   {result['checkpoint']}\n"
        f"  losses       {result['losses_csv']}\n"
        f"  plot         {result['losses_png']}\n"
        f"  last step    {final or '(no loss logged)'}"
    )
