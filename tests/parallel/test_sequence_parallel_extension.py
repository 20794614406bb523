"""The ``sequence_parallel`` extension: OF3's PairFormerStack through the patch.

gloo, 2 and 3 ranks: the patched stack (activation checkpointing on) equals stock
OF3's stack in training mode without dropout (outputs, input gradients,
world-averaged parameter gradients); with dropout, checkpointed and
non-checkpointed runs agree (the recomputation redraws the same masks). Single
process: the stock path when the size is 1, config validation, the data module's
data-parallel view.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from of3_megafold import activate, registry
from of3_megafold.errors import KitConfigError
from of3_megafold.extensions import sequence_parallel as sp_ext
from of3_megafold.parallel import groups
from tests.parallel.launch import run_on_ranks
from tests.parallel.test_pairformer import (
    GRAD_TOL,
    OUT_TOL,
    SMALL_PAIRFORMER,
    assert_close,
    make_inputs,
    randomize,
    run,
    world_average,
)


def make_stack(seed: int, pair_dropout: float, blocks_per_ckpt: int | None):
    from openfold3.core.model.latent.pairformer import PairFormerStack

    stack = PairFormerStack(
        **SMALL_PAIRFORMER,
        no_blocks=2,
        pair_dropout=pair_dropout,
        blocks_per_ckpt=blocks_per_ckpt,
        use_reentrant=False,
    )
    return randomize(stack, seed).train()


def plan(module, size):
    for m in module.modules():
        object.__setattr__(m, sp_ext.PLAN_ATTR, sp_ext._Plan(size=size))
    return module


def stack_forward(stack):
    def forward(s, z, single_mask, pair_mask):
        return stack(s, z, single_mask=single_mask, pair_mask=pair_mask)

    return forward


def _stack_body(rank, world_size, seed):
    activate()
    inputs, grads = make_inputs(seed)

    stock = make_stack(seed, pair_dropout=0.0, blocks_per_ckpt=1)
    sharded = plan(copy.deepcopy(stock), world_size)
    out_ref, in_ref, par_ref = run(stack_forward(stock), [stock], inputs, grads)
    out, in_grads, par = run(stack_forward(sharded), [sharded], inputs, grads)
    assert groups.sp_size() == world_size
    assert_close(out, out_ref, OUT_TOL, "stack outputs")
    assert_close(in_grads, in_ref, GRAD_TOL, "stack input gradients")
    assert_close(world_average(par), par_ref, GRAD_TOL, "stack parameter gradients")

    plain = plan(make_stack(seed, pair_dropout=0.25, blocks_per_ckpt=None), world_size)
    checkpointed = plan(copy.deepcopy(plain), world_size)
    checkpointed.blocks_per_ckpt = 1
    torch.manual_seed(seed + rank)
    out_ref, in_ref, par_ref = run(stack_forward(plain), [plain], inputs, grads)
    torch.manual_seed(seed + rank)
    out, in_grads, par = run(stack_forward(checkpointed), [checkpointed], inputs, grads)
    assert_close(out, out_ref, OUT_TOL, "checkpointed dropout outputs")
    assert_close(in_grads, in_ref, GRAD_TOL, "checkpointed dropout input gradients")
    assert_close(par, par_ref, GRAD_TOL, "checkpointed dropout parameter gradients")
    groups.reset_sequence_parallel()


@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_stack_matches_stock(tmp_path, world_size):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_stack_body, world_size, tmp_path, seed)


def _offload_body(rank, world_size, seed):
    """checkpoint_offload inside the sharded stack: the shards' checkpoint inputs
    move (CPU tensors, as the extension's CPU tests move them) and the results are
    the same bits as without it."""
    from of3_megafold.extensions import checkpoint_offload
    from of3_megafold.runtime.host_offload import HostOffload

    activate()
    checkpoint_offload.OFFLOAD_DEVICES, checkpoint_offload.MIN_BYTES = ("cpu",), 0
    moved = []
    exit_ = HostOffload.__exit__

    def record(self, *exc_info):
        moved.append(self.moved_bytes)
        return exit_(self, *exc_info)

    HostOffload.__exit__ = record
    inputs, grads = make_inputs(seed)
    stack = plan(make_stack(seed, pair_dropout=0.25, blocks_per_ckpt=1), world_size)
    results = []
    for on in (False, True):
        memory = SimpleNamespace(train={checkpoint_offload.FLAG: on}, eval={})
        for m in stack.modules():
            object.__setattr__(m, registry.MEMORY_ATTR, memory)
        torch.manual_seed(seed + rank)
        results.append(run(stack_forward(stack), [stack], inputs, grads))
    assert moved and all(m > 0 for m in moved), moved
    for got, want in zip(results[1], results[0], strict=True):
        assert_close(got, want, 0.0, "offloaded sharded stack")
    groups.reset_sequence_parallel()


def test_checkpoint_offload_in_the_sharded_stack(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_offload_body, 2, tmp_path, seed)


@pytest.fixture
def kit():
    activate()
    yield
    activate()


def test_size_one_is_stock(kit):
    stack = plan(make_stack(3, pair_dropout=0.0, blocks_per_ckpt=None), 1)
    inputs, _ = make_inputs(3)
    original = stack.forward.__func__.__wrapped__
    torch.testing.assert_close(stack(*inputs), original(stack, *inputs), rtol=0, atol=0)


def _model_config(**settings):
    from openfold3.projects.of3_all_atom.config.model_config import model_config

    config = copy.deepcopy(model_config)
    for key, value in settings.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def test_config_checks(kit):
    extension = registry.get("sequence_parallel")
    extension.check_config(_model_config())
    assert not extension.requested(_model_config())
    # OF3's per-sample clipping (its default) is allowed: the sample's gradient is
    # assembled over the group first (test_sequence_parallel_clipping.py).
    ok = {"settings.sequence_parallel_size": 2}
    extension.check_config(_model_config(**ok))
    with pytest.raises(KitConfigError, match="do not split evenly over 5 ranks"):
        extension.check_config(
            _model_config(**{**ok, "settings.sequence_parallel_size": 5})
        )


def test_data_module_sees_data_parallel_rank(kit, monkeypatch):
    from openfold3.core.data.framework.data_module import DataModule

    module = DataModule.__new__(DataModule)
    module.trainer = SimpleNamespace(global_rank=3, world_size=6)
    assert (module.global_rank, module.world_size) == (3, 6)
    object.__setattr__(module, sp_ext.DP_VIEW_ATTR, 2)
    assert (module.global_rank, module.world_size) == (1, 3)
    object.__delattr__(module, sp_ext.DP_VIEW_ATTR)

    monkeypatch.setattr(sp_ext._STATE, "configured_size", 4)
    with pytest.raises(KitConfigError, match="does not divide the world size 6"):
        module.train_dataloader()
