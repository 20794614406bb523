"""The sharded PairFormer block against OF3's own block with the same weights.

On P gloo processes (N not divisible by P, so the padding path runs; token and
pair masks with zeros), fp32:

- eval mode: outputs, input gradients and world-averaged parameter gradients
  equal OF3's single-process ``PairFormerBlock``;
- train mode with dropout, rank-specific default generators: outputs and gradients
  equal the same sharded code on one process seeded as rank 0 (so every rank took
  rank 0's generator, drew its masks and sliced them right), and differ from eval
  mode (the dropout ran).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from of3_megafold.parallel.pairformer import sharded_pairformer_forward
from tests.parallel.launch import run_on_ranks

# Gradients are sums of per-rank partials (reduce-scatter, all-reduce), added in a
# different order than one process adds them: a looser fp32 tolerance.
OUT_TOL, GRAD_TOL = 1e-5, 5e-5
N_TOKENS = 7
BATCH = 2
C_S, C_Z = 8, 8


# OF3's pairformer block arguments at small sizes (the stack tests use them too).
SMALL_PAIRFORMER = dict(
    c_s=C_S,
    c_z=C_Z,
    c_hidden_pair_bias=4,
    no_heads_pair_bias=2,
    c_hidden_mul=6,
    c_hidden_pair_att=4,
    no_heads_pair=2,
    transition_type="swiglu",
    transition_n=2,
    fuse_projection_weights=False,
    inf=1e9,
)


def randomize(module, seed: int):
    """Every weight drawn from ``seed`` (OF3 zero-initialises some); returns it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def make_block(seed: int, pair_dropout: float = 0.0):
    from openfold3.core.model.latent.pairformer import PairFormerBlock

    block = PairFormerBlock(**SMALL_PAIRFORMER, pair_dropout=pair_dropout)
    return randomize(block, seed)


def make_inputs(seed: int, n: int = N_TOKENS):
    """``s, z, single_mask, pair_mask`` (masks: token mask outer product, and a few
    pair entries off); the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(BATCH, n, C_S, generator=gen)
    z = torch.randn(BATCH, n, n, C_Z, generator=gen)
    token_mask = (torch.rand(BATCH, n, generator=gen) > 0.25).float()
    token_mask[:, 0] = 1.0
    pair_mask = token_mask[:, :, None] * token_mask[:, None, :]
    pair_mask = pair_mask * (torch.rand(BATCH, n, n, generator=gen) > 0.1).float()
    grads = (
        torch.randn(BATCH, n, C_S, generator=gen),
        torch.randn(z.shape, generator=gen),
    )
    return (s, z, token_mask, pair_mask), grads


def run(forward, modules, inputs, grads):
    """Forward + backward of ``sum(s_out * g_s) + sum(z_out * g_z)``; returns the
    outputs, the input gradients and the parameter gradients."""
    s, z, single_mask, pair_mask = inputs
    s = s.clone().requires_grad_()
    z = z.clone().requires_grad_()
    for module in modules:
        module.zero_grad()
    s_out, z_out = forward(s, z, single_mask, pair_mask)
    ((s_out * grads[0]).sum() + (z_out * grads[1]).sum()).backward()
    params = [p.grad for m in modules for p in m.parameters()]
    return [s_out.detach(), z_out.detach()], [s.grad, z.grad], params


def world_average(tensors):
    out = []
    for t in tensors:
        t = t.clone()
        dist.all_reduce(t)
        out.append(t / dist.get_world_size())
    return out


def assert_close(actual, expected, tol, what):
    """Max error relative to the tensor's max, with a floor of 1e-2: the true
    gradient of APB's ``layer_norm_z.bias`` is zero (it only shifts every logit of a
    query by the same amount), so its computed value is rounding noise."""
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-2)
        assert err <= tol, f"{what}[{i}]: relative error {err:.2e} > {tol:.0e}"


def stock_forward(blocks):
    def forward(s, z, single_mask, pair_mask):
        for block in blocks:
            s, z = block(s, z, single_mask=single_mask, pair_mask=pair_mask)
        return s, z

    return forward


def sharded_forward(blocks, group):
    def forward(s, z, single_mask, pair_mask):
        return sharded_pairformer_forward(blocks, s, z, single_mask, pair_mask, group)

    return forward


def _block_body(rank, world_size, seed):
    group = dist.new_group(list(range(world_size)))
    inputs, grads = make_inputs(seed)

    # Eval mode: the sharded block is OF3's block.
    stock = make_block(seed).eval()
    sharded = copy.deepcopy(stock)
    out_ref, in_ref, par_ref = run(stock_forward([stock]), [stock], inputs, grads)
    out, in_grads, par = run(
        sharded_forward([sharded], group), [sharded], inputs, grads
    )
    assert_close(out, out_ref, OUT_TOL, "outputs")
    assert_close(in_grads, in_ref, GRAD_TOL, "input gradients")
    assert_close(world_average(par), par_ref, GRAD_TOL, "parameter gradients")

    # Train mode, dropout on, two blocks, each rank's default generator in its own
    # state: the group takes rank 0's generator, so the masks are those one
    # process draws from rank 0's state.
    blocks = [make_block(seed + i, pair_dropout=0.25).train() for i in range(2)]
    single = copy.deepcopy(blocks)
    torch.manual_seed(seed + rank)
    out, in_grads, par = run(sharded_forward(blocks, group), blocks, inputs, grads)
    torch.manual_seed(seed)
    out_ref, in_ref, par_ref = run(sharded_forward(single, None), single, inputs, grads)
    assert_close(out, out_ref, OUT_TOL, "train outputs")
    assert_close(in_grads, in_ref, GRAD_TOL, "train input gradients")
    assert_close(world_average(par), par_ref, GRAD_TOL, "train parameter gradients")
    with torch.no_grad():
        out_eval = sharded_forward([b.eval() for b in blocks], group)(*inputs)
    assert (out_eval[1] - out[1]).abs().max() > 1e-2, "dropout had no effect"


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_block_matches_of3(tmp_path, world_size):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_block_body, world_size, tmp_path, seed)


def test_triangle_attention_takes_the_starting_node_module():
    from openfold3.core.model.layers.triangular_attention import (
        TriangleAttentionEndingNode,
    )

    from of3_megafold.parallel.pairformer import sharded_triangle_attention
    from of3_megafold.parallel.shards import TokenShards

    module = TriangleAttentionEndingNode(c_in=C_Z, c_hidden=4, no_heads=2)
    x = torch.randn(1, 5, 5, C_Z)
    with pytest.raises(ValueError, match="starting-node"):
        sharded_triangle_attention(
            module,
            x,
            torch.ones(1, 5, 5),
            TokenShards.for_tokens(5, None),
            transpose_bias=False,
            chunk_size=None,
        )
