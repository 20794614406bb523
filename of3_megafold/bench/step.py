"""``of3-megafold bench step``: one full OpenFold3 training step, provider by provider.

A step is what OF3's Lightning module runs per batch (``OpenFold3AllAtom.
_training_step_manual_clip`` in ``projects/of3_all_atom/runner.py``)::

    batch, outputs = model(batch)                      # OpenFold3, training mode
    loss, breakdown = loss_fn(batch, outputs, _return_breakdown=True)
    loss.backward()

under ``torch.autocast("cuda", torch.bfloat16)`` with fp32 weights (Lightning's
``bf16-mixed``) on CUDA, plain fp32 on CPU. Gradient clipping, the optimiser and the
EMA update are left out: they cost the same for every provider. So is their memory
(Adam moments, EMA weights, OF3's per-sample gradient accumulator: about 5.5 GiB for
the full model), which a real training run needs on top of ``peak_gib``.

The model is OF3's default model with the ``train`` preset (as ``OF3ProjectEntry``
builds it for ``run_openfold train``; 368 M parameters, 48 diffusion samples,
activation checkpointing), or the ``tiny`` config for CPU smoke tests. The batch is
``openfold3.tests.utils.data_utils.random_of3_features`` with the token-level
ground-truth keys filled in: without them OF3's permutation alignment fails, its
last-resort fallback zeroes every loss weight and the step learns nothing.
:class:`LossesDisabledError` is raised if that happens anyway.

A *provider* is a model-config update, a nested dict merged into OF3's model config
exactly like ``model_update.custom`` in a runner YAML: ``stock`` is ``{}``,
``stock-triton`` turns on OF3's own Triton triangle-attention kernel, ``kit`` turns
on every available kit extension, each kit extension is also a provider of its
own name, and ``kit-without-<extension>`` is the kit less one extension.
``stock-cueq`` (``-tf32``: with TF32 matmuls, which its fp32 backward needs) and
``stock-deepspeed`` turn on OF3's flags for cuEquivariance's and DeepSpeed's kernels;
they run only when named, and a failure of theirs is a row's ``error``. All providers
run in one process on the same weights (same seed) and the same batch, so their
times and losses can be compared directly.

Determinism: before every step the Python, NumPy and torch generators are reseeded
and OF3's ``model.synced_generator`` (which draws the number of recycles in
training) is reset to ``np.random.default_rng(sync_seed)``, so every step makes
OF3's first training draw: 3 recycles with the default ``sync_seed`` 0. Pass
``num_recycles`` to fix another count.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import logging
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from of3_megafold.bench.common import (
    GIB,
    append_rows,
    benchmark_json,
    count_kernel_launches,
    environment_metadata,
    free_device_memory,
    is_out_of_memory,
    parse_ints,
)

logger = logging.getLogger(__name__)

DEFAULT_JSON_NAME = "step"

# Provider name -> model-config update (merged like `model_update.custom`).
PROVIDERS: dict[str, dict] = {
    "stock": {},
    "stock-triton": {
        "settings": {"memory": {"train": {"use_triton_triangle_kernels": True}}}
    },
}

# OF3's flags for other projects' kernels (cuEquivariance: its triangle attention and
# triangle multiplication; DeepSpeed: its evoformer attention) -> (the rival in
# of3_megafold.bench.rivals, the update, TF32 matmuls on). Run only when named,
# never by default. cuEquivariance's triangle-attention backward refuses fp32 inputs
# unless TF32 matmuls are allowed (its error says so), and OF3 runs some of its
# attention in fp32: ``stock-cueq-tf32`` allows them, for the whole step, as a user
# would have to.
_CUEQ = {"settings": {"memory": {"train": {"use_cueq_triangle_kernels": True}}}}
RIVAL_PROVIDERS: dict[str, tuple[str, dict, bool]] = {
    "stock-cueq": ("cueq", _CUEQ, False),
    "stock-cueq-tf32": ("cueq", _CUEQ, True),
    "stock-deepspeed": (
        "deepspeed",
        {"settings": {"memory": {"train": {"use_deepspeed_evo_attention": True}}}},
        False,
    ),
}


@contextlib.contextmanager
def _matmul_tf32(enabled: bool):
    """Inside, fp32 matmuls may use TF32 (float32 matmul precision ``high``) if
    ``enabled``; the precision is restored on leaving."""
    before = torch.get_float32_matmul_precision()
    if enabled and before == "highest":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# Config name -> update applied on top of OF3's default config + `train` preset.
CONFIGS: dict[str, dict] = {
    "full": {},
    # A few-thousand-parameter-per-block model that runs a step in well under a
    # second on a CPU core, yet passes through every module of the full one (two
    # MSA blocks so the pair-weighted averaging is exercised).
    "tiny": {
        "architecture": {
            "shared": {
                "c_s": 32,
                "c_z": 16,
                "diffusion": {"no_samples": 2, "no_mini_rollout_steps": 2},
            },
            "input_embedder": {
                "atom_attn_enc": {
                    "c_token": 32,
                    "c_atom": 16,
                    "c_atom_pair": 8,
                    "no_blocks": 1,
                }
            },
            "template": {"c_t": 16, "template_pair_stack": {"no_blocks": 1}},
            "msa": {
                "msa_module_embedder": {"c_m": 16},
                "msa_module": {"no_blocks": 2, "c_hidden_mul": 16, "c_hidden_opm": 8},
            },
            "pairformer": {"no_blocks": 1, "c_hidden_mul": 16},
            "diffusion_module": {
                "diffusion_module": {"c_token": 32},
                "diffusion_transformer": {"no_blocks": 1},
                "atom_attn_enc": {"no_blocks": 1},
                "atom_attn_dec": {"no_blocks": 1},
            },
            "heads": {
                "pairformer_embedding": {
                    "pairformer": {"no_blocks": 1, "c_hidden_mul": 16}
                }
            },
        }
    },
}

# Token-level features that `random_of3_features` leaves out of `ground_truth` but
# OF3's permutation alignment reads there.
GROUND_TRUTH_TOKEN_KEYS = (
    "token_index",
    "token_mask",
    "num_atoms_per_token",
    "asym_id",
    "entity_id",
    "sym_id",
    "residue_index",
    "is_ligand",
    "restype",
    "is_protein",
    "is_dna",
    "is_rna",
    "is_atomized",
    "atom_to_token_index",
    "start_atom_index",
    "ref_space_uid",
    "atom_mask",
)

# Crop sizes tried by the largest-crop search.
MAX_CROP_LADDER = (384, 512, 768, 1024, 1280, 1536, 1792, 2048)

SEED = 0


class LossesDisabledError(RuntimeError):
    """The step ran but trained nothing: OF3 switched its losses off."""


# --------------------------------------------------------------------- providers


@functools.cache
def _registry_extensions() -> dict[str, tuple[dict, bool, str]]:
    """The kit's extensions as ``{name: (enable_update, available, reason)}``.

    The only place this module touches the kit's registry
    (``of3_megafold.registry.EXTENSIONS``: name -> extension with ``enable_update``
    and ``available() -> (bool, reason)``). It is imported lazily; without it the
    result is empty and only the stock providers exist. The kit is activated first
    (unless it already is: activating again would reset a ``force``) so that the
    extensions are registered and their keys exist in OF3's model config before an
    update naming them is merged. Cached: asked once per process.
    """
    try:
        from of3_megafold import registry
    except ModuleNotFoundError as error:
        if error.name != "of3_megafold.registry":
            raise
        return {}
    from of3_megafold import activate, is_active

    if not is_active():
        activate()
    extensions = {}
    for name, extension in registry.EXTENSIONS.items():
        if extension.min_processes > 1:  # this harness times one process
            continue
        ok, reason = extension.available()
        extensions[name] = (_plain(extension.enable_update), ok, reason)
    return extensions


KIT_WITHOUT = "kit-without-"
"""Provider prefix: ``kit-without-<extension>`` is ``kit`` less that extension (what
the extension buys inside the kit, in the same run)."""


def kit_provider_updates(without: str | None = None) -> dict[str, dict]:
    """Providers the kit adds: each available extension by name, and ``kit`` with
    all available extensions on (all but ``without`` if given). Empty without the
    registry."""
    available = {
        name: update for name, (update, ok, _) in _registry_extensions().items() if ok
    }
    if not available:
        return {}
    everything: dict = {}
    for name, update in available.items():
        if name != without:
            everything = deep_merge(everything, update)
    return {"kit": everything, **_plain(available)}


def provider_availability(name: str, device: torch.device | str) -> tuple[bool, str]:
    """Whether provider ``name`` can run on ``device``, and why not."""
    device = torch.device(device)
    if name == "stock":
        return True, ""
    if name == "stock-triton":
        if device.type != "cuda":
            return False, "OF3's Triton triangle kernel needs a CUDA device"
        return True, ""
    if name in RIVAL_PROVIDERS:
        from of3_megafold.bench import rivals

        reason = rivals.unavailable(RIVAL_PROVIDERS[name][0])
        if reason is None and device.type != "cuda":
            reason = f"{name} needs a CUDA device"
        return reason is None, reason or ""
    extensions = _registry_extensions()
    if name == "kit":
        if any(ok for _, ok, _ in extensions.values()):
            return True, ""
        if not extensions:
            return False, "the kit's extension registry is not installed"
        reasons = "; ".join(f"{n}: {r}" for n, (_, _, r) in extensions.items())
        return False, f"no kit extension is available ({reasons})"
    if name in extensions:
        _, ok, reason = extensions[name]
        return ok, reason
    if name.startswith(KIT_WITHOUT):
        left_out = name.removeprefix(KIT_WITHOUT)
        if left_out not in extensions:
            return False, f"{name}: no kit extension {left_out!r}"
        if not extensions[left_out][1]:
            return False, f"{name}: {left_out} is unavailable here, so kit is the same"
        return True, ""
    known = ", ".join(sorted({*PROVIDERS, *RIVAL_PROVIDERS, "kit", *extensions,
                              f"{KIT_WITHOUT}<extension>"}))
    return False, f"unknown provider {name!r}; known providers: {known}"


def available_providers(device: torch.device | str) -> list[str]:
    """Default provider list on ``device``: stock, stock-triton on CUDA, and the
    kit (all extensions, then each alone) when the registry offers it."""
    names = [*PROVIDERS, *kit_provider_updates()]
    return [name for name in names if provider_availability(name, device)[0]]


def provider_update(name: str, device: torch.device | str) -> dict:
    """The model-config update of provider ``name``.

    Raises:
        ValueError: ``name`` is unknown or cannot run on ``device``; the message
            says why (an explicit request never falls back silently).
    """
    ok, reason = provider_availability(name, device)
    if not ok:
        raise ValueError(f"provider {name!r} is unavailable: {reason}")
    if name in PROVIDERS:
        return copy.deepcopy(PROVIDERS[name])
    if name in RIVAL_PROVIDERS:
        return copy.deepcopy(RIVAL_PROVIDERS[name][1])
    if name.startswith(KIT_WITHOUT):
        return kit_provider_updates(without=name.removeprefix(KIT_WITHOUT))["kit"]
    return kit_provider_updates()[name]


def _plain(value: Any) -> Any:
    """``value`` with every nested mapping turned into a fresh plain dict."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return copy.deepcopy(value)


