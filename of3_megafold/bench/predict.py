"""``of3-megafold bench predict``: OF3's inference timed per provider and token
count, and the largest token count each provider predicts.

One prediction is OF3's model call of ``run_openfold predict`` for one query: the
model in eval mode without autograd (``OpenFold3.forward``: the trunk with OF3's
3 recycles, the 200-step diffusion rollout of 5 samples, the confidence heads),
under bf16 autocast on CUDA (fp32 on the CPU). Featurisation and writing the mmCIF
and confidence files are left out: host work, the same for every provider.

The model is OF3's default model with the ``predict`` preset (chunk-size tuning,
confidence heads offloaded above 2,800 tokens), its weights drawn at random with
the run's seed (the same weights for every provider). OF3 initialises its output
layers (every residual block's output projection, the diffusion module's update,
the confidence and distogram logits) to zero, which would make the trunk an
identity and the predicted atoms depend on the noise alone; those are drawn at
random too (:func:`randomize_zero_weights`), so every output depends on every
module. They are drawn at :data:`OUTPUT_GAIN` of a unit-variance layer: at unit
gain the 48 pairformer blocks over 4 recycles amplify any rounding until two
kernel paths disagree by a quarter of the trunk's norm, and the comparison below
would say nothing. The batch is ``random_of3_features(is_eval=True)``. Providers::

    stock         OF3's eval defaults without its Triton kernels (the CPU's)
    stock-triton  OF3's eval defaults: its Triton triangle kernels, what
                  ``run_openfold predict`` runs on a GPU
    kit           the eval keys of ``runner_yamls/all_on.yml``, what
                  ``of3-megafold predict --overlay runner_yamls/all_on.yml`` runs

Each prediction is reseeded, so providers draw the same diffusion noise; a row
compares its outputs with the first provider's at the same size: ``si_rel_diff``
(the trunk's single representation, relative L2) and ``positions_rms_a`` (the
predicted atoms, RMS difference in Angstrom). Rows carry ``weights:
"random-outputs"`` and the ``output_gain`` of the drawn layers; rows without the
gain drew them at unit gain, and rows without ``weights`` kept OF3's zero output
layers (their ``positions_rms_a``, 0.0, compared nothing).

The largest size: after the fixed sizes, each provider walks ``--ladder`` upwards
until a prediction runs out of memory (a row with ``status: "oom"``, torch's
account of the failed allocation and the function that asked for it). The walk's
predictions roll out ``--ladder-rollout-steps`` steps (20) instead of 200, run
``--ladder-recycles`` recycles (0) instead of 3 and, with
``--ladder-pairformer-blocks k``, the first k of the pairformer stack's 48 blocks:
the rollout repeats one step, the trunk one cycle and the stack one block, each
without autograd, whose activations are freed before the next, so the counts change
the time, not the peak (the blocks left out stay on the device, their weights
counted in the peak); every row records its ``rollout_steps``, ``recycles`` and
``pairformer_blocks``.
The walk stops early, with a ``status: "skipped"`` row saying why, when the next
size's predicted time (the last time scaled by the cube of the size ratio; the
first rung is scaled from the last fixed size, at its full rollout) would overrun
the provider's time budget.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
import yaml

from of3_megafold.bench.common import (
    GIB,
    append_rows,
    check_rows_readable,
    environment_metadata,
    free_device_memory,
    is_out_of_memory,
    out_dir_option,
    out_of_memory_account,
    parse_ints,
    read_rows,
)
from of3_megafold.errors import KitError

JSON_NAME = "predict.json"
ALL_ON_YAML = Path(__file__).resolve().parents[2] / "runner_yamls" / "all_on.yml"
"""``runner_yamls/all_on.yml`` of the kit's source tree: the kit's eval keys."""

PROVIDERS = ("stock", "stock-triton", "kit")
DEFAULT_LADDER = (1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120)
SEED = 0
OUTPUT_GAIN = 0.1
"""Scale of OF3's zero-initialised layers when drawn, against ``N(0, 1 / fan_in)``.
The full model at 32 tokens, fp32 on the CPU, with every weight then perturbed by
1e-3 (relative): the trunk's single representation moves 0.12 (relative L2) at
gain 1, 7.3e-3 at 0.3 and 2.5e-3 at 0.1, where a rounding difference stays of its
own size."""


def _eval_memory(flags: dict[str, Any]) -> dict:
    return {"settings": {"memory": {"eval": flags}}}


def predict_update(provider: str) -> dict:
    """The model-config update (``model_update.custom``) of ``provider``."""
    if provider == "stock":
        return _eval_memory({"use_triton_triangle_kernels": False})
    if provider == "stock-triton":
        return _eval_memory({"use_triton_triangle_kernels": True})
    if provider == "kit":
        overlay = yaml.safe_load(ALL_ON_YAML.read_text())
        flags = overlay["model_update"]["custom"]["settings"]["memory"]["eval"]
        return _eval_memory(dict(flags))
    raise KitError(
        f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}"
    )


def predict_model_config(provider: str, config: str = "full", update=None):
    """OF3's model config with the ``predict`` preset, ``config``'s update
    (:data:`of3_megafold.bench.step.CONFIGS`), the provider's, then ``update``."""
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    from of3_megafold.bench.step import CONFIGS, deep_merge

    if config not in CONFIGS:
        raise KitError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    custom = deep_merge(CONFIGS[config], predict_update(provider))
    custom = deep_merge(custom, update or {})
    return OF3ProjectEntry().get_model_config_with_update(
        ModelUpdate(presets=["predict"], custom=custom)
    )


