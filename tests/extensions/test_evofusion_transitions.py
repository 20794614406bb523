"""EvoFusion inside OF3's transition modules: same weights, key on vs off.

Errors against OF3's module in float64; the kit (fp32, Triton; the interpreter on
CPU) must stay within 2x OF3's fp32 error plus a small floor, for the output and the
gradients of the input and of every parameter.
"""

import copy

import pytest
import torch
from ml_collections import ConfigDict

from of3_megafold import activate, registry


@pytest.fixture
def kit():
    activate()
    yield
    activate()


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _run(module, inputs, grad_out):
    inputs = {
        k: v.detach().clone().requires_grad_(k != "mask") for k, v in inputs.items()
    }
    module.zero_grad()
    out = module(**inputs)
    out.backward(grad_out.to(out.dtype))
    return (
        [out.detach()]
        + [v.grad for k, v in inputs.items() if k != "mask"]
        + [p.grad for p in module.parameters()]
    )


def _compare(module, inputs, switch_on):
    torch.manual_seed(1)
    reference = _run(
        copy.deepcopy(module).double(),
        {k: v.double() for k, v in inputs.items()},
        grad_out := torch.randn(module(**inputs).shape, dtype=torch.float64),
    )
    stock = _run(module, inputs, grad_out)
    switch_on()
    kit = _run(module, inputs, grad_out)
    activate()
    for i, (r, s, k) in enumerate(zip(reference, stock, kit, strict=True)):
        scale = r.abs().max().item() + 1e-12
        stock_err = (s.double() - r).abs().max().item() / scale
        kit_err = (k.double() - r).abs().max().item() / scale
        assert kit_err <= 2 * stock_err + 1e-5, (i, kit_err, stock_err)


def _force():
    activate(force=["evofusion_transitions"])


# c = 136 > 128 takes the kernels' torch fallback (as OF3's c = 384 single
# transition does): OF3's [*, 1] mask must broadcast the same way there.
@pytest.mark.parametrize(("c", "n", "rows"), [(8, 4, 7), (24, 2, 33), (136, 2, 5)])
def test_swiglu_transition(kit, c, n, rows):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = _randomize(SwiGLUTransition(c_in=c, n=n), c)
    mask = (torch.rand(1, rows) > 0.3).float()
    _compare(module, {"x": torch.randn(1, rows, c), "mask": mask}, _force)


def test_swiglu_transition_reads_model_settings(kit):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = _randomize(SwiGLUTransition(c_in=8, n=2), 5).train()
    memory = ConfigDict(
        {
            "train": {"use_evofusion_transitions": True},
            "eval": {"use_evofusion_transitions": False},
        }
    )

    def tag():
        for m in module.modules():
            object.__setattr__(m, registry.MEMORY_ATTR, memory)

    _compare(module, {"x": torch.randn(2, 5, 8), "mask": torch.ones(2, 5)}, tag)


def test_conditioned_transition_block(kit):
    from openfold3.core.model.layers.transition import ConditionedTransitionBlock

    module = _randomize(ConditionedTransitionBlock(c_a=16, c_s=8, n=2), 7)
    inputs = {
        "a": torch.randn(1, 2, 9, 16),
        "s": torch.randn(1, 2, 9, 8),
        "mask": (torch.rand(1, 2, 9) > 0.3).float(),
    }
    _compare(module, inputs, _force)