def deep_merge(base: Mapping, update: Mapping) -> dict:
    """``base`` with ``update`` merged in recursively, as plain dicts (neither
    argument is modified)."""
    merged = _plain(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = _plain(value)
    return merged


def build_model_config(config: str, update: Mapping | None = None):
    """OF3's model config with the ``train`` preset, then ``CONFIGS[config]``, then
    ``update``, built as ``OF3ProjectEntry.get_model_config_with_update`` builds
    the config of a training run (locked: unknown keys raise ``KeyError``)."""
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    custom = deep_merge(CONFIGS[config], update or {})
    return OF3ProjectEntry().get_model_config_with_update(
        ModelUpdate(presets=["train"], custom=custom)
    )


# ------------------------------------------------------------------------ batch


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def random_training_batch(
    n_token: int,
    n_msa: int,
    n_templ: int,
    device: torch.device | str = "cpu",
    seed: int = SEED,
) -> dict:
    """A random full-model training batch (batch size 1) on ``device``.

    ``random_of3_features(1, n_token, n_msa, n_templ)`` with the token-level
    features in :data:`GROUND_TRUTH_TOKEN_KEYS` copied into ``batch["ground_truth"]``
    so that OF3's permutation alignment has what it reads. All floating features are
    fp32 (Lightning's ``bf16-mixed`` leaves inputs in fp32 and lets autocast cast).
    """
    from openfold3.core.utils.tensor_utils import tensor_tree_map
    from openfold3.tests.utils.data_utils import random_of3_features

    _seed_everything(seed)
    batch = random_of3_features(
        batch_size=1, n_token=n_token, n_msa=n_msa, n_templ=n_templ
    )
    for key in GROUND_TRUTH_TOKEN_KEYS:
        batch["ground_truth"][key] = batch[key].clone()
    return tensor_tree_map(lambda t: t.to(device), batch)


# ------------------------------------------------------------------------- step


class _FixedRecycles:
    """Stands in for ``model.synced_generator`` and always draws ``count``."""

    def __init__(self, count: int):
        self.count = count

    def integers(self, low: int, high: int) -> int:
        if not low <= self.count < high:
            raise ValueError(
                f"num_recycles={self.count} is outside OF3's range [{low}, {high})"
            )
        return self.count


class _AlignmentWatch(logging.Filter):
    """Records which permutation-alignment path OF3 took during a step.

    With random features OF3's full multi-chain alignment lacks ``mol_entity_id``
    and falls back to its naive alignment every step, logging a traceback each time;
    that expected message is recorded and kept out of the log. Anything else passes.
    """

    def __init__(self):
        super().__init__()
        self.naive = False
        self.losses_off = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "turning off losses" in message:
            self.losses_off = True
        if "falling back to naive alignment" in message:
            self.naive = True
            return False
        return True


@contextlib.contextmanager
def _watch_alignment() -> Iterator[_AlignmentWatch]:
    watched = logging.getLogger("openfold3.core.utils.permutation_alignment")
    watch = _AlignmentWatch()
    watched.addFilter(watch)
    try:
        yield watch
    finally:
        watched.removeFilter(watch)


@contextlib.contextmanager
def _torch_truncated_normal_init() -> Iterator[None]:
    """Sample OF3's truncated-normal weight init with torch instead of SciPy.

    OF3 draws every LeCun/He-initialised weight with ``scipy.stats.truncnorm.rvs``
    (``primitives/initialization.py::trunc_normal_init_``): about 3 minutes for the
    368 M-parameter model on a busy 2-core host, most of a short GPU session. This
    draws from the same distribution (a normal truncated at +-2 standard
    deviations, rescaled to OF3's fan-in variance) with ``torch.nn.init.
    trunc_normal_``, in seconds. Same idea as OF3's own ``skip_random_init``
    (``entry_points/experiment_runner.py``), which swaps the same function.
    """
    from openfold3.core.model.primitives import initialization
    from scipy.stats import truncnorm

    unit_std = float(truncnorm.std(a=-2, b=2, loc=0, scale=1))

    def trunc_normal_init_(weights, scale=1.0, fan="fan_in"):
        fan_size = initialization._calculate_fan(weights.shape, fan)
        std = math.sqrt(scale / max(1, fan_size)) / unit_std
        with torch.no_grad():
            torch.nn.init.trunc_normal_(weights, 0.0, std, -2 * std, 2 * std)

    original = initialization.trunc_normal_init_
    initialization.trunc_normal_init_ = trunc_normal_init_
    try:
        yield
    finally:
        initialization.trunc_normal_init_ = original


@dataclass
class StepResult:
    """What one training step produced."""

    ms: float
    peak_gib: float | None
    start_gib: float | None
    loss: dict[str, float]
    grad_norm: float
    recycles: int
    permutation_alignment: str


class TrainingStepHarness:
    """One OF3 model and loss for one provider, ready to time training steps.

    Args:
        config: Name in :data:`CONFIGS`.
        provider: Provider name (see :func:`provider_update`).
        device: Where to run; bf16 autocast on CUDA, fp32 elsewhere.
        num_recycles: Fixed number of recycles per step; ``None`` reseeds OF3's own
            generator before each step (OF3's first training draw every time).
        seed: Seed for the weights and every step's randomness.
        update: More model-config keys, merged over the provider's update (e.g.
            ``{"settings": {"sequence_parallel_size": 2}}``).
    """

    def __init__(
        self,
        config: str,
        provider: str,
        device: torch.device | str,
        num_recycles: int | None = None,
        seed: int = SEED,
        update: Mapping | None = None,
    ):
        from openfold3.core.loss.loss_module import OpenFold3Loss
        from openfold3.projects.of3_all_atom.model import OpenFold3

        self.device = torch.device(device)
        self.config_name = config
        self.provider = provider
        self.seed = seed
        self.num_recycles = num_recycles
        self.config = build_model_config(
            config, deep_merge(provider_update(provider, device), update or {})
        )
        self.amp_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        _seed_everything(seed)
        with _torch_truncated_normal_init():
            self.model = OpenFold3(self.config)
        self.model.to(self.device).train()
        self.loss_fn = OpenFold3Loss(config=self.config.architecture.loss_module)
        self.params_m = sum(p.numel() for p in self.model.parameters()) / 1e6

    @property
    def precision(self) -> str:
        return "bf16-autocast" if self.amp_dtype is not None else "fp32"

    @property
    def no_samples(self) -> int:
        return int(self.config.architecture.shared.diffusion.no_samples)

    def identity(self) -> dict[str, Any]:
        """The fields that name this harness in a row (:func:`_row`)."""
        return {
            "provider": self.provider,
            "config": self.config_name,
            "no_samples": self.no_samples,
            "precision": self.precision,
            "params_m": round(self.params_m, 2),
        }

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _prepare(self) -> None:
        _seed_everything(self.seed)
        self.model.synced_generator = (
            _FixedRecycles(self.num_recycles)
            if self.num_recycles is not None
            else np.random.default_rng(self.config.architecture.shared.sync_seed)
        )
        self.model.zero_grad(set_to_none=True)

    def _forward_backward(self, batch: dict) -> tuple[dict, dict, dict]:
        from openfold3.core.utils.tensor_utils import tensor_tree_map

        # A fresh dict tree each step: OF3 pops and replaces entries of the batch
        # dicts it is given (never the tensors themselves).
        batch = tensor_tree_map(lambda t: t, batch)
        with self._autocast():
            batch, outputs = self.model(batch)
            loss, breakdown = self.loss_fn(batch, outputs, _return_breakdown=True)
            loss.backward()
        return batch, outputs, breakdown

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, batch: dict) -> StepResult:
        """Run and time one training step on ``batch``; check that it trained.

        Raises:
            LossesDisabledError: OF3's permutation alignment fell back to switching
                all losses off, or the total loss is zero.
            FloatingPointError: the loss is not finite.
            torch.cuda.OutOfMemoryError: the step does not fit.
        """
        self._prepare()
        cuda = self.device.type == "cuda"
        if cuda:
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            start_bytes = torch.cuda.memory_allocated(self.device)
        with _watch_alignment() as watch:
            started = time.perf_counter()
            batch, outputs, breakdown = self._forward_backward(batch)
            self._sync()
            ms = (time.perf_counter() - started) * 1e3
        peak_gib = torch.cuda.max_memory_allocated(self.device) / GIB if cuda else None
        loss = {name: float(value) for name, value in breakdown.items()}
        weights_off = all(
            not torch.any(weight != 0) for weight in batch["loss_weights"].values()
        )
        if watch.losses_off or weights_off or loss.get("loss", 0.0) == 0.0:
            raise LossesDisabledError(
                "OF3 switched the losses off (permutation alignment failed even in "
                "its naive fallback, all loss weights are zero): this step trains "
                f"nothing and its timing is meaningless. Loss breakdown: {loss}"
            )
        if not all(np.isfinite(value) for value in loss.values()):
            raise FloatingPointError(f"non-finite loss in the breakdown: {loss}")
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm) or grad_norm == 0.0:
            raise FloatingPointError(f"gradient norm {grad_norm} after the step")
        return StepResult(
            ms=ms,
            peak_gib=peak_gib,
            start_gib=start_bytes / GIB if cuda else None,
            loss=loss,
            grad_norm=grad_norm,
            recycles=int(outputs["recycles"]),
            permutation_alignment="naive" if watch.naive else "full",
        )

    def _grad_norm(self) -> float:
        # At OF3's initialisation the zero-initialised output layers make the loss
        # independent of most weights; the gradient is not, so comparing its norm
        # across providers checks that they really computed the same step.
        norms = [
            torch.linalg.vector_norm(p.grad.float())
            for p in self.model.parameters()
            if p.grad is not None
        ]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def count_launches(self, batch: dict) -> int | None:
        """Kernel launches of one training step (``None`` off CUDA)."""
        self._prepare()
        return count_kernel_launches(lambda: self._forward_backward(batch))

    def close(self) -> None:
        """Drop the model so the next provider starts from an empty device."""
        del self.model, self.loss_fn
        free_device_memory()


