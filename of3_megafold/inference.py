"""OF3 inference as ``run_openfold predict`` runs it, with three things it lacks.

:func:`run_inference` follows ``openfold3.run_openfold.predict``
(``InferenceExperimentConfig`` -> ``InferenceExperimentRunner`` -> ``setup()`` ->
``run(query_set)`` -> ``cleanup()``) and adds:

- :func:`switch_off_gpu_only_eval_defaults`: on a machine without CUDA, OF3's
  eval defaults that need a GPU (``settings.memory.eval.use_triton_triangle_kernels``
  is on by default) are switched off, with one logged line, instead of failing
  every query inside the model. A runner YAML that asks for one of them on such a
  machine is refused before anything is written.
- :func:`stop_on_signals`: SIGTERM stops the run like Ctrl-C. Lightning's own
  SIGTERM handler only records the signal and lets prediction run on.
- :class:`InferenceResult`: the queries OF3's output writer counted as failed.
  OF3 logs them and exits 0; the ``of3-megafold predict`` command exits 1 and
  names them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from of3_megafold.errors import KitConfigError

logger = logging.getLogger(__name__)

GPU_ONLY_EVAL_FLAGS = (
    "use_triton_triangle_kernels",
    "use_deepspeed_evo_attention",
    "use_cueq_triangle_kernels",
)
"""``settings.memory.eval`` flags whose kernels run only on a GPU (OF3's Triton
evoformer attention, DeepSpeed's evoformer attention, cuEquivariance). OF3's base
config turns the first on."""


class PredictionInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT stopped the prediction (an interrupt, so ``except
    Exception`` handlers let it through; the message is for the user).

    Attributes:
        signum: the signal's number (the command exits with ``128 + signum``).
    """

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class _Terminated(KeyboardInterrupt):
    """Raised by the SIGTERM handler: a ``KeyboardInterrupt``, so Lightning runs
    its interrupt path (``on_exception`` callbacks, teardown) and OF3's
    ``except Exception`` around each query does not swallow it."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[dict[str, int]]:
    """Make SIGTERM and SIGINT raise ``KeyboardInterrupt`` in the main thread.

    Lightning installs its own SIGTERM handler when a ``Trainer`` starts and
    calls the handler already installed after its own, so the one installed here
    still runs. The yielded dict gets ``"signum"`` once a signal arrives (Lightning
    turns the interrupt into ``SystemExit(1)``; the caller tells the two apart by
    it). Previous handlers are restored on exit. Outside the main thread (where
    Python cannot install handlers) this does nothing.
    """
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: Any) -> None:
        received["signum"] = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Terminated(f"received {signal.Signals(signum).name}")

    previous = {
        signum: signal.signal(signum, interrupt)
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _nested(mapping: dict, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return None
        mapping = mapping[key]
    return mapping


def model_config_for(runner: dict[str, Any]) -> Any:
    """The model config (``ml_collections.ConfigDict``) a runner's ``model_update``
    gives: OF3's presets, then ``custom``. Building it runs OF3's and the kit's
    checks, so a bad key or value stops here, before OF3 writes anything.

    A runner without ``model_update`` gets ``InferenceExperimentConfig``'s default
    (the ``predict`` preset), written into ``runner``.
    """
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    runner.setdefault("model_update", {"presets": ["predict"]})
    update = ModelUpdate.model_validate(runner["model_update"])
    return OF3ProjectEntry().get_model_config_with_update(update)


def switch_off_gpu_only_eval_defaults(runner: dict[str, Any]) -> list[str]:
    """Turn off the GPU-only eval flags a runner would get from OF3's defaults.

    Builds the model config the runner's ``model_update`` gives
    (:func:`model_config_for`, which also checks the keys and values). Each flag of
    :data:`GPU_ONLY_EVAL_FLAGS` that is on there, but not set in the runner
    YAML, is set to false in ``model_update.custom.settings.memory.eval``, and
    one line is logged. Call it only where the run will not use CUDA.

    Args:
        runner: a runner dict for ``InferenceExperimentConfig``; changed in place.

    Returns:
        The flags switched off.

    Raises:
        KitConfigError: the runner YAML itself sets one of the flags to true.
    """
    memory = model_config_for(runner).settings.memory
    custom = runner["model_update"].setdefault("custom", {})
    asked = _nested(custom, "settings", "memory", "eval") or {}

    requested = [flag for flag in GPU_ONLY_EVAL_FLAGS if asked.get(flag)]
    if requested:
        keys = ", ".join(
            f"model_update.custom.settings.memory.eval.{flag}" for flag in requested
        )
        raise KitConfigError(
            f"{keys}: true needs a CUDA GPU, and this run is not on one (no CUDA "
            "device, or pl_trainer_args.accelerator: cpu); set it to false"
        )
    defaults_on = [flag for flag in GPU_ONLY_EVAL_FLAGS if memory.eval.get(flag)]
    if defaults_on:
        eval_settings = (
            custom.setdefault("settings", {})
            .setdefault("memory", {})
            .setdefault("eval", {})
        )
        eval_settings.update(dict.fromkeys(defaults_on, False))
        logger.warning(
            "Not on a CUDA device: switched off OF3's GPU-only eval default(s) %s "
            "(settings.memory.eval)",
            ", ".join(defaults_on),
        )
    return defaults_on


def runs_on_cuda(runner: dict[str, Any]) -> bool:
    """Whether the runner's ``pl_trainer_args.accelerator`` will put the model on
    a CUDA device here (OF3's default accelerator is ``gpu``)."""
    import torch

    accelerator = str(_nested(runner, "pl_trainer_args", "accelerator") or "gpu")
    return accelerator.lower() in ("gpu", "cuda", "auto") and torch.cuda.is_available()


@dataclass
class InferenceResult:
    """What one :func:`run_inference` produced.

    Attributes:
        output_dir: OF3's output directory: ``<query>/seed_<seed>/`` per query,
            ``summary.txt``, ``logs/predict_err_rank<r>.log`` for failures.
        queries: the query ids that were run.
        failed_queries: those OF3's output writer counted as failed (sorted).
        seconds: wall time from setup to the end of prediction.
    """

    output_dir: Path
    queries: list[str]
    failed_queries: list[str]
    seconds: float

    def structure_files(self) -> list[Path]:
        """The predicted structures written (``*_model.<format>``), sorted."""
        return sorted(
            path
            for query in self.queries
            for path in (self.output_dir / query).glob("seed_*/*_model.*")
        )

    def confidence_files(self) -> list[Path]:
        """Per-sample confidences (``*_confidences*.json`` or ``.npz``), sorted."""
        return sorted(
            path
            for query in self.queries
            for path in (self.output_dir / query).glob("seed_*/*_confidences*")
        )


def failed_queries(callbacks: list) -> list[str]:
    """Query ids OF3's ``OF3OutputWriter`` recorded as failed in this process.

    The writer adds a query there when its data pipeline or its forward pass
    failed (OF3's ``predict_step`` then returns None) or when writing its outputs
    failed; OF3 prints them in its summary and goes on.
    """
    from openfold3.core.runners.writer import OF3OutputWriter

    failed = set()
    for callback in callbacks:
        if isinstance(callback, OF3OutputWriter):
            failed.update(callback.failed_queries)
    return sorted(failed)


def run_inference(
    runner: dict[str, Any],
    query_set: Any,
    *,
    inference_ckpt_path: Path | None = None,
    inference_ckpt_name: str | None = None,
    num_diffusion_samples: int | None = None,
    num_model_seeds: int | None = None,
    use_msa_server: bool | None = None,
    use_templates: bool | None = None,
    output_dir: Path | None = None,
    user_default_runner_yaml_path: Path | None = None,
    runner_copy: str | None = None,
) -> InferenceResult:
    """Run OF3 inference as ``run_openfold predict`` does, with the additions above.

    The kit's extensions take effect only if :func:`of3_megafold.activate` ran
    first. The keyword arguments are ``run_openfold predict``'s options; a
    checkpoint given here replaces one the runner names.

    Args:
        runner: the merged runner dict (``InferenceExperimentConfig`` fields);
            its model update is checked first (:func:`model_config_for`), and
            GPU-only eval defaults are switched off in it when the run will not
            use CUDA.
        query_set: an OF3 ``InferenceQuerySet``.
        runner_copy: if given, the runner is written to
            ``<output_dir>/<runner_copy>`` (YAML) once OF3 has accepted it, as
            given (the switch-off above happens again where it is reused).

    Returns:
        The output directory and the failed queries.

    Raises:
        PredictionInterrupted: SIGTERM or SIGINT arrived.
        KitConfigError: the runner asks for a GPU-only kernel on a CPU run.
    """
    import yaml
    from openfold3.entry_points.experiment_runner import InferenceExperimentRunner
    from openfold3.entry_points.validator import InferenceExperimentConfig

    portable = copy.deepcopy(runner)
    if runs_on_cuda(runner):
        model_config_for(runner)
    else:
        switch_off_gpu_only_eval_defaults(runner)
    fields = dict(runner)
    if inference_ckpt_path is not None or inference_ckpt_name is not None:
        fields["inference_ckpt_path"] = inference_ckpt_path
        fields["inference_ckpt_name"] = inference_ckpt_name

    start = time.perf_counter()
    with stop_on_signals() as received:
        try:
            config = InferenceExperimentConfig(
                user_default_runner_yaml_path=user_default_runner_yaml_path,
                **fields,
            )
            experiment = InferenceExperimentRunner(
                config,
                num_diffusion_samples,
                num_model_seeds,
                use_msa_server,
                use_templates,
                output_dir,
            )
            if runner_copy is not None:
                (experiment.output_dir / runner_copy).write_text(
                    yaml.safe_dump(portable, sort_keys=False)
                )
            try:
                experiment.setup()
                experiment.run(query_set)
            except BaseException:
                experiment.cleanup_msa_workspace()
                raise
            experiment.cleanup()
        except (KeyboardInterrupt, SystemExit) as interrupt:
            if "signum" not in received:
                raise
            name = signal.Signals(received["signum"]).name
            where = output_dir or _nested(runner, "experiment_settings", "output_dir")
            raise PredictionInterrupted(
                f"{name} received: prediction stopped; the queries finished "
                f"before it are in {where or 'the output directory'}",
                received["signum"],
            ) from interrupt
    return InferenceResult(
        output_dir=Path(experiment.output_dir),
        queries=list(query_set.queries),
        failed_queries=failed_queries(experiment.callbacks),
        seconds=round(time.perf_counter() - start, 1),
    )


def sequence_query(sequences: tuple[str, ...], name: str = "query") -> dict:
    """One OF3 query of protein chains ``A``, ``B``, ... with these sequences.

    Returns:
        ``{"queries": {name: {"chains": [...]}}}``, for ``InferenceQuerySet``.
    """
    if len(sequences) > len(string.ascii_uppercase):
        raise KitConfigError(
            f"{len(sequences)} sequences given; at most 26 chains this way "
            "(use a query JSON for more)"
        )
    chains = [
        {"molecule_type": "protein", "chain_ids": [chain_id], "sequence": sequence}
        for chain_id, sequence in zip(string.ascii_uppercase, sequences, strict=False)
    ]
    return {"queries": {name: {"chains": chains}}}


def load_query_set(query: Path | dict) -> Any:
    """An OF3 ``InferenceQuerySet`` from a query JSON file or a dict of one.

    Raises:
        KitConfigError: the JSON is not a valid OF3 query set (names the file).
    """
    import pydantic
    from openfold3.projects.of3_all_atom.config.inference_query_format import (
        InferenceQuerySet,
    )

    try:
        if isinstance(query, dict):
            return InferenceQuerySet.model_validate(query)
        return InferenceQuerySet.from_json(query)
    except pydantic.ValidationError as err:
        source = query if not isinstance(query, dict) else "the query"
        raise KitConfigError(f"{source}: not a valid OF3 query set:\n{err}") from err


def print_summary(result: InferenceResult, heading: str, **lines: Any) -> None:
    """Where the predictions went: the output directory, the first structure and
    confidence file and how many more, OF3's summary, and ``lines`` (label: value)."""

    def first_of(paths: list[Path]) -> str:
        if not paths:
            return "(none)"
        more = f" (+{len(paths) - 1} more)" if len(paths) > 1 else ""
        return f"{paths[0]}{more}"

    ok = len(result.queries) - len(result.failed_queries)
    rows = {
        **lines,
        "output": result.output_dir,
        "structures": first_of(result.structure_files()),
        "confidences": first_of(result.confidence_files()),
        "summary": result.output_dir / "summary.txt",
    }
    print(
        f"\n{heading}: {ok} of {len(result.queries)} queries predicted in "
        f"{result.seconds:.0f} s"
    )
    for label, value in rows.items():
        print(f"  {label.replace('_', ' '):<12} {value}")