@dataclass
class Prediction:
    """One timed prediction: wall time, peak memory and the outputs compared."""

    ms: float
    peak_gib: float | None
    si_trunk: torch.Tensor  # [N_token * C_s] on the CPU, fp32
    positions: torch.Tensor  # [N_samples, N_atom, 3] on the CPU, fp32


@dataclass(frozen=True)
class Ladder:
    """The largest-query walk (module docstring): its sizes, and the rollout
    steps, recycles and pairformer blocks of its predictions (None: the config's)."""

    sizes: Sequence[int]
    rollout_steps: int | None
    recycles: int | None
    pairformer_blocks: int | None


class Predictor:
    """One provider's model in eval mode, ready to predict random queries.

    Args:
        provider: a name in :data:`PROVIDERS`.
        device: where to run; bf16 autocast on CUDA, fp32 elsewhere.
        config: ``full`` (OF3's model) or ``tiny`` (CPU tests).
        update: more model-config keys (e.g. fewer rollout steps for a test).
        seed: seed of the weights and of every prediction's noise.
    """

    def __init__(self, provider, device, config="full", update=None, seed=SEED):
        from of3_megafold.bench.step.harness import random_model, seed_everything

        self.provider = provider
        self.device = torch.device(device)
        self.seed = seed
        self._reseed = seed_everything
        self.config = predict_model_config(provider, config, update)
        self.model = random_model(self.config, seed)
        randomize_zero_weights(self.model, seed)
        self.model.to(self.device).eval()

    def batch(self, n_token: int, n_msa: int, n_templ: int) -> dict:
        """A random inference query of ``n_token`` tokens (batch size 1), without
        ground truth (which would make OF3 align and score the prediction)."""
        from openfold3.core.utils.tensor_utils import tensor_tree_map
        from openfold3.tests.utils.data_utils import random_of3_features

        self._reseed(self.seed)
        batch = random_of3_features(1, n_token, n_msa, n_templ, is_eval=True)
        batch.pop("ground_truth", None)
        return tensor_tree_map(lambda t: t.to(self.device), batch)

    def predict(self, batch: dict) -> Prediction:
        """Run and time one prediction on ``batch``."""
        from openfold3.core.utils.tensor_utils import tensor_tree_map

        cuda = self.device.type == "cuda"
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if cuda
            else contextlib.nullcontext()
        )
        batch = tensor_tree_map(lambda t: t, batch)  # OF3 replaces dict entries
        self._reseed(self.seed)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        with torch.no_grad(), autocast:
            _, outputs = self.model(batch)
        if cuda:
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - started) * 1e3
        return Prediction(
            ms=ms,
            peak_gib=torch.cuda.max_memory_allocated(self.device) / GIB
            if cuda
            else None,
            si_trunk=outputs["si_trunk"].detach().float().reshape(-1).cpu(),
            positions=outputs["atom_positions_predicted"].detach().float().cpu(),
        )

    @property
    def rollout_steps(self) -> int:
        """The diffusion rollout's step count of the next prediction."""
        return int(self.model.shared.diffusion.no_full_rollout_steps)

    @property
    def recycles(self) -> int:
        """The trunk's recycles in the next prediction."""
        return int(self.model.shared.num_recycles)

    @property
    def pairformer_blocks(self) -> int:
        """The pairformer stack's blocks run in the next prediction."""
        return len(self.model.pairformer_stack.blocks)

    @contextlib.contextmanager
    def shortened(
        self, steps: int | None, recycles: int | None, blocks: int | None = None
    ) -> Iterator[None]:
        """Within, predictions roll out ``steps`` steps, run ``recycles`` recycles
        and the first ``blocks`` of the pairformer stack's blocks (None: the
        config's counts, every block). The blocks left out stay on the device:
        the weights' memory is the full model's."""
        shared, stack = self.model.shared, self.model.pairformer_stack
        before = shared.diffusion.no_full_rollout_steps, shared.num_recycles
        every_block = stack.blocks
        if steps is not None:
            shared.diffusion.no_full_rollout_steps = steps
        if recycles is not None:
            shared.num_recycles = recycles
        if blocks is not None:
            stack.blocks = torch.nn.ModuleList(list(every_block)[:blocks])
        try:
            yield
        finally:
            shared.diffusion.no_full_rollout_steps, shared.num_recycles = before
            stack.blocks = every_block

    def close(self) -> None:
        del self.model
        free_device_memory()