# ------------------------------------------------------------------- benchmark


def _row(
    identity: Mapping[str, Any],
    mode: str,
    n_token: int,
    n_msa: int,
    n_templ: int,
    metadata: dict,
    **fields: Any,
) -> dict[str, Any]:
    """A JSON row: ``identity`` (:meth:`TrainingStepHarness.identity`), the case,
    the measured ``fields`` and the environment ``metadata``."""
    return {
        "bench": "step",
        "mode": mode,
        "provider": identity["provider"],
        "config": identity["config"],
        "n_token": n_token,
        "n_msa": n_msa,
        "n_templ": n_templ,
        "no_samples": identity["no_samples"],
        "precision": identity["precision"],
        "params_m": identity["params_m"],
        "matmul_precision": torch.get_float32_matmul_precision(),
        **fields,
        **metadata,
    }


def _measure(
    harness: TrainingStepHarness,
    n_token: int,
    n_msa: int,
    n_templ: int,
    warmup: int,
    repeats: int,
    count_launches: bool,
) -> dict[str, Any]:
    """Warm-up steps, then ``repeats`` timed steps (and one profiled step).

    Returns the row fields; ``oom`` is True (and the timings ``None``) when a step
    does not fit, and a rival provider's failure is an ``error`` field rather than
    an exception. ``matmul_precision`` is read while the steps run (a rival provider
    may switch TF32 on for them). Memory is freed before returning in any case.
    """
    rival = RIVAL_PROVIDERS.get(harness.provider)
    tf32 = bool(rival and rival[2])
    batch = random_training_batch(n_token, n_msa, n_templ, harness.device, harness.seed)
    n_atom = int(batch["atom_mask"].shape[-1])
    results: list[StepResult] = []
    launches = None
    first_ms = None
    out_of_memory = False
    failure = None
    try:
        with _matmul_tf32(tf32):
            matmul_precision = torch.get_float32_matmul_precision()
            for index in range(warmup + repeats):
                result = harness.step(batch)
                if index == 0:
                    first_ms = result.ms
                if index >= warmup:
                    results.append(result)
    except Exception as error:
        if is_out_of_memory(error):
            out_of_memory = True
        elif rival is not None:
            failure = f"{type(error).__name__}: {str(error).strip()}"[:300]
        else:
            raise
    if count_launches and not (out_of_memory or failure):
        try:
            with _matmul_tf32(tf32):
                launches = harness.count_launches(batch)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            logger.warning(
                "%s @ %d tokens: the profiled step ran out of memory; launches "
                "not counted",
                harness.provider,
                n_token,
            )
    # Outside the except block the traceback (and the activations its frames hold)
    # is gone; now the memory can really be handed back.
    del batch
    harness.model.zero_grad(set_to_none=True)
    free_device_memory()
    fields = {"n_atom": n_atom, "matmul_precision": matmul_precision}
    if out_of_memory or failure:
        fields.update(oom=out_of_memory, ms=None, first_step_ms=first_ms)
        if failure:
            fields["error"] = failure
        return fields
    last = results[-1]
    peaks = [r.peak_gib for r in results if r.peak_gib is not None]
    return {
        **fields,
        "oom": False,
        "ms": statistics.median(r.ms for r in results),
        "step_ms": [round(r.ms, 3) for r in results],
        "first_step_ms": first_ms,
        "warmup": warmup,
        "repeats": repeats,
        "peak_gib": max(peaks) if peaks else None,
        "start_gib": last.start_gib,
        "launches": launches,
        "recycles": last.recycles,
        "permutation_alignment": last.permutation_alignment,
        "loss": last.loss,
        "grad_norm": last.grad_norm,
    }


