"""``of3-megafold bench step``: time every provider at every crop size, then search
each one's largest trainable crop; rows are appended to JSON as they are measured."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import torch

from of3_megafold.bench.common import (
    append_rows,
    benchmark_json,
    environment_metadata,
    parse_ints,
)
from of3_megafold.bench.step import max_crop as crop_search
from of3_megafold.bench.step.harness import TrainingStepHarness
from of3_megafold.bench.step.measure import (
    format_table,
    log_row,
    measure_step,
    step_row,
)
from of3_megafold.bench.step.providers import (
    CONFIGS,
    available_providers,
    provider_update,
)

logger = logging.getLogger(__name__)

DEFAULT_JSON_NAME = "step"


def run_step_bench(
    providers: Sequence[str] | None = None,
    tokens: Sequence[int] = (384, 768),
    n_msa: int = 1024,
    n_templ: int = 4,
    config: str = "full",
    repeats: int = 3,
    warmup: int = 2,
    out_json: Path | str | None = None,
    max_crop: bool = False,
    *,
    max_crop_ladder: Sequence[int] = crop_search.MAX_CROP_LADDER,
    max_crop_start: Mapping[str, int] | None = None,
    launch_tokens: Collection[int] | None = None,
    num_recycles: int | None = None,
    device: torch.device | str | None = None,
    fresh_probes: bool = True,
) -> list[dict[str, Any]]:
    """Time training steps for each provider and crop size; append rows to JSON.

    For each provider in turn (one model alive at a time): for each crop size in
    ``tokens`` (ascending), ``warmup`` steps then ``repeats`` timed steps on one
    random batch, then one profiled step counting kernel launches. A size that runs
    out of memory gives a row with ``oom: True``; larger sizes are then skipped.
    With ``max_crop``, once every provider has been timed, search each provider's
    largest trainable crop (on a rebuilt model with the same weights).

    Args:
        providers: Provider names; ``None`` = :func:`available_providers`.
        tokens: Crop sizes (``n_token``) to time.
        n_msa: MSA depth of the random batch.
        n_templ: Number of templates.
        config: Name in :data:`CONFIGS` (``full`` or ``tiny``).
        repeats: Timed steps per size (median reported).
        warmup: Untimed steps per size first: Triton autotuning, allocator warm-up,
            and the trunk graphs' captures (the cycle with autograd is captured at
            the second step).
        out_json: File to append rows to; ``None`` = ``docs/benchmarks/step.json``.
            Rows are appended as they are measured, so an interrupted run keeps them.
        max_crop: Also find the largest crop that fits: one step per size on
            ``max_crop_ladder``, starting at ``max_crop_start[provider]`` (default:
            the rung above the largest size in ``tokens`` that fitted), walking up
            until out of memory, or down until a size fits.
        launch_tokens: Sizes at which to count kernel launches (a profiled step
            each); ``None`` = every size in ``tokens``. Only on CUDA.
        num_recycles: Fixed recycle count; ``None`` = OF3's first training draw.
        device: ``None`` = CUDA if available, else CPU.
        fresh_probes: Run each max-crop probe in a new process (its own model,
            CUDA context and caching allocator), as a training run at that crop
            starts; ``False``: one model and process per search, where a probe
            inherits the allocator's state from the one before (on the H200,
            1728 tokens ran out of memory after a 1664 probe, yet fitted at
            122.5 GiB in a fresh process).

    Returns:
        The rows written: ``mode`` is ``step`` (timed sizes), ``max_crop_probe``
        (one search step) or ``max_crop`` (the search result, in ``max_crop``).
        Timed rows hold ``provider, config, n_token, n_atom, n_msa, n_templ, ms``
        (median per step), ``step_ms, first_step_ms, peak_gib`` (absolute
        ``max_memory_allocated`` during the step: weights, batch, activations,
        gradients), ``start_gib``, ``launches`` (kernels run) and ``host_launches``
        (launch calls, a graph replay one) and ``gpu_busy_ms`` (the GPU's busy time),
        all three of one profiled step, ``recycles, loss`` (OF3's loss breakdown)
        and the :func:`environment_metadata` fields.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = torch.device(
        device
        if device is not None
        else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    providers = (
        list(providers) if providers is not None else available_providers(device)
    )
    for name in providers:
        provider_update(name, device)  # fail before any work if one cannot run
    out_json = (
        Path(out_json) if out_json is not None else benchmark_json(DEFAULT_JSON_NAME)
    )
    metadata = environment_metadata(device)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        append_rows(out_json, [row])

    fits: dict[str, list[int]] = {provider: [] for provider in providers}
    too_big: dict[str, list[int]] = {provider: [] for provider in providers}
    identities: dict[str, dict[str, Any]] = {}  # of the providers timed

    def harness_for(provider: str) -> contextlib.closing[TrainingStepHarness]:
        logger.info("step bench: building the %s model for %s", config, provider)
        return contextlib.closing(
            TrainingStepHarness(config, provider, device, num_recycles=num_recycles)
        )

    # Every provider's timed sizes first, the (long) crop searches after, so a run
    # cut short still holds the side-by-side comparison.
    for provider in providers if tokens else ():
        with harness_for(provider) as harness:
            identities[provider] = harness.identity()
            for n_token in sorted(tokens):
                if too_big[provider]:
                    logger.info("%s: skipping %d tokens", provider, n_token)
                    continue
                count = device.type == "cuda" and (
                    launch_tokens is None or n_token in launch_tokens
                )
                fields = measure_step(
                    harness, n_token, n_msa, n_templ, warmup, repeats, count
                )
                decided = too_big if fields["oom"] or "error" in fields else fits
                decided[provider].append(n_token)
                who = identities[provider]
                emit(step_row(who, "step", n_token, n_msa, n_templ, metadata, **fields))
                log_row(rows[-1])
    for provider in providers if max_crop else ():
        search = functools.partial(
            crop_search.run_max_crop,
            provider,
            known=identities.get(provider),
            n_msa=n_msa,
            n_templ=n_templ,
            ladder=max_crop_ladder,
            start=(max_crop_start or {}).get(provider),
            fits=fits[provider],
            too_big=too_big[provider],
            metadata=metadata,
            emit=emit,
        )
        if fresh_probes:
            spec = crop_search.ProbeSpec(
                config,
                provider,
                str(device),
                num_recycles,
                n_msa,
                n_templ,
                logging.getLogger().getEffectiveLevel(),
            )
            search(
                measure=functools.partial(crop_search.probe_in_fresh_process, spec),
                process="fresh",
            )
            continue
        with harness_for(provider) as harness:
            search(
                measure=functools.partial(
                    crop_search.probe_step, harness, n_msa=n_msa, n_templ=n_templ
                ),
                process="same",
            )
    return rows


def _int_list(_ctx, _param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return parse_ints(value)
    except ValueError as error:
        raise click.BadParameter(
            f"expected comma-separated integers: {value}"
        ) from error


@click.command("step")
@click.option(
    "--provider",
    "-p",
    "providers",
    multiple=True,
    help="Provider to run (repeatable): stock, stock-triton, stock-cueq, "
    "stock-deepspeed, kit, an extension name, or kit-without-<extension> (the kit "
    "less one extension); any of them with -tf32 appended runs with TF32 matmuls "
    "(kit-tf32). Default: every provider available here except the stock-cueq and "
    "stock-deepspeed ones, in OF3's fp32 precision.",
)
@click.option(
    "--tokens",
    callback=_int_list,
    default="384,768",
    show_default=True,
    help="Comma-separated crop sizes.",
)
@click.option("--n-msa", type=int, default=1024, show_default=True)
@click.option("--n-templ", type=int, default=4, show_default=True)
@click.option(
    "--config", type=click.Choice(sorted(CONFIGS)), default="full", show_default=True
)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option(
    "--warmup",
    type=int,
    default=2,
    show_default=True,
    help="Untimed steps per size (the trunk graphs capture their cycle with "
    "autograd at the second).",
)
@click.option(
    "--max-crop",
    is_flag=True,
    help="Also search each provider's largest trainable crop.",
)
@click.option(
    "--fresh-probes/--same-process-probes",
    default=True,
    show_default=True,
    help="Run each max-crop probe in a new process (as a training run at that crop "
    "starts), or all of a provider's probes on one model in this one.",
)
@click.option(
    "--launch-tokens",
    callback=_int_list,
    default=None,
    help="Sizes at which to count kernel launches (default: all).",
)
@click.option(
    "--num-recycles",
    type=int,
    default=None,
    help="Fixed recycle count (default: OF3's first training draw).",
)
@click.option(
    "--out",
    "out_json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON file to append to (default: docs/benchmarks/step.json).",
)
def step_command(
    providers,
    tokens,
    n_msa,
    n_templ,
    config,
    repeats,
    warmup,
    max_crop,
    fresh_probes,
    launch_tokens,
    num_recycles,
    out_json,
) -> None:
    """Time full OpenFold3 training steps (forward + loss + backward) per provider."""
    if config == "full" and not torch.cuda.is_available():
        raise click.UsageError(
            "the full model's training step is measured on a CUDA GPU and none is "
            "visible here; --config tiny runs the same bench on this CPU"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = run_step_bench(
        providers=list(providers) or None,
        tokens=tokens,
        n_msa=n_msa,
        n_templ=n_templ,
        config=config,
        repeats=repeats,
        warmup=warmup,
        out_json=out_json,
        max_crop=max_crop,
        fresh_probes=fresh_probes,
        launch_tokens=launch_tokens,
        num_recycles=num_recycles,
    )
    click.echo(format_table(rows))