def randomize_zero_weights(
    model: torch.nn.Module, seed: int, gain: float = OUTPUT_GAIN
) -> list[str]:
    """Draw every all-zero weight matrix of ``model`` (OF3's ``final``-initialised
    output layers) from ``N(0, gain^2 / fan_in)``, in place, with a generator seeded
    by ``seed``: the same values for every provider's model.

    Returns:
        The names of the weights drawn.
    """
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() < 2 or weight.any():
                continue
            values = torch.randn(weight.shape, generator=generator)
            weight.copy_(values * (gain / weight.shape[-1] ** 0.5))
            drawn.append(name)
    return drawn


def compare(prediction: Prediction, reference: Prediction) -> dict[str, float]:
    """``si_rel_diff`` and ``positions_rms_a`` of ``prediction`` against
    ``reference`` (module docstring)."""
    si = prediction.si_trunk - reference.si_trunk
    positions = prediction.positions - reference.positions
    return {
        "si_rel_diff": float(si.norm() / reference.si_trunk.norm().clamp_min(1e-30)),
        "positions_rms_a": float(positions.square().sum(-1).mean().sqrt()),
    }


def walk_ladder(
    attempt: Callable[[int], float],
    ladder: Sequence[int],
    budget_s: float,
    last: tuple[int, float] | None = None,
) -> Iterator[dict[str, Any]]:
    """Walk ``ladder`` upwards, yielding one outcome per size tried.

    ``attempt(n)`` predicts at ``n`` tokens and returns its seconds, or raises an
    out-of-memory error. Yields ``{"n_token", "status": "ok", "seconds"}``, then at
    the first out-of-memory ``{"n_token", "status": "oom", "oom_message",
    "oom_raised_in"}`` (:func:`out_of_memory_account`) and stops; stops with
    ``{"n_token", "status": "skipped", "reason"}`` when the next size's predicted
    time (``last`` seconds at ``last`` size, scaled by the cube of the size ratio)
    exceeds what is left of ``budget_s``. ``last`` seeds the prediction with an
    earlier measurement.
    """
    started = time.monotonic()
    for n in sorted(ladder):
        left = budget_s - (time.monotonic() - started)
        if last is not None:
            predicted = last[1] * (n / last[0]) ** 3
            if predicted > left:
                yield {
                    "n_token": n,
                    "status": "skipped",
                    "reason": f"predicted {predicted:.0f} s > {max(left, 0):.0f} s "
                    "left of the time budget",
                }
                return
        try:
            seconds = attempt(n)
        except Exception as error:  # noqa: BLE001 - only OOM is an outcome
            if not is_out_of_memory(error):
                raise
            account = out_of_memory_account(error)
        else:
            last = (n, seconds)
            yield {"n_token": n, "status": "ok", "seconds": seconds}
            continue
        # Yielded outside the except block: the error's traceback, which holds the
        # failed prediction's tensors, is gone before the caller frees memory.
        yield {"n_token": n, "status": "oom", **account}
        return