def _search_max_crop(
    probe: Callable[[int], bool],
    ladder: Sequence[int],
    start: int,
    fits: Collection[int],
    too_big: Collection[int],
) -> tuple[int | None, dict[int, bool]]:
    """Largest rung of ``ladder`` for which ``probe`` succeeds.

    Starts at rung ``start`` and walks up while steps fit, or down while they do
    not, assuming memory grows with the crop: sizes up to the largest in ``fits``
    fit and sizes from the smallest in ``too_big`` do not, without probing.
    Returns the largest fitting size (``None`` if none) and ``{size: fitted}`` for
    every size decided (probed or inferred).
    """
    ladder = sorted(ladder)
    known: dict[int, bool] = {}

    def fitted(size: int) -> bool:
        if size not in known:
            if fits and size <= max(fits):
                known[size] = True
            elif too_big and size >= min(too_big):
                known[size] = False
            else:
                known[size] = probe(size)
        return known[size]

    index = min(range(len(ladder)), key=lambda i: abs(ladder[i] - start))
    if fitted(ladder[index]):
        while index + 1 < len(ladder) and fitted(ladder[index + 1]):
            index += 1
        return ladder[index], known
    while index > 0:
        index -= 1
        if fitted(ladder[index]):
            return ladder[index], known
    return None, known


