"""The kit's kernels inside the shards: EvoFlash triangle attention and the
EvoFusion transitions (with their 16-bit LayerNorm) run in the sharded PairFormer
block.

On 2 gloo processes under bf16 autocast (how Lightning's bf16-mixed trains OF3),
with both extensions forced and the kernels interpreted on the CPU
(``TRITON_INTERPRET=1``): the kernels run on every rank, as often as in one
process, and the sharded block's outputs and gradients are as close to OF3's block
in float64 as OF3's own path in the same shards is (within 1.2x its error). N = 7
on 2 ranks, so a padding key is masked on top of a masked token's keys. Where the
shards keep OF3's path (the triangle multiplications, the single attention):
docs/extensions/sequence_parallel.md.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.parallel.launch import run_on_ranks
from tests.parallel.test_pairformer import (
    make_block,
    make_inputs,
    run,
    sharded_forward,
    stock_forward,
    world_average,
)

FORCED = ("evoflash_attention", "evofusion_transitions")
FLOOR = 1e-4


def _counting(calls: dict):
    """Count the kit's autograd functions as they are applied."""
    from of3_megafold.kernels.evoflash.function import EvoFlashAttentionFunction
    from of3_megafold.kernels.evoflash.projected import (
        EvoFlashProjectedAttentionFunction,
    )
    from of3_megafold.kernels.layer_norm.function import LayerNormFunction
    from of3_megafold.kernels.swiglu_transition import SwiGLUTransitionFunction

    for cls in (
        EvoFlashAttentionFunction,
        EvoFlashProjectedAttentionFunction,
        LayerNormFunction,
        SwiGLUTransitionFunction,
    ):
        apply = cls.apply

        def counted(*args, _apply=apply, _name=cls.__name__):
            calls[_name] = calls.get(_name, 0) + 1
            return _apply(*args)

        cls.apply = counted


def _error(actual, reference) -> float:
    """Relative L2 error of a list of tensors taken together."""
    pairs = zip(actual, reference, strict=True)
    diff = torch.cat([(a.double() - e).flatten() for a, e in pairs])
    return (diff.norm() / torch.cat([e.flatten() for e in reference]).norm()).item()


def _bf16(forward):
    def wrapped(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s, z = forward(*args)
        return s.float(), z.float()

    return wrapped


def _kit_kernels_body(rank, world_size, seed):
    from of3_megafold import activate

    group = dist.new_group(list(range(world_size)))
    inputs, grads = make_inputs(seed)
    # A masked token: its pair row's triangle attention has every key masked,
    # and in the shards the padding key masked on top of that.
    token_mask, pair_mask = inputs[2], inputs[3]
    token_mask[:, 3] = 0.0
    pair_mask[:, 3, :] = pair_mask[:, :, 3] = 0.0
    block = make_block(seed).eval()

    def sharded(kit: bool):
        activate(force=FORCED if kit else ())
        module = copy.deepcopy(block)
        out, in_grads, par = run(
            _bf16(sharded_forward([module], group)), [module], inputs, grads
        )
        activate()
        return out, in_grads, world_average(par)

    # OF3's block in float64, one process: the reference.
    exact = copy.deepcopy(block).double()
    reference = run(
        stock_forward([exact]),
        [exact],
        [t.double() for t in inputs],
        [g.double() for g in grads],
    )
    calls: dict = {}
    _counting(calls)
    activate(force=FORCED)
    single = copy.deepcopy(block)
    run(_bf16(stock_forward([single])), [single], inputs, grads)
    one_process = dict(calls)
    calls.clear()
    kit = sharded(kit=True)
    in_shards = dict(calls)
    of3 = sharded(kit=False)

    # In one process: both triangle attentions and the single attention on
    # EvoFlash, both transitions and the 16-bit LayerNorms on EvoFusion. In the
    # shards the same, except the single attention: its queries are this rank's
    # rows and its keys all tokens, a rectangle the kernel does not take.
    assert one_process.pop("EvoFlashAttentionFunction", 0) == 1, one_process
    assert one_process.get("EvoFlashProjectedAttentionFunction") == 2, one_process
    assert one_process.get("SwiGLUTransitionFunction") == 2, one_process
    assert one_process.get("LayerNormFunction", 0) >= 2, one_process
    assert in_shards == one_process, (in_shards, one_process)
    # Against float64, the kit's kernels in the shards are as accurate as OF3's
    # path in the same shards (bf16 partial gradients summed across ranks included).
    for what, kit_part, of3_part, ref in zip(
        ("outputs", "input gradients", "parameter gradients"),
        kit,
        of3,
        reference,
        strict=True,
    ):
        error, of3_error = _error(kit_part, ref), _error(of3_part, ref)
        assert error <= 1.2 * of3_error + FLOOR, f"{what}: {error:.2e}, {of3_error:.2e}"


@pytest.mark.usefixtures("interpreted_kernels")
def test_the_kit_kernels_run_inside_the_shards(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_kit_kernels_body, 2, tmp_path, seed)
