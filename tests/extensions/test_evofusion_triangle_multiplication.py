"""EvoFusion inside OF3's triangle multiplications: same weights, key on vs off.

Both run under bf16 autocast with bf16 pair activations (how OF3 trains); errors
against OF3's module in float64. The kit (Triton; the interpreter on CPU) must stay
within 2x OF3's bf16 error plus a small floor, for the output and the gradients of
the input and of every parameter. Other calls keep OF3's path, bit for bit.
"""

import copy

import pytest
import torch

from of3_megafold import activate
from of3_megafold.errors import KitConfigError

NAME = "evofusion_triangle_multiplication"


@pytest.fixture
def kernel_calls(monkeypatch, interpreted_kernels):
    """The input dtype of every fused autograd call."""
    from of3_megafold.kernels.triangle_multiplication import function as kernels

    calls = []
    apply = kernels.TriangleMultiplicationFunction.apply
    monkeypatch.setattr(kernels.TriangleMultiplicationFunction, "apply",
                        lambda *args: calls.append(args[0].dtype) or apply(*args))
    return calls


def _module(outgoing: bool, c_z: int, c_hidden: int, seed: int):
    from openfold3.core.model.layers.triangular_multiplicative_update import (
        TriangleMultiplicationIncoming,
        TriangleMultiplicationOutgoing,
    )

    cls = TriangleMultiplicationOutgoing if outgoing else TriangleMultiplicationIncoming
    module = cls(c_z=c_z, c_hidden=c_hidden)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # AF3 initialises linear_z to zero: random weights instead
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _run(module, z, mask, grad_out, autocast=True):
    z = z.detach().clone().requires_grad_()
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(z, mask)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), z.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize(("outgoing", "lead", "n", "c_z", "c_hidden"), [
    (True, (1,), 13, 16, 12),
    (False, (1,), 13, 16, 12),
    (True, (1, 2), 7, 24, 16),  # the template stack's extra dim
])
def test_matches_of3_module(kit, kernel_calls, outgoing, lead, n, c_z, c_hidden):
    module = _module(outgoing, c_z, c_hidden, seed=n + c_z)
    torch.manual_seed(3)
    z = torch.randn(*lead, n, n, c_z)
    mask = (torch.rand(*lead, n, n) > 0.2).float()
    grad_out = torch.randn(*lead, n, n, c_z, dtype=torch.float64)
    reference = _run(copy.deepcopy(module).double(), z.double(), mask.double(),
                     grad_out, autocast=False)
    stock = _run(module, z.bfloat16(), mask, grad_out)
    activate(force=[NAME])
    kit_ = _run(module, z.bfloat16(), mask, grad_out)
    activate()
    for i, (r, s, k) in enumerate(zip(reference, stock, kit_, strict=True)):
        scale = r.abs().max().item() + 1e-12
        stock_err = (s.double() - r).abs().max().item() / scale
        kit_err = (k.double() - r).abs().max().item() / scale
        assert kit_err <= 2 * stock_err + 2e-3, (i, kit_err, stock_err)
    assert kernel_calls == [torch.bfloat16]


def test_other_calls_keep_of3s_path(kit, kernel_calls):
    """The in-place inference path and fp32 pair activations: OF3's own result."""
    module = _module(True, 16, 12, seed=4)
    z = torch.randn(1, 9, 9, 16).bfloat16()
    mask = (torch.rand(1, 9, 9) > 0.2).float()
    with torch.no_grad():  # (the in-place path may write over its input)
        inplace = module(z.clone(), mask, inplace_safe=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fp32 = module(z.float(), mask)
        activate(force=[NAME])
        assert torch.equal(module(z.clone(), mask, inplace_safe=True), inplace)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(module(z.float(), mask), fp32)
    assert kernel_calls == []


def test_clash_with_cueq_flag_is_rejected(kit):
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    memory = {"train": {"use_evofusion_triangle_multiplication": True,
                        "use_cueq_triangle_kernels": True}}
    custom = {"settings": {"memory": memory}}
    with pytest.raises(KitConfigError, match="use_cueq_triangle_kernels"):
        OF3ProjectEntry().get_model_config_with_update(ModelUpdate(custom=custom))
    memory["train"]["use_cueq_triangle_kernels"] = False
    config = OF3ProjectEntry().get_model_config_with_update(ModelUpdate(custom=custom))
    assert config.settings.memory.train.use_evofusion_triangle_multiplication is True


def test_cpu_tensors_take_ofs_path_without_the_interpreter(
    kit, monkeypatch, device_fallback_messages
):
    """On a GPU machine without the interpreter the kernels cannot take CPU tensors:
    the forced extension runs OF3's own path and says so once."""
    from of3_megafold.kernels import backend

    module = _module(True, 16, 12, seed=5)
    z = torch.randn(1, 6, 6, 16).bfloat16()
    with torch.no_grad():
        expected = module(z, None)
        activate(force=[NAME])
        monkeypatch.setattr(backend, "interpreter_enabled", lambda: False)
        assert torch.equal(module(z, None), expected)
        assert torch.equal(module(z, None), expected)
    said = device_fallback_messages()
    assert len(said) == 1 and NAME in said[0]
