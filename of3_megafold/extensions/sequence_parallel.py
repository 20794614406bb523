"""EvoSP-3D: OF3's pairformer with the pair representation sharded over an SP group.

Keys (default = stock):

- ``model_update.custom.settings.sequence_parallel_size`` (int, default 1): ranks
  per sequence-parallel group. The world (nodes x devices) must be a multiple of it;
  the ``world / size`` groups are the data-parallel replicas.
- ``model_update.custom.settings.sequence_parallel_split_diffusion`` (bool, default
  true): each rank of a group runs ``no_samples / size`` of the training diffusion
  samples instead of all of them.

With a size above 1, in **training mode** only (validation and inference keep OF3's
replicated path, one sample per rank):

- every ``PairFormerStack`` (trunk and confidence head) runs
  :func:`of3_megafold.parallel.pairformer.sharded_pairformer_forward`: ``z`` rows
  sharded inside the stack, gathered at its exit;
- each model forward runs on the group's first rank's generators (their states
  broadcast; the first rank's run on as in one process, the others get theirs back
  afterwards), so every random draw (the stacks' dropout masks, the template and
  MSA modules' dropout, the rollout) is the draw one process would make, the same
  on every rank of the group, as the sharded stack requires;
- ``_train_diffusion`` runs this rank's share of the samples with its own noise
  (``average_over_sp`` on the trunk outputs), and the logged losses are averaged
  over the group, so they equal the full-sample mean;
- the training sampler and the data workers' seeds use the data-parallel rank and
  size, so all ranks of a group load the same sample; OF3's rank-specific model
  seed (``RankSpecificSeedCallback``) uses the data-parallel rank, so a group
  draws what the same replica draws without sequence parallelism.

Per-sample gradient clipping (OF3's default) clips each sample's gradient before
the data-parallel average; a rank's gradient is only part of its sample's, so
each rank's gradient is first replaced by the SP group's mean, the sample's
gradient (:mod:`of3_megafold.parallel.clipping`), and OF3 clips that.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from of3_megafold import registry
from of3_megafold.errors import KitConfigError

NAME = "sequence_parallel"
PLAN_ATTR = "_megafold_sequence_parallel"
DP_VIEW_ATTR = "_megafold_dp_view"

SIZE_KEY = registry.ConfigKey(
    ("settings", "sequence_parallel_size"),
    1,
    "ranks per sequence-parallel group (1 = stock); the pair representation is "
    "sharded across them inside every pairformer stack in training.",
)
SPLIT_KEY = registry.ConfigKey(
    ("settings", "sequence_parallel_split_diffusion"),
    True,
    "with sequence parallelism, each rank runs no_samples / size of the training "
    "diffusion samples.",
)


@dataclass(frozen=True)
class _Plan:
    """What a model's config asks for."""

    size: int = 1
    split_diffusion: bool = True


@dataclass
class _RunState:
    """Set by a model built with SP; read by the data module and the loss."""

    configured_size: int = 1
    diffusion_split: bool = False  # this step's diffusion samples were split


_STATE = _RunState()


def _plan(module: Any) -> _Plan:
    if registry.forced_variant(NAME) is not None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        return _Plan(size=world)
    return getattr(module, PLAN_ATTR, None) or _Plan()


def _active_group(module: Any):
    """The SP group when ``module`` should run sharded now, else ``None``."""
    plan = _plan(module)
    if plan.size == 1 or not module.training:
        return None
    from of3_megafold.parallel import groups

    if groups.sp_size() != plan.size:
        groups.init_sequence_parallel(plan.size)
    return groups.sp_group()


def _patch_model_init(original):
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        plan = _Plan(SIZE_KEY.read(config), SPLIT_KEY.read(config))
        _STATE.configured_size = plan.size
        for module in self.modules():
            object.__setattr__(module, PLAN_ATTR, plan)

    return __init__


