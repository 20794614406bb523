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
    loss, grad_norm and every loss component OF3 logged

``grad_norm`` is the sample's unclipped gradient norm as OF3's per-sample clipping
computes it (the global norm before ``optimizer.step`` when per-sample clipping is
off). The phases are marked by CUDA events on the GPU timeline (host clock on the
CPU); the step ends with one ``torch.cuda.synchronize`` so that ``wall_ms`` holds
the step's GPU work.

A *provider* is a model-config update merged into ``model_update.custom``, as in
``bench step`` (:func:`of3_megafold.bench.step.provider_update`): ``stock`` (OF3's
defaults), ``stock-triton`` (OF3 with its Triton triangle kernels, what OF3 users
run on a GPU) or ``kit`` (every available extension). The seeds, and so the sample
order, the recycle draws and the diffusion noise, are the YAML's for every provider.

Each step's row is appended to ``<out-dir>/train_run.json`` as soon as the step
ends, so a run cut short (a time limit, a crash) keeps every finished step, and a
later invocation appends to the file. Rows of one invocation share a ``run`` id.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import pytorch_lightning as pl
import torch
import yaml

from of3_megafold.bench.common import (
    GIB,
    append_rows,
    benchmark_dir,
    environment_metadata,
    read_rows,
)
from of3_megafold.demo.train import LossRecorder, batch_sample
from of3_megafold.errors import KitConfigError, KitError

JSON_NAME = "train_run.json"
PLOT_NAME = "train_run.png"
DEFAULT_RUNNER_YAML = (
    Path(__file__).resolve().parents[2] / "runner_yamls" / "train_full.yml"
)
"""``runner_yamls/train_full.yml`` of the kit's source tree."""

PROVIDERS = ("stock", "stock-triton", "kit")

STEADY_FROM = 6
"""First step counted as steady state (compilation, autotuning and the loader's
warm-up are over by then)."""

SMOOTHING = 10
"""Steps in the moving average the loss and gradient-norm curves are compared on."""

