"""The kit's kernels inside the shards: EvoFlash triangle attention, the EvoFusion
transitions (with their 16-bit LayerNorm) and the fused triangle multiplications run
in the sharded PairFormer block.

On 2 gloo processes under bf16 autocast (how Lightning's bf16-mixed trains OF3),
with the extensions forced and the kernels interpreted on the CPU
(``TRITON_INTERPRET=1``): the kernels run on every rank, as often as in one
process, and the sharded block's outputs and gradients are as close to OF3's block
in float64 as OF3's own path in the same shards is (within 1.2x its error). N = 7
on 2 ranks, so a padding key is masked on top of a masked token's keys. The fused
triangle multiplication takes 16-bit pair activations only, so its case feeds the
block bf16 ``s`` and ``z``. Where the shards keep OF3's path (the single
attention): docs/extensions/sequence_parallel.md.
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

# Per case: the extensions forced, whether ``s`` and ``z`` enter in bf16, and the
# kit's autograd functions applied in one forward of the block, in one process
# (``LayerNormFunction``: at least).
CASES = {
    "attention_and_transitions": (
        ("evoflash_attention", "evofusion_transitions"),
        False,
        # both triangle attentions and the single attention on EvoFlash, both
        # transitions on EvoFusion
        {
            "EvoFlashAttentionFunction": 1,
            "EvoFlashProjectedAttentionFunction": 2,
            "SwiGLUTransitionFunction": 2,
            "LayerNormFunction": 2,
        },
    ),
    "triangle_multiplication": (
        ("evofusion_triangle_multiplication",),
        True,
        {"TriangleMultiplicationFunction": 2},
    ),
}
FLOOR = 1e-4


def _counting(calls: dict):
    """Count the kit's autograd functions as they are applied."""
    from of3_megafold.kernels.evoflash.function import EvoFlashAttentionFunction
    from of3_megafold.kernels.evoflash.projected import (
        EvoFlashProjectedAttentionFunction,
    )
    from of3_megafold.kernels.layer_norm.function import LayerNormFunction
    from of3_megafold.kernels.swiglu_transition import SwiGLUTransitionFunction
    from of3_megafold.kernels.triangle_multiplication.function import (
        TriangleMultiplicationFunction,
    )

    for cls in (
        EvoFlashAttentionFunction,
        EvoFlashProjectedAttentionFunction,
        LayerNormFunction,
        SwiGLUTransitionFunction,
        TriangleMultiplicationFunction,
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


def _kit_kernels_body(rank, world_size, seed, case):
    from of3_megafold import activate

    forced, bf16_inputs, expected = CASES[case]
    group = dist.new_group(list(range(world_size)))
    inputs, grads = make_inputs(seed)
    if bf16_inputs:
        inputs = (inputs[0].bfloat16(), inputs[1].bfloat16(), *inputs[2:])
    # A masked token: its pair row's triangle attention has every key masked,
    # and in the shards the padding key masked on top of that.
    token_mask, pair_mask = inputs[2], inputs[3]
    token_mask[:, 3] = 0.0
    pair_mask[:, 3, :] = pair_mask[:, :, 3] = 0.0
    block = make_block(seed).eval()

    def sharded(kit: bool):
        activate(force=forced if kit else ())
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
    activate(force=forced)
    single = copy.deepcopy(block)
    run(_bf16(stock_forward([single])), [single], inputs, grads)
    one_process = dict(calls)
    calls.clear()
    kit = sharded(kit=True)
    in_shards = dict(calls)
    of3 = sharded(kit=False)

    for name, count in expected.items():
        at_least = name == "LayerNormFunction"
        got = one_process.get(name, 0)
        assert got >= count if at_least else got == count, (name, one_process)
    # In the shards the same, except the single attention: its queries are this
    # rank's rows and its keys all tokens, a rectangle the kernel does not take.
    one_process.pop("EvoFlashAttentionFunction", None)
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
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kit_kernels_run_inside_the_shards(case, tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    run_on_ranks(_kit_kernels_body, 2, tmp_path, seed, case)
