"""``of3-megafold bench train``: OF3's own training loop, timed per optimizer step.

``bench step`` times one forward + backward on random features. This benchmark runs
what a user runs: ``TrainingExperimentRunner`` on a runner YAML (by default
``runner_yamls/train_full.yml``: the full model with the ``train`` preset,
``bf16-mixed``, real structures of the demo set), with OF3's data loader, its
per-sample gradient clipping, Adam, the learning-rate schedule and the EMA update
after every step. One Lightning callback, :class:`TrainStepTimer`, records per
optimizer step::

    wall_ms       previous step's end (after the EMA update) -> this step's end
    data_wait_ms  previous step's end -> the batch on the device (loader + copy)
    forward_ms    forward pass and loss          (GPU time between CUDA events)
    backward_ms   backward pass
    clip_ms       OF3's per-sample clipping and gradient accumulation
    optimizer_ms  Adam step, learning-rate schedule, OF3's logging
    ema_ms        OF3's EMA update
    peak_gib      peak GPU memory of the step
    sample        the structure and chain/interface the step trained on
                  (``<pdb_id>/<chain or interface>``, e.g. ``1ab2/1_2``)
    input_digest  a digest of every tensor of the batch (the crop, the reference
                  conformers, the MSA): equal digests mean equal inputs
    rng_digest    a digest of the random state as the step ends (Python's,
                  NumPy's and torch's, CPU and GPU): steps start from the same
                  state, so equal digests mean the step drew as many random numbers
    loss, grad_norm and every loss component OF3 logged

``grad_norm`` is the sample's unclipped gradient norm as OF3's per-sample clipping
computes it (the global norm before ``optimizer.step`` when per-sample clipping is
off). The phases are marked by CUDA events on the GPU timeline (host clock on the
CPU); the step ends with one ``torch.cuda.synchronize`` so that ``wall_ms`` holds
the step's GPU work.

A *provider* is a model-config update merged into ``model_update.custom``, as in
``bench step`` (:func:`of3_megafold.bench.step.provider_update`): ``stock`` (OF3's
defaults), ``stock-triton`` (OF3 with its Triton triangle kernels, what OF3 users
run on a GPU) or ``kit`` (every available extension). Every provider runs with the
YAML's seeds, and each step starts from generators seeded by the YAML's seed and
the step (:class:`StepSeeds`), as ``bench step`` reseeds every step: a provider
that draws its random numbers in another order (a fused kernel, a captured graph)
still meets the same noise, dropout masks and conditioning draws at the next step.
Each row names its sample and digests its inputs, so runs compare step by step.

Each step's row is appended to ``<out-dir>/train_run.json`` as soon as the step
ends, so a run cut short (a time limit, a crash) keeps every finished step, and a
later invocation appends to the file. Rows of one run share a ``run`` id; with
``--resume-dir`` a run stopped by ``--max-minutes`` continues in a later invocation
under the same id (:class:`ResumableRun`).
The summary table and the plot are :mod:`of3_megafold.bench.train_report`'s.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytorch_lightning as pl
import torch
import yaml

from of3_megafold.bench.common import (
    GIB,
    TF32_SUFFIX,
    append_rows,
    check_rows_readable,
    environment_metadata,
    matmul_tf32,
    out_dir_option,
    read_rows,
    split_tf32,
)
from of3_megafold.bench.train_report import PHASES, format_summary, plot_runs
from of3_megafold.demo.train import LossRecorder, batch_sample
from of3_megafold.errors import KitConfigError, KitError, one_line_errors

JSON_NAME = "train_run.json"
PLOT_NAME = "train_run.png"
DEFAULT_RUNNER_YAML = (
    Path(__file__).resolve().parents[2] / "runner_yamls" / "train_full.yml"
)
"""``runner_yamls/train_full.yml`` of the kit's source tree."""

_FP32_PROVIDERS = ("stock", "stock-triton", "kit")
PROVIDERS = (*_FP32_PROVIDERS, *(name + TF32_SUFFIX for name in _FP32_PROVIDERS))
"""Each in OF3's fp32 precision, and with :data:`TF32_SUFFIX`: with TF32 matmuls for
the whole run, as OF3's ``--use_tf32``."""