def run_predict_bench(
    providers: Sequence[str],
    sizes: Sequence[int],
    out_json: Path,
    *,
    ladder: Sequence[int] = (),
    ladder_rollout_steps: int | None = 20,
    ladder_recycles: int | None = 0,
    ladder_pairformer_blocks: int | None = None,
    budget_s: float = 600.0,
    n_msa: int = 16,
    n_templ: int = 2,
    device: str = "cuda",
    config: str = "full",
    update: dict | None = None,
) -> list[dict[str, Any]]:
    """Time every provider at ``sizes``, then walk ``ladder`` (module docstring);
    append a row per outcome to ``out_json`` as it happens.

    Returns:
        The rows written.
    """
    check_rows_readable(out_json)
    meta = environment_metadata(device)
    written: list[dict[str, Any]] = []
    references: dict[int, Prediction] = {}

    def write(provider: str, fields: dict[str, Any]) -> None:
        row = {
            "provider": provider,
            "config": config,
            "n_msa": n_msa,
            "n_templ": n_templ,
            "precision": "bf16-autocast" if device == "cuda" else "fp32",
            "weights": "random-outputs",
            "output_gain": OUTPUT_GAIN,
            **fields,
            **meta,
        }
        append_rows(out_json, [row])
        written.append(row)
        click.echo(_describe(row))

    for provider in providers:
        predictor = Predictor(provider, device, config, update)
        try:
            _run_provider(
                predictor,
                sizes,
                Ladder(
                    ladder,
                    ladder_rollout_steps,
                    ladder_recycles,
                    ladder_pairformer_blocks,
                ),
                budget_s,
                (n_msa, n_templ),
                references,
                lambda fields, provider=provider: write(provider, fields),
            )
        finally:
            predictor.close()
    return written


def _run_provider(
    predictor: Predictor,
    fixed_sizes: Sequence[int],
    ladder: Ladder,
    budget_s: float,
    msa_templ: tuple[int, int],
    references: dict[int, Prediction],
    write: Callable[[dict[str, Any]], None],
) -> None:
    """One provider: a warm-up and a timed prediction at each of ``fixed_sizes``, the
    outputs compared with ``references`` (the first provider's, filled in by it),
    then the ladder walk, one prediction per size.

    Raises:
        KitError: the ladder's pairformer blocks are not within 1 and the stack's
            block count (before anything is predicted).
    """
    blocks = ladder.pairformer_blocks
    if blocks is not None and not 1 <= blocks <= predictor.pairformer_blocks:
        raise KitError(
            f"--ladder-pairformer-blocks {blocks}: the pairformer stack has "
            f"{predictor.pairformer_blocks} blocks"
        )

    def timed(n_token: int, warm_up: bool) -> Prediction:
        batch = predictor.batch(n_token, *msa_templ)
        if warm_up:
            predictor.predict(batch)  # compiles, autotunes, tunes chunk sizes
        return predictor.predict(batch)

    def settings() -> dict[str, int]:
        return {
            "rollout_steps": predictor.rollout_steps,
            "recycles": predictor.recycles,
            "pairformer_blocks": predictor.pairformer_blocks,
        }

    def fields(n_token: int, result: Prediction) -> dict[str, Any]:
        peak = None if result.peak_gib is None else round(result.peak_gib, 3)
        return {
            "n_token": n_token,
            "status": "ok",
            "ms": round(result.ms, 1),
            "peak_gib": peak,
            **settings(),
        }

    last = None
    for n_token in fixed_sizes:
        result = timed(n_token, warm_up=True)
        row = fields(n_token, result)
        reference = references.setdefault(n_token, result)
        if reference is not result:
            row.update(compare(result, reference))
        write(row)
        last = (n_token, result.ms / 1e3)

    def attempt(n_token: int) -> float:
        result = timed(n_token, warm_up=False)
        write({**fields(n_token, result), "ladder": True})
        return result.ms / 1e3

    with predictor.shortened(ladder.rollout_steps, ladder.recycles, blocks):
        for outcome in walk_ladder(attempt, ladder.sizes, budget_s, last):
            free_device_memory()
            if outcome["status"] != "ok":
                write({**outcome, **settings(), "ladder": True})


def _stop_reason(row: dict[str, Any]) -> str | None:
    """Why a ladder row is not ``ok``: a skip's reason, an out-of-memory's function."""
    raised_in = row.get("oom_raised_in")
    return row.get("reason") or (f"in {raised_in}" if raised_in else None)