def run_step_bench(
    providers: Sequence[str] | None = None,
    tokens: Sequence[int] = (384, 768),
    n_msa: int = 1024,
    n_templ: int = 4,
    config: str = "full",
    repeats: int = 3,
    warmup: int = 1,
    out_json: Path | str | None = None,
    max_crop: bool = False,
    *,
    max_crop_ladder: Sequence[int] = MAX_CROP_LADDER,
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
        warmup: Untimed steps per size first (Triton autotuning, allocator warm-up).
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
            inherits the allocator's state from the one before (on the H200 in
            session 24, 1728 tokens ran out of memory after a 1664 probe and fitted
            at 122.5 GiB in a fresh process).

    Returns:
        The rows written: ``mode`` is ``step`` (timed sizes), ``max_crop_probe``
        (one search step) or ``max_crop`` (the search result, in ``max_crop``).
        Timed rows hold ``provider, config, n_token, n_atom, n_msa, n_templ, ms``
        (median per step), ``step_ms, first_step_ms, peak_gib`` (absolute
        ``max_memory_allocated`` during the step: weights, batch, activations,
        gradients), ``start_gib, launches, recycles, loss`` (OF3's loss breakdown)
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
                fields = _measure(
                    harness, n_token, n_msa, n_templ, warmup, repeats, count
                )
                decided = too_big if fields["oom"] or "error" in fields else fits
                decided[provider].append(n_token)
                who = identities[provider]
                emit(_row(who, "step", n_token, n_msa, n_templ, metadata, **fields))
                _log_row(rows[-1])
    for provider in providers if max_crop else ():
        search = functools.partial(
            _run_max_crop,
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
            spec = _ProbeSpec(
                config,
                provider,
                str(device),
                num_recycles,
                n_msa,
                n_templ,
                logging.getLogger().getEffectiveLevel(),
            )
            search(
                measure=functools.partial(_probe_in_fresh_process, spec),
                process="fresh",
            )
            continue
        with harness_for(provider) as harness:
            search(
                measure=functools.partial(
                    _probe_step, harness, n_msa=n_msa, n_templ=n_templ
                ),
                process="same",
            )
    return rows


@dataclass(frozen=True)
class _ProbeSpec:
    """What a max-crop probe in a fresh process builds (:func:`_fresh_probe`)."""

    config: str
    provider: str
    device: str
    num_recycles: int | None
    n_msa: int
    n_templ: int
    log_level: int


def _probe_step(
    harness: TrainingStepHarness, n_token: int, n_msa: int, n_templ: int
) -> tuple[dict, dict]:
    """One max-crop probe: one step (no warm-up) at ``n_token`` tokens;
    the harness's identity and the row fields (:func:`_measure`)."""
    fields = _measure(harness, n_token, n_msa, n_templ, 0, 1, count_launches=False)
    return harness.identity(), fields


def _fresh_probe(spec: _ProbeSpec, n_token: int) -> tuple[dict, dict]:
    """In a spawned process: build the provider's harness and run
    :func:`_probe_step`."""
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    harness = TrainingStepHarness(
        spec.config, spec.provider, spec.device, num_recycles=spec.num_recycles
    )
    try:
        return _probe_step(harness, n_token, spec.n_msa, spec.n_templ)
    finally:
        harness.close()


class ProbeProcessDied(RuntimeError):
    """A max-crop probe's process ended without a result (killed by a signal, e.g.
    by the host's out-of-memory killer when pinned host memory runs out)."""


def _probe_in_fresh_process(
    spec: _ProbeSpec, n_token: int, target: Callable = _fresh_probe
) -> tuple[dict, dict]:
    """``target(spec, n_token)`` (:func:`_fresh_probe`) in a new Python process
    (``spawn``: its own CUDA context and caching allocator, as a training run at one
    crop size has), waited for.

    Raises:
        ProbeProcessDied: the process died without a result; a CUDA out-of-memory
            error is a result.
    """
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(target, spec, n_token).result()
        except concurrent.futures.BrokenExecutor as error:
            raise ProbeProcessDied(
                f"the {spec.provider} probe at {n_token} tokens died in its process "
                "without a result (killed, e.g. by the host's out-of-memory killer)"
            ) from error


def _unnamed(provider: str) -> dict[str, Any]:
    """A row identity for a provider whose model never reported one (its only probe
    died before it could)."""
    return {"provider": provider, "config": None, "no_samples": None,
            "precision": None, "params_m": None}


def _run_max_crop(
    provider: str,
    measure: Callable[[int], tuple[Mapping[str, Any], dict]],
    known: Mapping[str, Any] | None,
    process: str,
    n_msa: int,
    n_templ: int,
    ladder: Sequence[int],
    start: int | None,
    fits: Collection[int],
    too_big: Collection[int],
    metadata: dict,
    emit: Callable[[dict], None],
) -> None:
    """Search ``provider``'s largest crop (:func:`_search_max_crop`), one
    ``max_crop_probe`` row per probe and a ``max_crop`` summary row.

    ``measure(n_token)`` runs one probe step: (identity, row fields). ``known``:
    the identity from the timed sizes, which name the summary row when no probe ran
    (only the timed sizes can decide the whole ladder). ``process``: ``same`` or
    ``fresh``, written into each row as ``probe_process``. A probe whose process
    died (:class:`ProbeProcessDied`) does not fit: its row has ``oom`` false and the
    death as ``error``."""
    seen: list[Mapping[str, Any]] = []

    def probe(n_token: int) -> bool:
        logger.info(
            "%s: max-crop probe at %d tokens (%s process)", provider, n_token, process
        )
        try:
            who, fields = measure(n_token)
            seen.append(who)
        except ProbeProcessDied as died:
            who = seen[-1] if seen else known or _unnamed(provider)
            fields = {"oom": False, "error": str(died)}
        fields["probe_process"] = process
        emit(_row(who, "max_crop_probe", n_token, n_msa, n_templ, metadata, **fields))
        _log_row(fields | {"provider": provider, "n_token": n_token})
        return not fields["oom"] and "error" not in fields

    if start is None:
        above = [size for size in sorted(ladder) if not fits or size > max(fits)]
        start = above[0] if above else max(ladder)
    largest, searched = _search_max_crop(probe, ladder, start, fits, too_big)
    decided = {size: True for size in fits} | {size: False for size in too_big}
    decided |= searched
    summary = {
        "max_crop": largest,
        "decided": {str(size): ok for size, ok in sorted(decided.items())},
        "ladder": list(ladder),
        "probe_process": process,
    }
    who = seen[-1] if seen else known
    emit(_row(who, "max_crop", largest, n_msa, n_templ, metadata, **summary))
    logger.info("%s: largest trainable crop %s", provider, largest)


def _log_row(row: Mapping[str, Any]) -> None:
    if row.get("oom") or row.get("error"):
        what = row.get("error") or "out of memory"
        logger.info("%s @ %d tokens: %s", row["provider"], row["n_token"], what)
        return
    logger.info(
        "%s @ %d tokens: %.1f ms/step, peak %s GiB, %s launches, loss %.4f",
        row["provider"],
        row["n_token"],
        row["ms"],
        f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "n/a",
        row.get("launches"),
        row["loss"]["loss"],
    )


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A compact text table of step rows (timed rows, probes, max-crop results)."""
    lines = [
        f"{'provider':<16} {'mode':<15} {'tokens':>6} {'s/step':>8} "
        f"{'peak GiB':>8} {'launches':>9} {'loss':>9} {'grad norm':>10}"
    ]
    for row in rows:
        if row.get("mode") == "max_crop":
            lines.append(
                f"{row['provider']:<16} {'max_crop':<15} {str(row['max_crop']):>6}"
            )
            continue
        ms = row.get("ms")
        peak = row.get("peak_gib")
        loss = (row.get("loss") or {}).get("loss")
        grad = row.get("grad_norm")
        if row.get("oom"):
            seconds = "OOM"
        elif ms is None:
            seconds = "error"  # a rival provider's failure: the row's "error"
        else:
            seconds = f"{ms / 1e3:.2f}"
        lines.append(
            f"{row['provider']:<16} {row['mode']:<15} {row['n_token']:>6} "
            f"{seconds:>8} "
            f"{'' if peak is None else f'{peak:.1f}':>8} "
            f"{'' if row.get('launches') is None else row['launches']:>9} "
            f"{'' if loss is None else f'{loss:.4f}':>9} "
            f"{'' if grad is None else f'{grad:.4g}':>10}"
        )
    return "\n".join(lines)


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
    "stock-cueq-tf32, stock-deepspeed, kit, an extension name, or "
    "kit-without-<extension> (the kit less one extension). Default: every "
    "provider available here except the stock-cueq and stock-deepspeed ones.",
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
@click.option("--warmup", type=int, default=1, show_default=True)
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