class _Marks:
    """Named points on the GPU timeline (CUDA events), or host times on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.points: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def ms(self, start: str, end: str) -> float | None:
        """Milliseconds between two marks; None if either was not reached."""
        if start not in self.points or end not in self.points:
            return None
        if self.cuda:
            return self.points[start].elapsed_time(self.points[end])
        return (self.points[end] - self.points[start]) * 1e3


class TrainStepTimer(LossRecorder):
    """Lightning callback: one timed row per optimizer step (module docstring).

    Only for runs with one batch per optimizer step (OF3's batch size 1 per device,
    no gradient accumulation), which is what the rows assume.

    Args:
        on_row: called with each finished row (e.g. to append it to a file).
    """

    def __init__(self, on_row=None) -> None:
        super().__init__()
        self.timed_rows: list[dict[str, Any]] = []
        self._on_row = on_row
        self._cuda = False
        self._marks = _Marks(False)
        self._previous_end = 0.0
        self._batch_start = 0.0
        self._grad_norm: torch.Tensor | None = None
        self._sample = ""
        self._input_digest = ""
        self._restore: list[tuple[Any, str, Any]] = []

    # -- installation ---------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if int(getattr(trainer, "accumulate_grad_batches", 1)) != 1:
            raise KitConfigError(
                "bench train times one batch per optimizer step: set "
                "pl_trainer_args.accumulate_grad_batches to 1"
            )
        self._cuda = pl_module.device.type == "cuda"
        from openfold3.core.utils import grad_manager

        original_norm = grad_manager.compute_global_norm

        def recording_norm(*args: Any, **kwargs: Any):
            norm, params = original_norm(*args, **kwargs)
            self._grad_norm = norm.detach()
            return norm, params

        original_batch_end = pl_module.on_train_batch_end

        def timed_batch_end(*args: Any, **kwargs: Any):
            self._marks.mark("optimizer")  # OF3 updates the EMA in this hook
            result = original_batch_end(*args, **kwargs)
            self._finish_step(trainer)
            return result

        self._patch(grad_manager, "compute_global_norm", recording_norm)
        # The kit's foreach_loop clips with a norm of its own.
        from of3_megafold.extensions import foreach_loop

        original_foreach_norm = foreach_loop.global_norm

        def recording_foreach_norm(grads):
            norm = original_foreach_norm(grads)
            self._grad_norm = norm.detach()
            return norm

        self._patch(foreach_loop, "global_norm", recording_foreach_norm)
        self._patch(pl_module, "on_train_batch_end", timed_batch_end)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def _unpatch(self) -> None:
        for owner, name, previous in reversed(self._restore):
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._restore = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        self._unpatch()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._unpatch()

    # -- the step's marks -----------------------------------------------------

    def on_train_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> None:
        self._previous_end = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._batch_start = time.perf_counter()
        self._grad_norm = None
        sample = batch_sample(batch)
        self._sample = f"{sample['pdb_id']}/{sample['sampled']}"
        self._input_digest = batch_digest(batch)
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._marks = _Marks(self._cuda)
        self._marks.mark("start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._marks.mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._marks.mark("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._marks.mark("clip")
        if self._grad_norm is None:  # per-sample clipping off: OF3 computed none
            from openfold3.core.utils.grad_manager import compute_global_norm

            self._grad_norm = compute_global_norm(pl_module.parameters())[0].detach()

    def _finish_step(self, trainer: pl.Trainer) -> None:
        self._marks.mark("ema")
        if self._cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        if not self._logged:  # not an optimizer step: OF3 logged no losses
            return
        marks = self._marks
        order = ["start", *PHASES]  # each mark ends the phase of its name
        phases = {
            f"{name}_ms": _round(marks.ms(order[i], order[i + 1]))
            for i, name in enumerate(PHASES)
        }
        row = {
            "step": trainer.global_step,
            "sample": self._sample,
            "input_digest": self._input_digest,
            "rng_digest": rng_digest(),
            "wall_ms": _round((end - self._previous_end) * 1e3),
            "data_wait_ms": _round((self._batch_start - self._previous_end) * 1e3),
            **phases,
            "peak_gib": (
                round(torch.cuda.max_memory_allocated() / GIB, 3)
                if self._cuda
                else None
            ),
            "loss": self._logged.get("loss"),
            "grad_norm": (None if self._grad_norm is None else float(self._grad_norm)),
            "losses": dict(self._logged),
        }
        self._previous_end = end
        self.timed_rows.append(row)
        if self._on_row is not None:
            self._on_row(row)


def batch_digest(batch: Any) -> str:
    """12 hex digits that change with any tensor of ``batch`` (a mapping of tensors,
    nested mappings and lists), computed from each tensor's shape and its float64
    sum and sum of squares, gathered to the host at once."""
    parts: list[str] = []
    stats: list[torch.Tensor] = []

    def visit(key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            parts.append(f"{key}:{tuple(value.shape)}:{value.dtype}")
            flat = value.detach().reshape(-1).to(torch.float64)
            stats.append(torch.stack([flat.sum(), flat.square().sum()]))
        elif isinstance(value, dict):
            for name in sorted(value):
                visit(f"{key}.{name}", value[name])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{key}[{i}]", item)
        else:
            parts.append(f"{key}={value!r}")

    visit("", batch)
    digest = hashlib.sha1("|".join(parts).encode())
    if stats:
        digest.update(torch.stack(stats).cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def rng_digest() -> str:
    """12 hex digits of the process's random state (Python, NumPy, torch's CPU
    generator and, on a GPU, the current device's)."""
    digest = hashlib.sha1(repr(random.getstate()).encode())
    digest.update(repr(np.random.get_state()).encode())
    digest.update(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()[:12]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# -- running one provider --------------------------------------------------------


def _set_token_budget(runner: dict, n_token: int) -> None:
    """Every training dataset's token crop becomes ``n_token``."""
    datasets = (runner.get("dataset_configs") or {}).get("train") or {}
    if not datasets:
        raise KitConfigError("the runner YAML has no dataset_configs.train")
    for dataset in datasets.values():
        crop = dataset.setdefault("config", {}).setdefault("crop", {})
        crop.setdefault("token_crop", {})["token_budget"] = n_token


def bench_runner(
    runner_yaml: Path,
    provider: str,
    n_token: int,
    device: str,
    *,
    steps: int | None = None,
    num_workers: int | None = None,
) -> dict:
    """The runner dict of one provider: the YAML with the provider's model update
    merged into ``model_update.custom`` and the token crop set to ``n_token``.

    ``steps`` stops the fit after that many optimizer steps (``max_steps``) in an
    epoch of the YAML's ``data_module_args.epoch_len`` samples (at least ``steps``):
    OF3 draws an epoch's sample order from its length, so runs of different
    lengths train on the same sequence of samples, the shorter on its first part.

    Placeholders (``${OF3_MEGAFOLD_DEMO}``, ``${OF3_MEGAFOLD_OUTPUT}``) stay for
    :func:`of3_megafold.demo.train.resolve_runner_yaml` to fill.
    """
    from of3_megafold.bench.step import deep_merge, provider_update

    if provider not in PROVIDERS:
        raise KitConfigError(
            f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}"
        )
    runner = yaml.safe_load(Path(runner_yaml).read_text())
    if not isinstance(runner, dict):
        raise KitConfigError(f"{runner_yaml}: not a YAML mapping")
    try:
        update = provider_update(provider, device)
    except ValueError as error:
        raise KitError(str(error)) from error
    model_update = runner.setdefault("model_update", {})
    model_update["custom"] = deep_merge(model_update.get("custom") or {}, update)
    _set_token_budget(runner, n_token)
    if num_workers is not None:
        runner.setdefault("data_module_args", {})["num_workers"] = num_workers
    if steps is not None:
        data_args = runner.setdefault("data_module_args", {})
        data_args["epoch_len"] = max(int(data_args.get("epoch_len") or 0), steps)
        trainer_args = runner.setdefault("pl_trainer_args", {})
        trainer_args.update(max_epochs=1, max_steps=steps)
    # The rows time the steps; the checkpoint a user's run writes at the end is
    # left out (a multi-GB write after the last timed step).
    runner["checkpoint_config"] = {"every_n_epochs": 0, "save_last": False}
    return runner