def _patch_pairformer_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        group = _active_group(self)
        if group is None:
            return original(self, *args, **kwargs)
        from openfold3.core.utils.checkpointing import checkpoint_blocks

        from of3_megafold.parallel.pairformer import sharded_pairformer_forward

        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        arguments = dict(call.arguments)
        arguments.pop("self")
        arguments.pop("inplace_safe")  # the sharded path updates out of place

        def run_blocks(block_fns, inputs):
            return checkpoint_blocks(
                block_fns,
                args=inputs,
                blocks_per_ckpt=self.blocks_per_ckpt
                if torch.is_grad_enabled()
                else None,
                use_reentrant=self.use_reentrant,
            )

        return sharded_pairformer_forward(
            self.blocks,
            arguments.pop("s"),
            arguments.pop("z"),
            arguments.pop("single_mask"),
            arguments.pop("pair_mask"),
            group,
            run_blocks=run_blocks,
            **arguments,
        )

    return forward


@contextlib.contextmanager
def _seeded_rng(seed: int, device: torch.device, python: bool):
    """Torch's CPU and ``device`` generators (and Python's ``random`` if ``python``)
    seeded with ``seed`` inside; the previous states are restored on exit."""
    devices = [device] if device.type == "cuda" else []
    python_state = random.getstate()
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        if python:
            random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)


def _patch_model_forward(original):
    def forward(self, batch):
        _STATE.diffusion_split = False
        group = _active_group(self)
        if group is None:
            return original(self, batch)
        from of3_megafold.parallel.rng import first_rank_generators

        with first_rank_generators(group, batch["token_mask"].device):
            return original(self, batch)

    return forward


def _patch_train_diffusion(original):
    def _train_diffusion(self, batch, si_input, si_trunk, zij_trunk):
        group = _active_group(self)
        if group is None or not _plan(self).split_diffusion:
            return original(self, batch, si_input, si_trunk, zij_trunk)
        from of3_megafold.parallel.comm import average_over_sp, group_rank, group_size

        si_input, si_trunk, zij_trunk = (
            average_over_sp(t, group) for t in (si_input, si_trunk, zij_trunk)
        )
        diffusion = self.shared.diffusion
        no_samples = diffusion.no_samples
        device = zij_trunk.device
        # This rank's noise: its own torch stream inside the group's shared one;
        # Python's stream (OF3's use_conditioning draw) stays the group's.
        own_seed = int(torch.randint(0, 2**62, ())) + group_rank(group)
        diffusion.no_samples = no_samples // group_size(group)
        try:
            with _seeded_rng(own_seed, device, python=False):
                output = original(self, batch, si_input, si_trunk, zij_trunk)
        finally:
            diffusion.no_samples = no_samples
        _STATE.diffusion_split = True
        return output

    return _train_diffusion


def _patch_loss(original):
    def loss(self, batch, output):
        cum_loss, losses = original(self, batch, output)
        if not _STATE.diffusion_split:
            return cum_loss, losses
        import torch.distributed as dist

        from of3_megafold.parallel.comm import group_size
        from of3_megafold.parallel.groups import sp_group

        group = sp_group()

        # Logged values: the mean over the group's diffusion shares (= the mean
        # over all samples). The gradient stays this rank's own.
        size = group_size(group)
        for name in sorted(losses):
            value = losses[name].clone()
            dist.all_reduce(value, group=group)
            losses[name] = value / size
        cum_loss = cum_loss + (losses["loss"] - cum_loss.detach())
        return cum_loss, losses

    return loss


def _patch_clip_and_accumulate(original):
    def clip_and_accumulate(self, *args, **kwargs):
        from of3_megafold.parallel.clipping import average_gradients_over_sp
        from of3_megafold.parallel.groups import sp_group

        # The sample's gradient (the group's mean) is what OF3 must clip.
        average_gradients_over_sp(self._params_to_update, sp_group())
        return original(self, *args, **kwargs)

    return clip_and_accumulate


