"""The ``sequence_parallel`` extension under DeepSpeed, through OF3's Lightning module.

What a run with ``pl_trainer_args.deepspeed_config_path`` builds: OF3's
``OpenFold3AllAtom`` Lightning module in a ``pl.Trainer`` with Lightning's
``DeepSpeedStrategy``, made as OF3's runner makes it (``OF3DeepSpeedPrecision``,
``zero_force_ds_cpu_optimizer: false``), with the Trainer arguments OF3 passes once
per-sample clipping is off (``gradient_clip_val = clip_val``, ``"norm"``; DeepSpeed
clips) and the ZeRO settings of OF3's repository config (stage 2, ``overlap_comm``,
``contiguous_gradients``; also stage 1). ``settings.sequence_parallel_size: 2``, fp32,
gloo, 2 processes (one SP group) or 4 (2 data-parallel replicas x SP 2, each replica
its own batch). One training step (``max_steps=1``) of the tiny model of
``test_sequence_parallel_model.py`` (same weights, batches and seeding) runs through
OF3's ``training_step``, DeepSpeed's backward, ZeRO's reduction, clipping and
optimizer step.

Checked against that module's one-process stock reference, run once per replica:

- the gradient DeepSpeed applies, read with ``deepspeed.utils.safe_get_full_grad``
  before the optimizer step (reduced over the world, assembled from the ZeRO
  partitions), equals the mean of the replicas' one-process gradients (1e-5
  relative, as there), on every rank;
- DeepSpeed clips at ``clip_val`` (set below the gradient norm, so it clips), and
  the global norm ZeRO computes over its partitions equals the reference
  gradient's norm;
- after the step the parameters are the same on every rank and equal to OF3's
  optimizer (Adam with OF3's hyper-parameters; ``base_lr`` raised from 0 so the
  first step moves the weights) stepped in one process on DeepSpeed's gradient
  clipped at ``clip_val``.

Lightning's strategy runs on CPU through the kit's own shim
(:mod:`of3_megafold.parallel.cpu_deepspeed`, as ``of3-megafold train`` uses it):
no CUDA-only check, ``cpu:<rank>`` devices, and DeepSpeed's inference-only
shared-memory all-reduce left unbuilt.
"""

import os

import pytest
import torch

from tests.parallel import test_sequence_parallel_model as sp_model
from tests.parallel.launch import run_on_ranks

deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (pip install deepspeed)"
)

pytestmark = pytest.mark.usefixtures("one_thread")

SP_SIZE, NO_SAMPLES = 2, 4  # split diffusion: two samples per rank
# OF3's schedule starts at base_lr = 0 (warm-up): raise it so the step moves weights.
# clip_val below the tiny model's gradient norm (about 2), so DeepSpeed clips.
SETTINGS = {
    "lr_scheduler": {"base_lr": 1e-3},
    "gradient_clipping": {"clip_val": 0.5},
}
# Parameters after the step against OF3's Adam stepped in one process on
# DeepSpeed's own (checked) gradient: 2 ulps of the weight (fp32 rounding in a
# different order; LayerNorm weights near 1 moved by 1e-3 differ by one ulp) plus
# 1e-5 of the step's largest move (lr). Against the one-process gradient instead,
# Adam's first step (lr * g / (|g| + eps) per entry) would turn the rounding of
# near-zero gradient entries into ~1e-2 of the step.
PARAM_RTOL = 2 * torch.finfo(torch.float32).eps
PARAM_TOL = 1e-5


def ds_config(stage: int) -> dict:
    """The ZeRO part of OF3's repository config (``deepspeed_configs/
    ds_stage2_default_fp32.json``: fp16, amp and bf16 off) at ``stage``."""
    zero = {"stage": stage}
    if stage == 2:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    return {"zero_optimization": zero}


def _cpu_deepspeed_strategy(ds_config: dict, world_size: int):
    """Lightning's DeepSpeedStrategy as OF3 builds it, runnable on CPU."""
    from openfold3.core.utils.precision_utils import OF3DeepSpeedPrecision

    from of3_megafold.parallel.cpu_deepspeed import CPUDeepSpeedStrategy

    strategy = CPUDeepSpeedStrategy(
        config=ds_config,
        parallel_devices=[torch.device("cpu", r) for r in range(world_size)],
        precision_plugin=OF3DeepSpeedPrecision(precision="32-true"),
    )
    strategy.config["zero_force_ds_cpu_optimizer"] = False  # as OF3's runner
    return strategy


