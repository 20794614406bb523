"""The ``sequence_parallel`` extension on a whole (tiny) OF3 model and its loss.

Each gloo rank builds the same tiny OF3 (``bench.step``'s ``tiny`` config, every
weight perturbed so that almost every parameter gets a gradient, fp32, CPU, one
recycle, OF3's two coin flips at probability 0.5)
with ``sequence_parallel_size = P`` and runs one training step on the same batch
(N = 9 tokens, so the sharded stacks pad). The pytest process builds the same
weights, runs OF3's stock path (plan size 1, nothing sharded) and compares. This
covers the runtime patches the stack-level tests leave out:
``OpenFold3.__init__`` (plan from the config), ``OpenFold3.forward`` (the group on
its first rank's generators), ``OpenFold3._train_diffusion`` (samples split,
``average_over_sp``) and ``OpenFold3Loss.loss`` (breakdown averaged over the group).

Why exact agreement is possible, and how the reference is seeded:

- Before the step every rank seeds its default torch and Python generators
  differently, as separate processes would be. The patched forward runs the whole
  forward on the first rank's generator states (broadcast). The reference
  therefore seeds like rank 0 and runs OF3's stock forward: every random draw (the
  pairformer stacks' dropout masks, MSA and template dropout, all *on*, rollout
  noise, augmentation, the conditioning and confidence-embedding coins) is then
  the same draw in the reference and on every rank. ("Equal" means within 1e-5
  relative: the sharded stacks add in a different order.) The batch is built
  before the seeding (``random_training_batch`` reseeds every generator).
- Diffusion split off: every rank runs all samples with the group's noise, which is
  the reference's noise, so trunk outputs, diffusion outputs, the loss breakdown
  and the world-averaged parameter gradients equal the single process.
- Diffusion split on: rank r draws its samples from torch's generator seeded with
  ``base + r``, ``base`` being one draw from the shared stream (Python's stream, for
  the conditioning coin, stays the group's). The noise can therefore be matched
  exactly: the reference replaces ``_train_diffusion`` with OF3's stock one run P
  times, ``no_samples / P`` samples each, seeded with ``base + r``, and
  concatenates the samples. That is the strongest form of check (2): the loss over
  all samples, in one stock loss call, equals the logged (group-averaged) loss, and
  the world-averaged gradients equal the stock gradients of that loss, so the split
  (with ``average_over_sp`` on the trunk outputs) trains exactly what one process
  training on all ``no_samples`` samples would. It also checks that each rank ran
  ``no_samples / P`` samples and that ranks drew different noise. The reference
  encodes the extension's seeding scheme (``base + r``): a change to that scheme
  must change ``chunked_train_diffusion`` with it.
- The logged breakdown on every rank equals the mean of the ranks' own
  (un-averaged) breakdowns, which differ between ranks when the diffusion is split.
"""

import gc
import random
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

from of3_megafold import activate
from of3_megafold.bench import step
from of3_megafold.extensions import sequence_parallel as sp_ext
from of3_megafold.parallel import groups
from tests.parallel.launch import run_on_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

N_TOKENS, N_MSA, N_TEMPL = 9, 4, 1
RECYCLES = 1
WEIGHT_SEED, BATCH_SEED = 11, 5
# Each rank's own generators before the step (rank 0's is the group's).
OWN_SEED = 1000
OUT_TOL = 1e-5  # forward values (relative to the tensor's largest entry)
GRAD_TOL = 1e-5  # world-averaged gradients (relative, see assert_grads)


def build(size: int, split: bool, no_samples: int, settings: dict | None = None):
    """The tiny model (train mode) and loss, the same weights in every process.

    ``settings``: more ``settings`` keys of the model config update."""
    from openfold3.core.loss.loss_module import OpenFold3Loss
    from openfold3.projects.of3_all_atom.model import OpenFold3

    activate()
    update = {
        "architecture": {
            "shared": {
                "num_recycles": RECYCLES,
                # Python's stream (the group's) decides the coin flips: not
                # always heads.
                "diffusion": {"no_samples": no_samples, "use_conditioning_prob": 0.5},
                "use_confidence_emb_prob": 0.5,
            },
        },
        "settings": {
            "sequence_parallel_size": size,
            "sequence_parallel_split_diffusion": split,
            "gradient_clipping": {"per_sample_clipping": False},
        },
    }
    config = step.build_model_config(
        "tiny", step.deep_merge(update, {"settings": settings or {}})
    )
    random.seed(WEIGHT_SEED)
    np.random.seed(WEIGHT_SEED)
    torch.manual_seed(WEIGHT_SEED)
    model = OpenFold3(config)
    # OF3 zero-initialises its output layers, which leaves most parameters without
    # a gradient at initialisation: perturb every weight.
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    model.synced_generator = step.FixedRecycles(RECYCLES)
    return model, OpenFold3Loss(config=config.architecture.loss_module)