class StepSeeds(pl.Callback):
    """Seeds Python's, NumPy's and torch's generators (every device's) with
    ``seed * 1_000_003 + step`` as each training batch starts.

    OF3 seeds them once, when the Trainer starts; from then on a step's noise
    depends on every draw before it. Reseeding per step keeps each step's draws
    the same across providers (OF3's recycle count has its own generator,
    ``model.synced_generator``, and the data loader's workers theirs).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step_seed = self.seed * 1_000_003 + trainer.global_step
        random.seed(step_seed)
        np.random.seed(step_seed % 2**32)
        torch.manual_seed(step_seed)


def _recycle_generators(pl_module: pl.LightningModule) -> list[np.random.Generator]:
    """OF3's generators of the recycle count (``synced_generator``), in module order."""
    return [
        module.synced_generator
        for module in pl_module.modules()
        if isinstance(getattr(module, "synced_generator", None), np.random.Generator)
    ]


class _SkippingLoader:
    """A training loader that loads, and drops, its first ``skip`` batches.

    Attributes other than iteration are the wrapped loader's (its ``sampler`` for
    Lightning's ``set_epoch``, its length for the epoch's batch count).
    """

    def __init__(self, loader: Any, skip: int) -> None:
        self.loader = loader
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        for _ in range(self.skip):
            next(batches)
        yield from batches

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _TimeBudget(pl.Callback):
    """Stops the fit after the step during which ``seconds`` ran out."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.deadline is not None and time.monotonic() > self.deadline:
            trainer.should_stop = True


RESUME_STATE_KEY = "of3_megafold_bench_train"
"""The checkpoint's entry for what Lightning does not keep: the state of OF3's
recycle-count generators and the seed the data loader started its epoch with."""


class ResumableRun(pl.Callback):
    """Carries a provider's unfinished run over to a later invocation.

    A run stopped before its last step (``--max-minutes``, a device's time limit)
    saves a Lightning checkpoint (weights, Adam, EMA, the loops' counters) after its
    last finished step, with the state of OF3's recycle-count generator, which
    Lightning does not keep. A run that starts from such a checkpoint (OF3's
    ``experiment_settings.restart_checkpoint_path``) first loads the ``resumed_step``
    batches already trained, without training on them: OF3's data-loader workers
    draw their crops from per-worker generators, so only the same batches in the
    same order bring each worker to the state where the run stopped. The resumed
    steps then see the inputs and random draws of an uninterrupted run (the loader
    also keeps the seed it started the epoch with, which OF3's DataModule would move
    on to the next epoch's).

    Beside the checkpoint (``<name>.ckpt``) a ``<name>.json`` records the run's id,
    its last step and its step count (:func:`read_resume_state`); both are written
    to a temporary name first, so a run killed while saving leaves the previous
    pair.

    Args:
        checkpoint: where the unfinished run's checkpoint is written.
        steps: the run's optimizer steps; reaching them writes no checkpoint.
        run_id: the rows' ``run``, kept by the resumed part.
        resumed_step: the checkpoint's step when resuming, else 0.
    """

    def __init__(
        self, checkpoint: Path, steps: int, run_id: str, resumed_step: int = 0
    ) -> None:
        self.checkpoint = Path(checkpoint)
        self.steps = int(steps)
        self.run_id = run_id
        self.resumed_step = int(resumed_step)
        self.saved = False
        self._wrapper: Any = None
        self._original: Any = None
        self._data_seed: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage) -> None:
        datamodule = trainer.datamodule
        if not self.resumed_step or datamodule is None:
            return
        make_loader = datamodule.train_dataloader

        def resumed_loader() -> _SkippingLoader:
            # OF3's DataModule.load_state_dict assumes a resume at an epoch's end
            # and moves its loader seed on to the next epoch's; mid-epoch the loader
            # must draw its workers' seeds as the stopped run did.
            if self._data_seed is not None:
                datamodule.next_data_seed = self._data_seed
            return _SkippingLoader(make_loader(), self.resumed_step)

        datamodule.train_dataloader = resumed_loader

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint[RESUME_STATE_KEY] = {
            "recycle_generators": [
                generator.bit_generator.state
                for generator in _recycle_generators(pl_module)
            ],
            "data_seed": getattr(trainer.datamodule, "next_data_seed", None),
        }

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if int(checkpoint["global_step"]) != self.resumed_step:
            raise KitError(
                f"{self.checkpoint} holds step {checkpoint['global_step']} but its "
                f"run record step {self.resumed_step}; delete both to start afresh"
            )
        saved = checkpoint.get(RESUME_STATE_KEY)
        if saved is None:  # a checkpoint of another origin
            return
        states = saved["recycle_generators"]
        generators = _recycle_generators(pl_module)
        for generator, state in zip(generators, states, strict=True):
            generator.bit_generator.state = state
        self._data_seed = saved["data_seed"]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning runs the callbacks' on_train_batch_end before the module's, in
        # which OF3 updates its EMA: the checkpoint is written after the module's.
        original = pl_module.on_train_batch_end

        def saving_batch_end(*args: Any, **kwargs: Any):
            result = original(*args, **kwargs)
            if trainer.should_stop and trainer.global_step < self.steps:
                self._save(trainer)
            return result

        self._wrapper = saving_batch_end
        self._original = pl_module.__dict__.get("on_train_batch_end")
        pl_module.on_train_batch_end = saving_batch_end

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unpatch(pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._unpatch(pl_module)

    def _unpatch(self, pl_module: pl.LightningModule) -> None:
        # Another callback (TrainStepTimer) may have unpatched first, taking this
        # wrapper with it.
        if pl_module.__dict__.get("on_train_batch_end") is self._wrapper:
            if self._original is None:
                del pl_module.on_train_batch_end
            else:
                pl_module.on_train_batch_end = self._original

    def _save(self, trainer: pl.Trainer) -> None:
        partial = self.checkpoint.with_name(self.checkpoint.name + ".partial")
        trainer.save_checkpoint(partial)
        state = {"run": self.run_id, "step": trainer.global_step, "steps": self.steps}
        sidecar = self.checkpoint.with_suffix(".json")
        partial_sidecar = sidecar.with_name(sidecar.name + ".partial")
        partial_sidecar.write_text(json.dumps(state))
        partial.replace(self.checkpoint)
        partial_sidecar.replace(sidecar)
        self.saved = True


def read_resume_state(checkpoint: Path) -> dict[str, Any] | None:
    """``{"run", "step", "steps"}`` of an unfinished run saved at ``checkpoint`` by
    :class:`ResumableRun`; None when there is none.

    Raises:
        KitError: the checkpoint exists but its ``.json`` is missing or unreadable.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        return None
    sidecar = checkpoint.with_suffix(".json")
    try:
        state = json.loads(sidecar.read_text())
        return {key: state[key] for key in ("run", "step", "steps")}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise KitError(
            f"{checkpoint}: its run record {sidecar.name} is missing or unreadable "
            f"({error}); delete both to start the run afresh"
        ) from error


def run_train_bench(
    provider: str,
    n_token: int,
    steps: int,
    out_json: Path,
    *,
    runner_yaml: Path = DEFAULT_RUNNER_YAML,
    label: str = "",
    dataset_dir: Path | None = None,
    num_workers: int | None = None,
    max_seconds: float | None = None,
    resume_dir: Path | None = None,
    accelerator: str = "auto",
) -> list[dict[str, Any]]:
    """Train one provider for ``steps`` optimizer steps; append a row per step.

    Args:
        provider: one of :data:`PROVIDERS`.
        n_token: token crop of every training dataset.
        steps: optimizer steps (the first of an epoch of the YAML's length).
        out_json: the rows' file (``train_run.json``); appended to step by step.
        runner_yaml: the OF3 runner YAML (demo placeholders allowed).
        label: names a repeat of the same provider (e.g. ``repeat``).
        dataset_dir: a built demo set; None builds or reuses the cached one.
        num_workers: data-loader workers; None keeps the YAML's.
        max_seconds: stop after the step during which this much time passed.
        resume_dir: where a run stopped before ``steps`` leaves its checkpoint
            (:class:`ResumableRun`), and from where the next call with the same
            provider, label, crop and steps continues it. None: no checkpoint.
        accelerator: ``auto``, ``cpu`` or ``gpu``.

    Returns:
        The rows written.
    """
    from of3_megafold.demo.train import resolve_device, run_demo_training

    check_rows_readable(out_json)
    device, _ = resolve_device(accelerator)
    runner = bench_runner(
        runner_yaml,
        provider,
        n_token,
        "cuda" if device == "gpu" else "cpu",
        steps=steps,
        num_workers=num_workers,
    )
    meta = environment_metadata("cuda" if device == "gpu" else "cpu")
    name = f"{provider}{'-' + label if label else ''}-{n_token}"
    run_id = f"{name}-{meta['date']}"
    resumable = None
    if resume_dir is not None:
        checkpoint = Path(resume_dir) / f"{name}.ckpt"
        resumed = read_resume_state(checkpoint)
        if resumed is not None:
            if resumed["steps"] != steps:
                raise KitConfigError(
                    f"{checkpoint} continues a run of {resumed['steps']} steps, not "
                    f"{steps}: run with --steps {resumed['steps']}, or delete it and "
                    f"its .json to start afresh"
                )
            run_id = resumed["run"]
            runner.setdefault("experiment_settings", {})["restart_checkpoint_path"] = (
                str(checkpoint)
            )
            print(f"  resuming {run_id} after step {resumed['step']}", flush=True)
        Path(resume_dir).mkdir(parents=True, exist_ok=True)
        resumable = ResumableRun(
            checkpoint, steps, run_id, resumed["step"] if resumed else 0
        )
    written: list[dict[str, Any]] = []

    def write(row: dict[str, Any]) -> None:
        full = {
            "provider": provider,
            "label": label or None,
            "n_token": n_token,
            "run": run_id,
            "matmul_precision": torch.get_float32_matmul_precision(),
            **row,
            **meta,
        }
        append_rows(out_json, [full])
        written.append(full)
        print(
            f"  step {row['step']:>3}: {row['wall_ms'] / 1e3:6.2f} s "
            f"(data wait {row['data_wait_ms'] / 1e3:.2f} s), loss {row['loss']:.4g}, "
            f"grad norm {row['grad_norm']:.4g}",
            flush=True,
        )

    timer = TrainStepTimer(on_row=write)
    with (
        tempfile.TemporaryDirectory(prefix="of3mf-bench-train-") as work,
        warnings.catch_warnings(),
        matmul_tf32(split_tf32(provider)[1]),
    ):
        # Lightning warns that a plain loader restarts its epoch on a mid-epoch
        # resume; ResumableRun's loader skips the batches already trained.
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint")
        yaml_path = Path(work) / "bench_train.yml"
        yaml_path.write_text(yaml.safe_dump(runner, sort_keys=False))
        run_demo_training(
            yaml_path,
            Path(work) / "run",
            accelerator=accelerator,
            dataset_dir=dataset_dir,
            progress=False,
            recorder=timer,
            callbacks=[
                StepSeeds((runner.get("experiment_settings") or {}).get("seed", 42)),
                _TimeBudget(max_seconds),
                *([resumable] if resumable else []),
            ],
        )
    if resumable is not None:
        if resumable.saved:
            print(f"  unfinished: {resumable.checkpoint} continues it", flush=True)
        elif written and written[-1]["step"] >= steps:  # nothing left to continue
            resumable.checkpoint.unlink(missing_ok=True)
            resumable.checkpoint.with_suffix(".json").unlink(missing_ok=True)
    return written


# -- the command ----------------------------------------------------------------


@click.command("train")
@click.option(
    "--provider",
    "providers",
    multiple=True,
    type=click.Choice(PROVIDERS),
    help="Provider to train (repeatable; each runs in turn). Default: stock-triton "
    "and kit on a GPU, stock on the CPU.",
)
@click.option(
    "--tokens",
    type=int,
    default=384,
    show_default=True,
    help="Token crop of the training datasets.",
)
@click.option(
    "--steps",
    type=int,
    default=60,
    show_default=True,
    help="Optimizer steps per provider.",
)
@click.option(
    "--runner-yaml",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=DEFAULT_RUNNER_YAML,
    show_default="runner_yamls/train_full.yml",
    help="OF3 runner YAML to train (the demo's placeholders are filled in).",
)
@click.option("--label", default="", help="Names a repeat run of a provider.")
@click.option(
    "--dataset-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A built demo data set (default: build or reuse the cached one).",
)
@click.option("--num-workers", type=int, help="Data-loader workers (default: YAML's).")
@click.option(
    "--max-minutes",
    type=float,
    help="Stop each provider after the step during which this ran out.",
)
@click.option(
    "--resume-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="A provider stopped before --steps leaves its checkpoint here; the same "
    "command continues it from there, on the same samples and random draws.",
)
@out_dir_option(f"Rows are appended to <out-dir>/{JSON_NAME}; the plot is {PLOT_NAME}.")
@click.option(
    "--quick",
    is_flag=True,
    help="The demo's tiny model for 3 steps on the CPU (a smoke run).",
)
@click.option(
    "--summary-only",
    is_flag=True,
    help="Train nothing: print the summary and redraw the plot.",
)
def train_command(
    providers,
    tokens,
    steps,
    runner_yaml,
    label,
    dataset_dir,
    num_workers,
    max_minutes,
    resume_dir,
    out_dir,
    quick,
    summary_only,
) -> None:
    """Train OF3 with its own loop, stock and kit, timing every optimizer step."""
    from of3_megafold import activate

    full_model = Path(runner_yaml).resolve() == DEFAULT_RUNNER_YAML.resolve()
    if full_model and not (quick or summary_only or torch.cuda.is_available()):
        raise click.UsageError(
            "runner_yamls/train_full.yml trains the full model, which is measured on "
            "a CUDA GPU, and none is visible here; --quick is the smoke run for a CPU"
        )
    out_json = Path(out_dir) / JSON_NAME
    with one_line_errors():
        activate()
        if not summary_only:
            if quick:
                from of3_megafold.demo.train import DEFAULT_RUNNER_YAML as demo_yaml

                runner_yaml, steps, tokens = demo_yaml, 3, 48
                accelerator = "cpu"
            else:
                accelerator = "auto"
            on_gpu = accelerator == "auto" and torch.cuda.is_available()
            chosen = providers or (("stock-triton", "kit") if on_gpu else ("stock",))
            for provider in chosen:
                click.echo(f"bench train: {provider}, {tokens} tokens, {steps} steps")
                rows = run_train_bench(
                    provider,
                    tokens,
                    steps,
                    out_json,
                    runner_yaml=runner_yaml,
                    label=label,
                    dataset_dir=dataset_dir,
                    num_workers=num_workers,
                    max_seconds=None if max_minutes is None else max_minutes * 60,
                    resume_dir=resume_dir,
                    accelerator=accelerator,
                )
                click.echo(f"{len(rows)} rows appended to {out_json}")
        rows = read_rows(out_json)
    if not rows:
        raise click.ClickException(f"{out_json} holds no rows")
    click.echo(format_summary(rows))
    click.echo(f"plot: {plot_runs(rows, Path(out_dir) / PLOT_NAME)}")


__all__ = [
    "ResumableRun",
    "StepSeeds",
    "TrainStepTimer",
    "batch_digest",
    "rng_digest",
    "bench_runner",
    "read_resume_state",
    "run_train_bench",
    "train_command",
]