PHASES = ("forward", "backward", "clip", "optimizer", "ema")
"""The GPU-timeline phases of a step, in order; a row has ``<phase>_ms`` for each."""


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
    num_workers: int | None = None,
) -> dict:
    """The runner dict of one provider: the YAML with the provider's model update
    merged into ``model_update.custom`` and the token crop set to ``n_token``.

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
    # The rows time the steps; the checkpoint a user's run writes at the end is
    # left out (a multi-GB write after the last timed step).
    runner["checkpoint_config"] = {"every_n_epochs": 0, "save_last": False}
    return runner


class _TimeBudget(pl.Callback):
    """Stops the fit after the step during which ``seconds`` ran out."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.deadline is not None and time.monotonic() > self.deadline:
            trainer.should_stop = True


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
    accelerator: str = "auto",
) -> list[dict[str, Any]]:
    """Train one provider for ``steps`` optimizer steps; append a row per step.

    Args:
        provider: ``stock``, ``stock-triton`` or ``kit``.
        n_token: token crop of every training dataset.
        steps: optimizer steps (one epoch of that many samples).
        out_json: the rows' file (``train_run.json``); appended to step by step.
        runner_yaml: the OF3 runner YAML (demo placeholders allowed).
        label: names a repeat of the same provider (e.g. ``repeat``).
        dataset_dir: a built demo set; None builds or reuses the cached one.
        num_workers: data-loader workers; None keeps the YAML's.
        max_seconds: stop after the step during which this much time passed.
        accelerator: ``auto``, ``cpu`` or ``gpu``.

    Returns:
        The rows written.
    """
    from of3_megafold.demo.train import resolve_device, run_demo_training

    _check_readable(out_json)
    device, _ = resolve_device(accelerator)
    runner = bench_runner(
        runner_yaml,
        provider,
        n_token,
        "cuda" if device == "gpu" else "cpu",
        num_workers=num_workers,
    )
    meta = environment_metadata("cuda" if device == "gpu" else "cpu")
    run_id = f"{provider}{'-' + label if label else ''}-{n_token}-{meta['date']}"
    written: list[dict[str, Any]] = []

    def write(row: dict[str, Any]) -> None:
        full = {
            "provider": provider,
            "label": label or None,
            "n_token": n_token,
            "run": run_id,
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
    with tempfile.TemporaryDirectory(prefix="of3mf-bench-train-") as work:
        yaml_path = Path(work) / "bench_train.yml"
        yaml_path.write_text(yaml.safe_dump(runner, sort_keys=False))
        run_demo_training(
            yaml_path,
            Path(work) / "run",
            steps=steps,
            accelerator=accelerator,
            dataset_dir=dataset_dir,
            progress=False,
            recorder=timer,
            callbacks=[_TimeBudget(max_seconds)],
        )
    return written


def _check_readable(out_json: Path) -> None:
    """Refuse to append to a file that is not a JSON list of rows (nothing is
    overwritten: the rows already there are results of record)."""
    try:
        read_rows(out_json)
    except (ValueError, OSError) as error:
        raise KitError(
            f"{out_json} cannot be read as a list of benchmark rows ({error}); "
            "move it aside or repair it, then run again"
        ) from error


# -- summaries ------------------------------------------------------------------


def latest_runs(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, list[dict]]:
    """The newest run of each ``(provider, label, n_token)``, its rows by step."""
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(dict(row))
    newest: dict[tuple, list[dict]] = {}
    for run_rows in runs.values():
        first = run_rows[0]
        key = (first["provider"], first.get("label"), first["n_token"])
        if key not in newest or first["date"] > newest[key][0]["date"]:
            newest[key] = sorted(run_rows, key=lambda row: row["step"])
    return newest


def moving_average(values: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """Trailing mean over up to ``window`` values: ``out[i] = mean(v[i-w+1..i])``."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def max_relative_gap(
    a: Sequence[Mapping], b: Sequence[Mapping], field: str, after: int = SMOOTHING
) -> float | None:
    """Largest ``|A - B| / |B|`` of the two runs' smoothed ``field`` over the steps
    both have, counting steps after ``after``; None when they share none."""
    by_step_a = {row["step"]: row[field] for row in a if row.get(field) is not None}
    by_step_b = {row["step"]: row[field] for row in b if row.get(field) is not None}
    steps = sorted(set(by_step_a) & set(by_step_b))
    if not steps:
        return None
    smooth_a = moving_average([by_step_a[s] for s in steps])
    smooth_b = moving_average([by_step_b[s] for s in steps])
    gaps = [
        abs(x - y) / abs(y)
        for step, x, y in zip(steps, smooth_a, smooth_b, strict=True)
        if step > after and y != 0
    ]
    return max(gaps) if gaps else None


def steady_summary(run_rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median step time from step :data:`STEADY_FROM` on, and each part's share.

    ``other`` is the wall time outside the marked phases and the data wait:
    Lightning's loop, host work the GPU did not wait for.
    """
    steady = [row for row in run_rows if row["step"] >= STEADY_FROM]
    if not steady:
        return {"steps": 0}
    wall = statistics.median(row["wall_ms"] for row in steady)
    total = sum(row["wall_ms"] for row in steady)

    def share(fields: Sequence[str]) -> float:
        return sum(row.get(f) or 0.0 for row in steady for f in fields) / total

    parts = {
        "data_wait": share(["data_wait_ms"]),
        "forward_backward": share(["forward_ms", "backward_ms"]),
        "clip": share(["clip_ms"]),
        "optimizer_ema": share(["optimizer_ms", "ema_ms"]),
    }
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    peaks = [row["peak_gib"] for row in steady if row.get("peak_gib") is not None]
    return {
        "steps": len(steady),
        "median_ms": wall,
        "shares": parts,
        "peak_gib": max(peaks) if peaks else None,
    }


def format_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """A text table: per newest run its steady step time and shares, and for each
    provider the loss and gradient-norm gap to ``stock-triton`` at the same crop."""
    runs = latest_runs(rows)
    lines = [
        f"{'provider':<22}{'tokens':>7}{'steps':>6}{'median s':>10}{'data':>7}"
        f"{'fwd+bwd':>9}{'clip':>7}{'opt+ema':>9}{'other':>7}{'peak GiB':>10}"
        f"{'loss gap':>10}{'gnorm gap':>11}"
    ]
    for (provider, label, n_token), run_rows in sorted(
        runs.items(), key=lambda item: (item[0][2], item[0][0], item[0][1] or "")
    ):
        summary = steady_summary(run_rows)
        name = provider + (f" ({label})" if label else "")
        reference = runs.get(("stock-triton", None, n_token))
        gaps = ["", ""]
        if reference is not None and reference is not run_rows:
            gaps = [
                _percent(max_relative_gap(run_rows, reference, field))
                for field in ("loss", "grad_norm")
            ]
        if not summary["steps"]:
            lines.append(f"{name:<22}{n_token:>7}{len(run_rows):>6}  (no steady steps)")
            continue
        shares = summary["shares"]
        peak = summary["peak_gib"]
        lines.append(
            f"{name:<22}{n_token:>7}{len(run_rows):>6}"
            f"{summary['median_ms'] / 1e3:>10.2f}"
            + "".join(
                f"{shares[part]:>{width}.0%}"
                for part, width in (
                    ("data_wait", 7),
                    ("forward_backward", 9),
                    ("clip", 7),
                    ("optimizer_ema", 9),
                    ("other", 7),
                )
            )
            + (f"{peak:>10.1f}" if peak is not None else f"{'':>10}")
            + f"{gaps[0]:>10}{gaps[1]:>11}"
        )
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def plot_runs(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``train_run.png``: per crop, the loss, gradient norm (both smoothed over
    :data:`SMOOTHING` steps, raw values faint) and step time of each newest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = latest_runs(rows)
    crops = sorted({key[2] for key in runs})
    fields = (("loss", "loss"), ("grad_norm", "gradient norm"), ("wall_ms", "step s"))
    fig, axes = plt.subplots(
        len(crops), 3, figsize=(13, 3.2 * len(crops)), squeeze=False
    )
    for row_axes, n_token in zip(axes, crops, strict=True):
        for (provider, label, crop), run_rows in sorted(
            runs.items(), key=lambda item: (item[0][0], item[0][1] or "")
        ):
            if crop != n_token:
                continue
            name = provider + (f" ({label})" if label else "")
            for ax, (field, title) in zip(row_axes, fields, strict=True):
                points = [
                    (row["step"], row[field])
                    for row in run_rows
                    if row.get(field) is not None
                ]
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                if field == "wall_ms":
                    ax.plot(steps, [v / 1e3 for v in values], label=name, lw=1)
                else:
                    line = ax.plot(steps, moving_average(values), label=name, lw=1.5)
                    ax.plot(
                        steps, values, color=line[0].get_color(), alpha=0.25, lw=0.8
                    )
                ax.set_title(f"{title}, {n_token} tokens", fontsize=9)
                ax.set_xlabel("optimizer step", fontsize=8)
                ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7)
    gpus = sorted({row.get("gpu") or "?" for rs in runs.values() for row in rs})
    fig.suptitle(f"OF3 training loop, {', '.join(gpus)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the command ----------------------------------------------------------------


@contextlib.contextmanager
def _kit_errors() -> Iterator[None]:
    try:
        yield
    except KitError as error:
        raise click.ClickException(str(error)) from error


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
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=benchmark_dir,
    show_default="docs/benchmarks of the checkout",
    help=f"Rows are appended to <out-dir>/{JSON_NAME}; the plot is {PLOT_NAME}.",
)
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
    out_dir,
    quick,
    summary_only,
) -> None:
    """Train OF3 with its own loop, stock and kit, timing every optimizer step."""
    from of3_megafold import activate

    out_json = Path(out_dir) / JSON_NAME
    with _kit_errors():
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
                    accelerator=accelerator,
                )
                click.echo(f"{len(rows)} rows appended to {out_json}")
        rows = read_rows(out_json)
    if not rows:
        raise click.ClickException(f"{out_json} holds no rows")
    click.echo(format_summary(rows))
    click.echo(f"plot: {plot_runs(rows, Path(out_dir) / PLOT_NAME)}")


__all__ = [
    "TrainStepTimer",
    "bench_runner",
    "format_summary",
    "latest_runs",
    "max_relative_gap",
    "moving_average",
    "plot_runs",
    "run_train_bench",
    "steady_summary",
    "train_command",
]