def _patch_seed_callback_setup(original):
    def setup(self, trainer, pl_module, stage):
        size = _STATE.configured_size
        if size == 1:
            return original(self, trainer, pl_module, stage)
        # Seeded as the data-parallel rank: a group's first rank then draws what
        # the same replica draws without sequence parallelism.
        dp_view = SimpleNamespace(global_rank=trainer.global_rank // size)
        return original(self, dp_view, pl_module, stage)

    return setup


def _patch_rank_property(original: property) -> property:
    def getter(self):
        value = original.fget(self)
        return value // getattr(self, DP_VIEW_ATTR, 1)

    return property(getter, doc=original.__doc__)


def _patch_train_dataloader(original):
    def train_dataloader(self):
        size = _STATE.configured_size
        if size == 1:
            return original(self)
        from of3_megafold.parallel.groups import check_world_size

        check_world_size(size, self.world_size)
        # global_rank // size = dp rank, world_size // size = dp size, for the
        # sampler and the worker seeds of this loader only.
        object.__setattr__(self, DP_VIEW_ATTR, size)
        try:
            return original(self)
        finally:
            object.__delattr__(self, DP_VIEW_ATTR)

    return train_dataloader


def _torch_distributed() -> registry.Check:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "this torch build has no torch.distributed"
    return True, "torch.distributed available"


def _requested(config: Any) -> bool:
    return SIZE_KEY.read(config) != 1


def _validate(config: Any) -> None:
    size = SIZE_KEY.read(config)
    if size < 1:
        raise KitConfigError(f"{SIZE_KEY.yaml_path}: {size!r}; use an integer >= 1")
    if size == 1:
        return
    no_samples = config.architecture.shared.diffusion.no_samples
    if SPLIT_KEY.read(config) and no_samples % size:
        raise KitConfigError(
            f"{SPLIT_KEY.yaml_path}: {no_samples} diffusion samples do not split "
            f"evenly over {size} ranks; choose architecture.shared.diffusion."
            f"no_samples divisible by {size} or set the split to false"
        )


_MODEL = "openfold3.projects.of3_all_atom.model:OpenFold3"
_DATA_MODULE = "openfold3.core.data.framework.data_module:DataModule"

EXTENSION = registry.register(
    registry.Extension(
        name=NAME,
        summary="Pair representation sharded across a sequence-parallel group in "
        "the pairformer stacks; diffusion samples split across it",
        keys=(SIZE_KEY, SPLIT_KEY),
        requested=_requested,
        min_processes=2,
        enable_update={"settings": {"sequence_parallel_size": 2}},
        device_check=_torch_distributed,
        patches=(
            registry.Patch(f"{_MODEL}.__init__", _patch_model_init),
            registry.Patch(f"{_MODEL}.forward", _patch_model_forward),
            registry.Patch(f"{_MODEL}._train_diffusion", _patch_train_diffusion),
            registry.Patch(
                "openfold3.core.model.latent.pairformer:PairFormerStack.forward",
                _patch_pairformer_forward,
            ),
            registry.Patch(
                "openfold3.core.loss.loss_module:OpenFold3Loss.loss", _patch_loss
            ),
            registry.Patch(
                "openfold3.core.utils.grad_manager:PerSampleGradManager."
                "clip_and_accumulate",
                _patch_clip_and_accumulate,
            ),
            registry.Patch(
                "openfold3.core.utils.callbacks:RankSpecificSeedCallback.setup",
                _patch_seed_callback_setup,
            ),
            registry.Patch(f"{_DATA_MODULE}.global_rank", _patch_rank_property),
            registry.Patch(f"{_DATA_MODULE}.world_size", _patch_rank_property),
            registry.Patch(f"{_DATA_MODULE}.train_dataloader", _patch_train_dataloader),
        ),
        validate=_validate,
        docs="docs/extensions/sequence_parallel.md",
    )
)