def _rank_body(rank, world_size, out_dir, stage):
    import pytorch_lightning as pl
    from openfold3.projects.of3_all_atom.runner import OpenFold3AllAtom
    from torch.utils.data import DataLoader, DistributedSampler

    from of3_megafold.bench import step
    from of3_megafold.parallel.cpu_deepspeed import skip_cpu_inference_all_reduce

    # torch.distributed is up (gloo); Lightning reads the ranks from here and does
    # not launch processes itself.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0"
    )
    skip_cpu_inference_all_reduce()

    model, _ = sp_model.build(SP_SIZE, True, NO_SAMPLES, SETTINGS)
    module = OpenFold3AllAtom(model.config)
    module.model.load_state_dict(model.state_dict())
    module.model.synced_generator = step.FixedRecycles(sp_model.RECYCLES)
    dp_rank = rank // SP_SIZE
    batch = sp_model.training_batch(sp_model.BATCH_SEED + dp_rank)
    batch["pdb_id"], batch["preferred_chain_or_interface"] = ["test"], ["A"]

    class OneBatch(pl.LightningDataModule):
        next_dataset_indices = None  # read by OF3's epoch-start logging

        def train_dataloader(self):
            data = [batch]
            return DataLoader(
                data,
                batch_size=1,  # Lightning sets DeepSpeed's micro-batch size from it
                collate_fn=lambda samples: samples[0],
                # OF3 logs its sampler's epoch.
                sampler=DistributedSampler(data, num_replicas=1, rank=0),
            )

    grads = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # Each rank's own generators right before the step, as in the
            # one-process reference (Lightning and DeepSpeed draw before it).
            sp_model.seed_own_streams(rank)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for name, param in pl_module.model.named_parameters():
                grad = deepspeed.utils.safe_get_full_grad(param)
                grads[name] = None if grad is None else grad.detach().clone()

    clip_val = model.config.settings.gradient_clipping.clip_val
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=_cpu_deepspeed_strategy(ds_config(stage), world_size),
        max_steps=1,
        gradient_clip_val=clip_val,
        gradient_clip_algorithm="norm",
        callbacks=[Probe()],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with step.watch_alignment() as watch:
        trainer.fit(module, datamodule=OneBatch())
    assert not watch.losses_off
    assert isinstance(trainer.model, deepspeed.DeepSpeedEngine)
    assert trainer.model.zero_optimization_stage() == stage
    params = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    torch.save(
        {
            "grads": grads,
            "params": params,
            "clip": trainer.model.gradient_clipping(),
            # The norm ZeRO computed over its partitions (before clipping).
            "norm": float(trainer.model.get_global_grad_norm()),
        },
        out_dir / f"rank{rank}.pt",
    )


def reference_gradient(world_size: int) -> tuple[dict, torch.nn.Module]:
    """The mean one-process gradient over the DP replicas (``reference_step``'s
    entries), and a reference model holding the initial weights."""
    replicas = [
        sp_model.reference_step(
            SP_SIZE,
            True,
            NO_SAMPLES,
            first_rank=dp * SP_SIZE,
            batch_seed=sp_model.BATCH_SEED + dp,
            settings=SETTINGS,
        )
        for dp in range(world_size // SP_SIZE)
    ]
    ref = replicas[0]
    ref["grad"] = torch.stack([r["grad"] for r in replicas]).mean(0)
    return ref, ref.pop("model")


def of3_optimizer_step(model: torch.nn.Module, grads: dict) -> dict:
    """OF3's optimizer (``configure_optimizers``: Adam; first-step learning rate
    ``base_lr``) stepped once on ``grads`` clipped at ``clip_val``, in one process;
    the parameters after it, by name."""
    settings = model.config.settings
    for name, param in model.named_parameters():
        param.grad = grads[name].view_as(param).clone()
    torch.nn.utils.clip_grad_norm_(
        model.parameters(), settings.gradient_clipping.clip_val
    )
    torch.optim.Adam(
        model.parameters(),
        lr=settings.lr_scheduler.base_lr,
        betas=(settings.optimizer.beta1, settings.optimizer.beta2),
        eps=settings.optimizer.eps,
    ).step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("world_size", "stage"),
    [(2, 2), (2, 1), (4, 2)],
    ids=["sp2-zero2", "sp2-zero1", "dp2xsp2-zero2"],
)
def test_deepspeed_step_matches_one_process(tmp_path, world_size, stage):
    run_on_ranks(_rank_body, world_size, tmp_path, tmp_path, stage)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    ref, model = reference_gradient(world_size)
    names = ref["names"]
    assert (ref["grad"] != 0).float().mean() > 0.9, "most gradients are zero"
    clip_val = model.config.settings.gradient_clipping.clip_val

    for r, got in enumerate(ranks):
        assert got["clip"] == clip_val, f"rank {r}: DeepSpeed's clipping value"
        assert set(got["grads"]) == set(names), f"rank {r}: parameters"
        missing = [n for n, g in got["grads"].items() if g is None]
        assert not missing, f"rank {r}: no gradient for {missing[:3]}"
        flat = torch.cat([got["grads"][n].flatten() for n in names])
        sp_model.assert_grads(flat, ref, f"rank {r}: DeepSpeed's gradient")
        norm = ref["grad"].double().norm().item()
        assert abs(got["norm"] - norm) <= 1e-5 * norm, f"rank {r}: gradient norm"
        assert norm > clip_val, "the step is not clipped"

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = of3_optimizer_step(model, ranks[0]["grads"])
    moved = max((after[n] - before[n]).abs().max() for n in names)
    assert moved > 0, "the step did not move the weights"
    for r, got in enumerate(ranks):
        for name in names:
            assert torch.equal(got["params"][name], ranks[0]["params"][name]), (
                f"rank {r}: {name} differs from rank 0 after the step"
            )
            torch.testing.assert_close(
                got["params"][name],
                after[name],
                rtol=PARAM_RTOL,
                atol=PARAM_TOL * moved.item(),
                msg=lambda m, r=r, name=name: f"rank {r}: {name} after the step: {m}",
            )