def training_batch(seed: int = BATCH_SEED):
    return step.random_training_batch(N_TOKENS, N_MSA, N_TEMPL, seed=seed)


def seed_own_streams(rank: int) -> None:
    torch.manual_seed(OWN_SEED + rank)
    random.seed(OWN_SEED + 7 + rank)


def flat_grad(model) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for p in model.parameters()
        ]
    )


def param_checksum(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum()


def detached(outputs: dict) -> dict:
    return {
        k: v.detach().clone() for k, v in outputs.items() if isinstance(v, torch.Tensor)
    }


def _rank_body(rank, world_size, out_dir, split, no_samples):
    from openfold3.core.loss.loss_module import OpenFold3Loss

    model, loss_fn = build(world_size, split, no_samples)
    assert all(
        getattr(m, sp_ext.PLAN_ATTR) == sp_ext._Plan(world_size, split)
        for m in model.modules()
    ), "OpenFold3.__init__ did not set the plan from the config"
    batch = training_batch()

    seed_own_streams(rank)
    python_before = random.getstate()
    with step.watch_alignment() as watch:  # keeps OF3's fallback traceback quiet
        batch, outputs = model(batch)
    assert not watch.losses_off
    # The forward ran on the first rank's generators; the others have theirs back.
    python_restored = random.getstate() == python_before
    after_forward = torch.rand(4)
    loss, logged = loss_fn(batch, outputs, _return_breakdown=True)
    loss.backward()
    with torch.no_grad():
        own = OpenFold3Loss.loss.__wrapped__(loss_fn, batch, outputs)[1]

    grad = flat_grad(model)
    dist.all_reduce(grad)
    result = {
        "outputs": detached(outputs),
        "logged": {k: v.clone() for k, v in logged.items()},
        "own": dict(own),
        "loss": loss.detach(),
        "world_grad": grad / world_size,
        "checksum": param_checksum(model),
        "python_restored": python_restored,
        "after_forward": after_forward,
    }
    # The kit keeps its group in one place: once that lets go and the world is
    # destroyed, nothing holds the group to the interpreter's shutdown (where a
    # gloo worker still freeing a collective's tensors aborts the process).
    group = weakref.ref(groups.sp_group())
    del batch, outputs, loss, logged  # the autograd graph's nodes hold the group
    groups.reset_sequence_parallel()
    dist.destroy_process_group()
    gc.collect()
    result["group_released"] = group() is None
    torch.save(result, out_dir / f"rank{rank}.pt")


def chunked_train_diffusion(model, size: int):
    """OF3's stock ``_train_diffusion`` run ``size`` times, ``no_samples / size``
    samples each, torch seeded with ``base + r`` as rank r of the split draws its
    noise (``base`` drawn from the shared stream, Python's stream the same for
    every chunk), samples concatenated in rank order."""
    stock = model._train_diffusion  # plan size 1: OF3's own
    diffusion = model.shared.diffusion

    def _train_diffusion(batch, si_input, si_trunk, zij_trunk):
        base = int(torch.randint(0, 2**62, ()))
        no_samples = diffusion.no_samples
        python_state = random.getstate()
        chunks = []
        diffusion.no_samples = no_samples // size
        try:
            for r in range(size):
                random.setstate(python_state)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(base + r)
                    chunks.append(stock(batch, si_input, si_trunk, zij_trunk))
        finally:
            diffusion.no_samples = no_samples
        return {k: torch.cat([c[k] for c in chunks], dim=1) for k in chunks[0]}

    return _train_diffusion


def reference_step(
    size: int,
    split: bool,
    no_samples: int,
    first_rank: int = 0,
    batch_seed: int = BATCH_SEED,
    settings: dict | None = None,
) -> dict:
    """One process, OF3's stock path, seeded as the group whose first rank is
    ``first_rank``, on the batch drawn with ``batch_seed``."""
    model, loss_fn = build(size, split, no_samples, settings)
    for m in model.modules():
        object.__setattr__(m, sp_ext.PLAN_ATTR, sp_ext._Plan())
    if split:
        model._train_diffusion = chunked_train_diffusion(model, size)
    batch = training_batch(batch_seed)  # (seeds every generator: before the below)
    seed_own_streams(first_rank)
    with step.watch_alignment() as watch:
        batch, outputs = model(batch)
    assert not watch.losses_off
    recycles = outputs["recycles"]
    loss, logged = loss_fn(batch, outputs, _return_breakdown=True)
    loss.backward()
    return {
        "model": model,
        "outputs": detached(outputs),
        "recycles": recycles,
        "logged": logged,
        "grad": flat_grad(model),
        "checksum": param_checksum(model),
        "grad_sizes": [p.numel() for p in model.parameters()],
        "names": [n for n, _ in model.named_parameters()],
    }


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    scale = max(expected.abs().max().item(), floor)
    return (actual - expected).abs().max().item() / scale


def assert_breakdown(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) == set(expected), f"{what}: {set(actual) ^ set(expected)}"
    for name in expected:
        err = rel_err(actual[name], expected[name], 1e-3)
        assert err <= OUT_TOL, f"{what}[{name}]: {actual[name]} vs {expected[name]}"


def assert_grads(actual: torch.Tensor, ref: dict, what: str) -> None:
    """Per parameter, max error relative to that parameter's largest gradient entry,
    with a floor of 1e-3 x the largest gradient entry of the model (a few
    parameters' true gradients are ~0, e.g. biases before a softmax)."""
    floor = 1e-3 * ref["grad"].abs().max().item()
    worst = (0.0, "")
    for name, a, e in zip(
        ref["names"],
        actual.split(ref["grad_sizes"]),
        ref["grad"].split(ref["grad_sizes"]),
        strict=True,
    ):
        worst = max(worst, (rel_err(a, e, floor), name))
    assert worst[0] <= GRAD_TOL, f"{what}: {worst[1]} relative error {worst[0]:.2e}"


@pytest.mark.parametrize(
    ("world_size", "split", "no_samples"),
    [(2, False, 2), (2, True, 4), (3, True, 3)],
    ids=["p2-replicated-diffusion", "p2-split-diffusion", "p3-split-diffusion"],
)
def test_model_step_matches_one_process(tmp_path, world_size, split, no_samples):
    run_on_ranks(_rank_body, world_size, tmp_path, tmp_path, split, no_samples)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    ref = reference_step(world_size, split, no_samples)
    assert ref["recycles"] == RECYCLES
    assert (ref["grad"] != 0).float().mean() > 0.9, "most gradients are zero"
    assert ref["logged"]["diffusion_loss"] > 0

    for r, got in enumerate(ranks):
        assert torch.equal(got["checksum"], ref["checksum"]), f"rank {r}: weights"
        # The first rank's generators ran on (as the reference's); the others'
        # own are back.
        assert got["python_restored"] == (r > 0), f"rank {r}: Python's generator"
        assert got["group_released"], f"rank {r}: the SP group outlives the world"
        outputs = got["outputs"]
        n_mine = no_samples // world_size if split else no_samples
        assert outputs["noise_level"].shape == (1, n_mine), f"rank {r}: samples"
        assert outputs["atom_positions_diffusion"].shape[1] == n_mine
        # Trunk, rollout and heads: replicated values, equal to one process.
        for key in sorted(set(outputs) - {"noise_level", "atom_positions_diffusion"}):
            err = rel_err(outputs[key], ref["outputs"][key], 1e-3)
            assert err <= OUT_TOL, f"rank {r}: {key} relative error {err:.2e}"
        # The logged breakdown: the one-process breakdown over all samples...
        assert_breakdown(got["logged"], ref["logged"], f"rank {r} logged")
        # ...and the loss the rank returns carries the logged value.
        assert torch.allclose(got["loss"], got["logged"]["loss"], rtol=0, atol=0)
        # ...and the mean of the ranks' own breakdowns.
        mean = {k: torch.stack([g["own"][k] for g in ranks]).mean() for k in got["own"]}
        assert_breakdown(got["logged"], mean, f"rank {r} logged vs mean")

    # Each rank's own torch stream is back after the forward (ranks differ).
    for a, b in zip(ranks, ranks[1:], strict=False):
        assert not torch.equal(a["after_forward"], b["after_forward"])

    noise = [g["outputs"]["noise_level"] for g in ranks]
    diffused = [g["outputs"]["atom_positions_diffusion"] for g in ranks]
    if split:
        # Different noise on every rank; together, the reference's samples.
        for i in range(world_size):
            for j in range(i):
                assert not torch.allclose(noise[i], noise[j]), (i, j)
        noise, diffused = [torch.cat(noise, dim=1)], [torch.cat(diffused, dim=1)]
        own = [g["own"]["diffusion_loss"] for g in ranks]
        assert max(own) - min(own) > 1e-3 * max(own), "rank losses do not differ"
    for n, x in zip(noise, diffused, strict=True):
        assert rel_err(n, ref["outputs"]["noise_level"], 1e-3) <= OUT_TOL
        err = rel_err(x, ref["outputs"]["atom_positions_diffusion"], 1e-3)
        assert err <= OUT_TOL, f"diffusion samples: relative error {err:.2e}"

    # World-averaged gradients (what DDP applies) equal the one-process step's.
    assert_grads(ranks[0]["world_grad"], ref, "world-averaged gradients")
