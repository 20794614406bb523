"""tools/op_census.py: ops counted by phase and module on a toy model."""

import torch
from torch.utils.checkpoint import checkpoint

from tools.op_census import count_ops, module_label


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            x = self.blocks[0](x) + x  # a recycle without autograd
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        return self.head(torch.relu(x)).sum()


def test_module_label_folds_indices_and_cuts():
    assert module_label("trunk.blocks.11.attn.linear_q", 3) == "trunk.blocks.attn"
    assert module_label("", 3) == "(top)"


def test_ops_are_counted_by_phase_and_module():
    torch.manual_seed(0)
    model = Toy()
    names = {m: n for n, m in model.named_modules()}
    x = torch.randn(3, 4)

    def step():
        loss = model(x)
        loss.backward()
        loss.item()  # a host synchronisation

    census = count_ops(step, names)
    ops = census.ops
    assert ops[("nograd", "blocks")] >= 1  # the recycle's Linear
    assert ops[("forward", "blocks")] >= 1  # the checkpointed block's first run
    assert ops[("recompute", "blocks")] >= 1  # ... and its run in the backward
    assert ops[("forward", "head")] >= 1
    assert ops[("backward", "head")] >= 1  # the head's gradients, under the head
    assert ops[("backward", "blocks")] >= 1
    assert sum(census.by_phase().values()) == sum(ops.values())
    assert sum(census.syncs.values()) == 1
    # the same step without autograd has no backward and no recompute
    with torch.no_grad():
        quiet = count_ops(lambda: model.head(x), names)
    assert quiet.by_phase()["backward"] == quiet.by_phase()["recompute"] == 0
    assert quiet.ops[("nograd", "head")] >= 1
