"""Checkpoint offload: OF3's checkpoint inputs kept on the host until backward.

On the CPU the extension is made available and CPU tensors are offloaded (every
copy a clone, every tensor moved whatever its size), inside a real OF3 training step
of the tiny model: the stacks whose inputs move, and the step's losses and gradients
against the key off. The GPU tests run the same step on CUDA, where the kit's own
rule (CUDA tensors of at least 1 MiB) applies.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from of3_megafold import registry
from of3_megafold.extensions import checkpoint_offload

NAME = "checkpoint_offload"
FLAG = "use_checkpoint_offload"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(device: str, on: bool, n_token: int = 24):
    from of3_megafold.bench.step import TrainingStepHarness, random_training_batch

    update = {"settings": {"memory": {"train": {FLAG: on}}}}
    harness = TrainingStepHarness("tiny", "stock", device, num_recycles=1,
                                  update=update)
    return harness.step(random_training_batch(n_token, 8, 2, harness.device))


def _moved_stacks(caplog):
    """The stacks (block module classes) whose checkpoint inputs moved so far, call
    by call, from the extension's debug log."""
    caplog.set_level(logging.DEBUG, logger=checkpoint_offload.__name__)
    return lambda: [r.args[1] for r in caplog.records
                    if r.name == checkpoint_offload.__name__ and r.args[2] > 0]


@pytest.fixture
def offload_on_cpu(monkeypatch, caplog):
    """The extension available here, CPU tensors of any size moved; the value is
    :func:`_moved_stacks`."""
    monkeypatch.setattr(registry.get(NAME), "device_check", lambda: (True, "test"))
    monkeypatch.setattr(checkpoint_offload, "OFFLOAD_DEVICES", ("cpu",))
    monkeypatch.setattr(checkpoint_offload, "MIN_BYTES", 0)
    return _moved_stacks(caplog)


def test_training_step_moves_every_stack_and_computes_the_same(kit, offload_on_cpu):
    stock = _step("cpu", on=False)
    assert offload_on_cpu() == []
    kit_ = _step("cpu", on=True)
    moved = offload_on_cpu()
    # the trunk's pairformer, the MSA module, the template stack, the diffusion
    # module's token transformer and the atom transformers; the confidence head's
    # pairformer is another PairFormerBlock stack
    for block in ("PairFormerBlock", "MSAModuleBlock", "TemplatePairBlock",
                  "DiffusionTransformerBlock"):
        assert block in moved, moved
    assert moved.count("PairFormerBlock") == 2
    for name, value in stock.loss.items():
        assert kit_.loss[name] == value, name
    assert kit_.grad_norm == stock.grad_norm


def test_without_checkpoints_or_grad_nothing_moves(kit, offload_on_cpu):
    from openfold3.core.model.latent import pairformer

    stack = pairformer.PairFormerStack(
        c_s=8, c_z=4, c_hidden_pair_bias=4, no_heads_pair_bias=2, c_hidden_mul=4,
        c_hidden_pair_att=4, no_heads_pair=2, no_blocks=2, transition_type="swiglu",
        transition_n=2, pair_dropout=0.25, fuse_projection_weights=False,
        blocks_per_ckpt=1, inf=1e9, use_reentrant=False,
    )
    memory = type("Memory", (), {})()
    memory.train = memory.eval = {FLAG: True}
    for module in stack.modules():
        object.__setattr__(module, registry.MEMORY_ATTR, memory)
    s, z = torch.randn(1, 5, 8), torch.randn(1, 5, 5, 4)
    masks = dict(single_mask=torch.ones(1, 5), pair_mask=torch.ones(1, 5, 5))
    with torch.no_grad():
        stack(s, z, **masks)
    stack.blocks_per_ckpt = None
    stack(s.requires_grad_(), z, **masks)
    with torch.autograd.graph.save_on_cpu():  # a hook of the user's decides
        stack.blocks_per_ckpt = 1
        stack(s, z, **masks)
    assert offload_on_cpu() == []
    stack(s, z, **masks)
    assert offload_on_cpu() == ["PairFormerBlock"]


def test_block_module_unwraps_partials():
    linear = torch.nn.Linear(2, 2)
    inner = functools.partial(linear, torch.zeros(2))
    assert checkpoint_offload.block_module(functools.partial(inner)) is linear
    assert checkpoint_offload.block_module(lambda x: x) is None
    # the sequence-parallel pairformer's form: a function taking the block first
    from of3_megafold.parallel.pairformer import sharded_pairformer_block

    sharded = functools.partial(sharded_pairformer_block, linear, chunk_size=None)
    assert checkpoint_offload.block_module(sharded) is linear
    assert checkpoint_offload.block_module(functools.partial(print, 1)) is None


@gpu
def test_gpu_training_step_computes_the_same(kit, monkeypatch, caplog):
    """Real device-host copies on side streams (every size moved): the same losses
    and gradient norm as with the key off."""
    monkeypatch.setattr(checkpoint_offload, "MIN_BYTES", 0)
    moved = _moved_stacks(caplog)
    stock = _step("cuda", on=False, n_token=96)
    kit_ = _step("cuda", on=True, n_token=96)
    assert "PairFormerBlock" in moved() and "MSAModuleBlock" in moved()
    for name, value in stock.loss.items():
        assert kit_.loss[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert kit_.grad_norm == pytest.approx(stock.grad_norm, rel=1e-6)