def _describe(row: dict[str, Any]) -> str:
    head = f"  {row['provider']:<13}{row['n_token']:>6} tokens: "
    if row["status"] != "ok":
        why = _stop_reason(row)
        return head + row["status"] + (f" ({why})" if why else "")
    text = f"{row['ms'] / 1e3:8.2f} s"
    if row.get("peak_gib") is not None:
        text += f", {row['peak_gib']:.1f} GiB"
    if "si_rel_diff" in row:
        text += (
            f", vs the first provider: trunk {row['si_rel_diff']:.2e} relative, "
            f"atoms {row['positions_rms_a']:.3g} A RMS"
        )
    return head + text


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    """Per provider of the newest date: time and memory at each fixed size, and the
    largest size predicted (with what stopped the walk)."""
    if not rows:
        return "no rows"
    newest = max(row["date"][:10] for row in rows)
    rows = [row for row in rows if row["date"][:10] == newest]
    lines = [f"{'provider':<14}{'tokens':>7}{'seconds':>9}{'peak GiB':>10}  note"]
    for provider in dict.fromkeys(row["provider"] for row in rows):
        own = [row for row in rows if row["provider"] == provider]
        for row in own:
            if row["status"] != "ok":
                continue
            peak = row.get("peak_gib")
            lines.append(
                f"{provider:<14}{row['n_token']:>7}{row['ms'] / 1e3:>9.2f}"
                + (f"{peak:>10.1f}" if peak is not None else f"{'':>10}")
                + ("  ladder" if row.get("ladder") else "")
            )
        if not any(row.get("ladder") for row in own):
            continue
        largest = max(
            (row["n_token"] for row in own if row["status"] == "ok"), default=None
        )
        stop = next((row for row in own if row["status"] != "ok"), None)
        why = _stop_reason(stop) if stop else None
        lines.append(
            f"{provider:<14} largest: {largest}"
            + (f"; {stop['n_token']}: {stop['status']}" if stop else "")
            + (f" ({why})" if why else "")
        )
    return "\n".join(lines)


@click.command("predict")
@click.option(
    "--provider",
    "providers",
    multiple=True,
    type=click.Choice(PROVIDERS),
    help="Provider (repeatable; the first is the reference of the output "
    "comparison). Default: stock-triton and kit on a GPU, stock on the CPU.",
)
@click.option(
    "--tokens",
    default="384,768",
    show_default=True,
    help="Comma-separated token counts timed for every provider.",
)
@click.option(
    "--ladder",
    default=",".join(map(str, DEFAULT_LADDER)),
    show_default=True,
    help="Larger token counts walked per provider up to the first out-of-memory; "
    "'' walks none.",
)
@click.option(
    "--ladder-rollout-steps",
    type=int,
    default=20,
    show_default=True,
    help="Diffusion rollout steps of the ladder's predictions (time, not memory).",
)
@click.option(
    "--ladder-recycles",
    type=int,
    default=0,
    show_default=True,
    help="Trunk recycles of the ladder's predictions (time, not memory).",
)
@click.option(
    "--ladder-pairformer-blocks",
    type=click.IntRange(min=1),
    default=None,
    help="Run only the first k of the pairformer stack's blocks in the ladder's "
    "predictions (time, not memory; the others stay loaded). Default: all.",
)
@click.option(
    "--budget-minutes",
    type=float,
    default=10.0,
    show_default=True,
    help="Per provider: the ladder stops before a size predicted to overrun this.",
)
@out_dir_option(f"Rows are appended to <out-dir>/{JSON_NAME}.")
@click.option(
    "--quick",
    is_flag=True,
    help="The tiny model on the CPU, 4 rollout steps, 16 and 24 tokens, no ladder.",
)
def predict_command(
    providers,
    tokens,
    ladder,
    ladder_rollout_steps,
    ladder_recycles,
    ladder_pairformer_blocks,
    budget_minutes,
    out_dir,
    quick,
):
    """Time OF3's inference, stock and kit, and find each one's largest query."""
    from of3_megafold import activate

    activate()
    out_json = Path(out_dir) / JSON_NAME
    on_gpu = torch.cuda.is_available() and not quick
    device = "cuda" if on_gpu else "cpu"
    chosen = providers or (("stock-triton", "kit") if on_gpu else ("stock",))
    if quick:
        sizes, ladder_sizes, config = [16, 24], [], "tiny"
        update = {
            "architecture": {
                "shared": {
                    "diffusion": {
                        "no_full_rollout_steps": 4,
                        "no_full_rollout_samples": 2,
                    }
                }
            }
        }
    else:
        sizes, ladder_sizes, config, update = (
            parse_ints(tokens),
            parse_ints(ladder),
            "full",
            None,
        )
    try:
        run_predict_bench(
            chosen,
            sizes,
            out_json,
            ladder=ladder_sizes,
            ladder_rollout_steps=ladder_rollout_steps,
            ladder_recycles=ladder_recycles,
            ladder_pairformer_blocks=ladder_pairformer_blocks,
            budget_s=budget_minutes * 60,
            device=device,
            config=config,
            update=update,
        )
    except KitError as error:
        raise click.ClickException(str(error)) from error
    click.echo(format_summary(read_rows(out_json)))
    click.echo(f"rows: {out_json}")


__all__ = [
    "Predictor",
    "predict_command",
    "predict_update",
    "randomize_zero_weights",
    "run_predict_bench",
    "walk_ladder",
]
