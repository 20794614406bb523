"""OF3's per-sample gradient clipping under sequence parallelism.

OF3 clips each sample's gradient (``PerSampleGradManager``, manual optimisation
inside DDP's ``no_sync``) before averaging over the data-parallel ranks. Under SP a
rank holds only part of its sample's gradient; the extension replaces it by the SP
group's mean (the sample's gradient) before OF3 measures and clips it.

Three training steps of OF3's ``OpenFold3AllAtom`` Lightning module with
``DDPStrategy`` (gloo, CPU, fp32), per-sample clipping on with ``clip_val`` below
the gradient norm (so every step clips), the tiny model of
``test_sequence_parallel_model.py`` (weights perturbed so that almost every
parameter has a gradient, pairformer dropout on, diffusion samples not split), the
same batch every step:

- SP = 2 (two processes, one sample) against one process: the norm OF3 clips with
  on every rank (1e-5 relative), the clipped gradient handed to the optimizer at
  every step (1e-5 relative, per parameter, as ``assert_grads``) and the
  parameters after the three steps (1e-5 of each tensor's largest entry);
- with the group average taken out, each rank clips its own partial gradient and
  the gradients differ from one process (the check can fail).

The optimizer is plain SGD here, not OF3's Adam: Adam's first steps divide each
gradient entry by its own magnitude, which turns the fp32 rounding of entries whose
true value is about zero into moves of the order of the learning rate (about 2e-4
of some tensors' scale after three steps), so the parameters would measure
rounding, not clipping. The clipping runs before the optimizer and does not depend
on it.
"""

import os

import pytest
import torch

from tests.parallel import test_sequence_parallel_model as sp_model
from tests.parallel.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
# clip_val below the tiny model's gradient norm (about 2): every step clips.
# OF3's schedule starts at base_lr = 0: raise it so every step moves the weights.
SETTINGS = {"gradient_clipping": {"per_sample_clipping": True, "clip_val": 0.5}}
LR = 0.1  # a clipped step moves the weights by about LR * clip_val in norm
PARAM_TOL = 1e-5  # relative to each parameter tensor's largest entry


def _rank_body(rank, world_size, out_dir, average, steps):
    import pytorch_lightning as pl
    from openfold3.projects.of3_all_atom.runner import OpenFold3AllAtom
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    from of3_megafold.bench import step
    from of3_megafold.parallel import clipping

    # torch.distributed is up (gloo); Lightning reads the ranks from here.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0"
    )
    if not average:
        clipping.average_gradients_over_sp = lambda params, group: None

    model, _ = sp_model.build(world_size, False, 2, SETTINGS)
    module = OpenFold3AllAtom(model.config)
    module.model.load_state_dict(model.state_dict())
    module.model.synced_generator = step.FixedRecycles(sp_model.RECYCLES)

    def configure_optimizers():
        sgd = torch.optim.SGD(module.parameters(), lr=LR)
        # OF3's manual step calls lr_schedulers().step().
        return [sgd], [torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)]

    module.configure_optimizers = configure_optimizers
    batch = sp_model.training_batch()
    batch["pdb_id"], batch["preferred_chain_or_interface"] = ["test"], ["A"]
    norms, grads = [], []

    class SameBatch(pl.LightningDataModule):
        next_dataset_indices = None  # read by OF3's epoch-start logging

        def train_dataloader(self):
            data = [batch] * steps
            return DataLoader(
                data,
                batch_size=1,
                collate_fn=lambda samples: samples[0],
                sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False),
            )

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # Each rank's own generators, as separate processes would have them;
            # the reference is seeded as rank 0.
            sp_model.seed_own_streams(rank + 100 * batch_idx)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(sp_model.flat_grad(pl_module.model).clone())

    strategy = (
        DDPStrategy(process_group_backend="gloo", find_unused_parameters=False)
        if world_size > 1
        else "auto"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        callbacks=[Probe()],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    original_clip = module.grad_manager._clip_grads

    def clip_and_record(*args, **kwargs):
        from openfold3.core.utils.grad_manager import compute_global_norm

        params = module.grad_manager._params_to_update.values()
        norms.append(float(compute_global_norm(list(params))[0]))
        return original_clip(*args, **kwargs)

    module.grad_manager._clip_grads = clip_and_record
    with step.watch_alignment() as watch:
        trainer.fit(module, datamodule=SameBatch())
    assert not watch.losses_off
    assert trainer.global_step == steps
    params = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    torch.save(
        {"params": params, "norms": norms, "grads": grads}, out_dir / f"rank{rank}.pt"
    )


def _run(tmp_path, world_size, average=True, steps=STEPS):
    out = tmp_path / f"world{world_size}-{average}"
    out.mkdir()
    run_on_ranks(_rank_body, world_size, out, out, average, steps)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


def worst_param_error(got: dict, want: dict) -> tuple[float, str]:
    return max(
        (
            ((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
            .item(),
            n,
        )
        for n in want
    )


def step_grads(got: dict, ref: dict, names: list[str], sizes: list[int]):
    """Per step: the clipped gradients against the reference's (``assert_grads``'s
    arguments)."""
    for i, (grad, want) in enumerate(zip(got["grads"], ref["grads"], strict=False)):
        yield i, grad, {"grad": want, "names": names, "grad_sizes": sizes}


def test_per_sample_clipping_matches_one_process(tmp_path):
    (ref,) = _run(tmp_path, 1)
    assert len(ref["norms"]) == len(ref["grads"]) == STEPS
    clip_val = SETTINGS["gradient_clipping"]["clip_val"]
    assert min(ref["norms"]) > clip_val, "a step was not clipped"
    names = list(ref["params"])
    sizes = [ref["params"][n].numel() for n in names]
    assert (ref["grads"][0] != 0).float().mean() > 0.9, "most gradients are zero"

    for r, got in enumerate(_run(tmp_path, 2)):
        # The norm OF3 clips with is the sample's, on every rank of the group.
        torch.testing.assert_close(
            torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0
        )
        for i, grad, want in step_grads(got, ref, names, sizes):
            sp_model.assert_grads(grad, want, f"rank {r}, step {i}: clipped gradient")
        err, name = worst_param_error(got["params"], ref["params"])
        assert err <= PARAM_TOL, f"rank {r}: {name} relative error {err:.2e}"

    # Without the group average each rank clips its own part of the gradient
    # (the first step shows it).
    got = _run(tmp_path, 2, average=False, steps=1)[0]
    _, grad, want = next(step_grads(got, ref, names, sizes))
    with pytest.raises(AssertionError):
        sp_model.assert_grads(grad, want, "clipped per rank")
