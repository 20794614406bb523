"""One OF3 model and loss per provider, ready to time training steps; the random
training batch they step on.

A step is what OF3's Lightning module runs per batch (forward, loss with its
breakdown, backward), under bf16 autocast on CUDA and fp32 on CPU. Every step
reseeds the generators and OF3's ``model.synced_generator``, so providers compare
on the same weights, batch and recycle count.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from of3_megafold.bench.common import GIB, count_kernel_launches, free_device_memory
from of3_megafold.bench.step.providers import provider_model_config

T = TypeVar("T")

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

SEED = 0


class LossesDisabledError(RuntimeError):
    """The step ran but trained nothing: OF3 switched its losses off."""


def seed_everything(seed: int) -> None:
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

    seed_everything(seed)
    batch = random_of3_features(
        batch_size=1, n_token=n_token, n_msa=n_msa, n_templ=n_templ
    )
    for key in GROUND_TRUTH_TOKEN_KEYS:
        batch["ground_truth"][key] = batch[key].clone()
    return tensor_tree_map(lambda t: t.to(device), batch)


class FixedRecycles:
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
def watch_alignment() -> Iterator[_AlignmentWatch]:
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


def random_model(config, seed: int):
    """OF3's ``OpenFold3(config)`` on the CPU, its weights drawn with ``seed`` (the
    same weights for every provider's config)."""
    from openfold3.projects.of3_all_atom.model import OpenFold3

    seed_everything(seed)
    with _torch_truncated_normal_init():
        return OpenFold3(config)


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

        self.device = torch.device(device)
        self.config_name = config
        self.provider = provider
        self.seed = seed
        self.num_recycles = num_recycles
        self.config = provider_model_config(provider, device, config, update)
        self.amp_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.model = random_model(self.config, seed)
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
        """The fields that name this harness in a row (:func:`step_row`)."""
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
        seed_everything(self.seed)
        self.model.synced_generator = (
            FixedRecycles(self.num_recycles)
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
        with watch_alignment() as watch:
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

    def measured(self, batch: dict, measure: Callable[[Callable[[], Any]], T]) -> T:
        """``measure(run)``, where ``run()`` is one training step's forward, loss and
        backward on ``batch``, prepared as :meth:`step` prepares it (seed, recycle
        draw, no gradients left)."""
        self._prepare()
        return measure(lambda: self._forward_backward(batch))

    def count_launches(self, batch: dict) -> dict[str, float] | None:
        """Kernels, host launch calls and GPU busy time of one training step
        (:func:`~of3_megafold.bench.common.count_kernel_launches`; ``None`` off
        CUDA)."""
        return self.measured(batch, count_kernel_launches)

    def close(self) -> None:
        """Drop the model so the next provider starts from an empty device."""
        del self.model, self.loss_fn
        free_device_memory()
