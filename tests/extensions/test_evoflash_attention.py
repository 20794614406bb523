"""EvoFlash-3D inside OF3's attention modules: same weights, key on vs off.

Errors are measured against OF3's own module in float64; the kit (Triton; the
interpreter on CPU) must stay within 2x the error of OF3's torch path in the same
dtype (fp32, or bf16 autocast as OF3 trains) plus a small floor, for the output and
every gradient (input, pair input, weights).
"""

import copy

import pytest
import torch
from ml_collections import ConfigDict

from of3_megafold import activate, registry
from of3_megafold.errors import KitConfigError


@pytest.fixture
def kit():
    activate()
    yield
    activate()


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    # AF3 initialises several projections to zero; random weights test every path.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


# Error floor per autocast dtype (None: fp32, no autocast). bf16: both paths round
# the projections, the bias and every gradient to bf16 (a relative step of 2^-8), so
# their errors are a few such roundings each and the ratio of two of them is noisy
# at these sizes.
FLOOR = {None: 1e-5, torch.bfloat16: 2e-3}


def _run(module, inputs: dict, grad_out: torch.Tensor, autocast=None):
    inputs = {
        k: v.detach().clone().requires_grad_(v.is_floating_point() and k != "mask")
        for k, v in inputs.items()
    }
    module.zero_grad()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = module(**inputs)
    out.backward(grad_out.to(out.dtype))
    grads = [v.grad for k, v in inputs.items() if v.requires_grad]
    grads += [p.grad for p in module.parameters()]
    return [out.detach(), *grads]


def _compare(module, inputs, forced_or_tagged, autocast=None):
    """Errors of the kit and of stock OF3 (fp32 weights, fp32 or bf16 autocast)
    against stock OF3 in fp64."""
    torch.manual_seed(1)
    ref_module = copy.deepcopy(module).double()
    # fp64 still resolves logits next to OF3's -1e9 mask bias, where fp32 and the
    # kernel swallow them: a query whose keys are all masked gets softmax(logits) in
    # fp64 but uniform weights in OF3's fp32 (and the kit). A mask bias far past
    # fp64's resolution gives the reference OF3's fp32 semantics there, so those rows
    # are compared instead of being a large error for both paths.
    for m in ref_module.modules():
        if hasattr(m, "inf"):
            m.inf = 1e30
    ref_inputs = {k: v.double() for k, v in inputs.items()}
    out_shape = module(**inputs).shape
    grad_out = torch.randn(out_shape, dtype=torch.float64)
    reference = _run(ref_module, ref_inputs, grad_out)
    stock = _run(module, inputs, grad_out, autocast)
    forced_or_tagged()
    kit = _run(module, inputs, grad_out, autocast)
    activate()
    for name, r, s, k in zip(range(len(reference)), reference, stock, kit, strict=True):
        if r is None:
            continue
        scale = r.abs().max().item() + 1e-12
        stock_err = (s.double() - r).abs().max().item() / scale
        kit_err = (k.double() - r).abs().max().item() / scale
        assert kit_err <= 2 * stock_err + FLOOR[autocast], (name, kit_err, stock_err)


def _force():
    activate(force=["evoflash_attention"])


def _triangle_attention(starting=True, biases=(), seed=0):
    """OF3's TriangleAttention (c_in 16, 2 heads x 8), every weight random; the
    layers named in ``biases`` get a bias (OF3's have none)."""
    import openfold3.core.config.default_linear_init_config as lin_init
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    params = copy.deepcopy(lin_init.tri_att_init)
    for name in biases:
        layer = params.linear_z if name == "linear_z" else params.mha[name]
        layer.bias = True
    module = TriangleAttention(
        c_in=16, c_hidden=8, no_heads=2, starting=starting, linear_init_params=params
    )
    return _randomize(module, seed)


def _pair_inputs(lead, n, masked=True):
    """``x [*lead, n, n, 16]`` and a pair mask with random zeros and token 1
    padded (its row and column zero: one query row with every key masked, from
    either end)."""
    gen = torch.Generator().manual_seed(5)
    inputs = {"x": torch.randn(*lead, n, n, 16, generator=gen)}
    if masked:
        mask = (torch.rand(*lead, n, n, generator=gen) > 0.2).float()
        mask[..., 1, :] = 0.0
        mask[..., :, 1] = 0.0
        inputs["mask"] = mask
    return inputs


class _Call(torch.nn.Module):
    """``module(**inputs, **fixed)``: fixed keyword arguments for :func:`_compare`."""

    def __init__(self, module, **fixed):
        super().__init__()
        self.inner = module
        self.fixed = fixed

    def forward(self, **inputs):
        return self.inner(**inputs, **self.fixed)


def _mha_calls(module) -> list:
    """A list that grows by one at every call of ``module.mha`` (OF3's Attention):
    the fused path never calls it."""
    calls = []
    module.mha.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("starting", "transpose_bias", "lead", "n", "autocast", "masked", "biases"),
    [
        (True, False, (1,), 17, None, True, ()),
        (False, False, (1,), 7, None, True, ()),
        # transpose_bias on a starting module: how the pairformer runs its ending node
        (True, True, (2,), 7, None, True, ()),
        (False, True, (1, 2), 7, None, False, ("linear_g", "linear_z")),
        (True, False, (1,), 7, torch.bfloat16, True, ()),
        (False, True, (1,), 7, torch.bfloat16, True, ("linear_q",)),
    ],
)
def test_triangle_attention(
    kit, starting, transpose_bias, lead, n, autocast, masked, biases
):
    """The fused module path (one projection GEMM, strided views into the kernel)
    against OF3's module: output, input gradient and every parameter's gradient."""
    module = _triangle_attention(starting, biases)
    calls = _mha_calls(module)

    def force():
        _force()
        calls.clear()

    inputs = _pair_inputs(lead, n, masked)
    _compare(_Call(module, transpose_bias=transpose_bias), inputs, force, autocast)
    assert not calls, "the key-on run went through OF3's forward, not the fused path"


def test_triangle_attention_dtypes_follow_of3(kit, monkeypatch):
    """Under bf16 autocast the fused path returns OF3's dtype (bf16) and feeds the
    kernel bf16 Q, K, V and bias, as views of one projection output."""
    from of3_megafold.kernels import evoflash

    module = _triangle_attention()
    inputs = _pair_inputs((1,), 5)
    seen = []

    def spy(q, k, v, mask_bias=None, pair_bias=None, **kwargs):
        storage = q.untyped_storage().data_ptr()
        seen.append(
            (q.dtype, k.dtype, v.dtype, pair_bias.dtype)
            + tuple(t.untyped_storage().data_ptr() == storage for t in (k, v))
        )
        return original(q, k, v, mask_bias=mask_bias, pair_bias=pair_bias, **kwargs)

    original = evoflash.evoflash_attention
    monkeypatch.setattr(evoflash, "evoflash_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = module(**inputs)
        _force()
        fused = module(**inputs)
    assert fused.dtype == stock.dtype == torch.bfloat16
    assert seen == [(torch.bfloat16,) * 4 + (True, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_autograd_bitwise(dtype):
    """The gate that keeps ``g`` instead of ``sigmoid(g)`` gives autograd's values
    for OF3's ``o * sigmoid(g)``, bit for bit, forward and backward."""
    from of3_megafold.extensions.evoflash_attention import _SigmoidGate

    gen = torch.Generator().manual_seed(6)
    o, g, grad = (torch.randn(3, 7, 2, 8, generator=gen, dtype=dtype) for _ in range(3))
    o.requires_grad_()
    g.requires_grad_()
    stock = o * torch.nn.Sigmoid()(g)
    gated = _SigmoidGate.apply(o, g)
    assert torch.equal(gated, stock)
    for a, b in zip(
        torch.autograd.grad(gated, (o, g), grad),
        torch.autograd.grad(stock, (o, g), grad),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs", [{"chunk_size": 3}, {"use_lma": True}], ids=["chunk_size", "use_lma"]
)
def test_triangle_attention_unsupported_call_takes_of3_path(kit, monkeypatch, kwargs):
    """Arguments the fused path does not take run OF3's own forward, whose
    Attention call still gets the kernel; the result matches the unchunked stock
    module."""
    from of3_megafold.kernels import evoflash

    module = _triangle_attention(seed=4)
    calls = _mha_calls(module)
    inputs = _pair_inputs((1,), 7)
    stock = module(**inputs)
    calls.clear()
    kernel_calls = []
    original = evoflash.evoflash_attention

    def counted(*args, **kw):
        kernel_calls.append(1)
        return original(*args, **kw)

    monkeypatch.setattr(evoflash, "evoflash_attention", counted)
    _force()
    out = module(**inputs, **kwargs)
    activate()
    assert calls, "expected OF3's TriangleAttention.forward (it calls module.mha)"
    assert kernel_calls, "expected OF3's Attention call to run on the kernel"
    torch.testing.assert_close(out, stock, rtol=1e-4, atol=1e-5)


def test_triangle_attention_reads_model_settings(kit):
    """Config path: a module tagged with its model's memory settings (as OF3's
    ``OpenFold3.__init__`` does with the kit active) uses the kernel in train mode."""
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    module = _randomize(TriangleAttention(c_in=8, c_hidden=8, no_heads=2), 3)
    memory = ConfigDict(
        {
            "train": {"use_evoflash_attention": True},
            "eval": {"use_evoflash_attention": False},
        }
    )

    def tag():
        for m in module.modules():
            object.__setattr__(m, registry.MEMORY_ATTR, memory)

    x = torch.randn(1, 6, 6, 8)
    _compare(module.train(), {"x": x, "mask": torch.ones(1, 6, 6)}, tag)


@pytest.mark.parametrize("diffusion", [False, True])
def test_attention_pair_bias(kit, diffusion):
    from openfold3.core.model.layers import attention_pair_bias as apb

    cls = apb.DiffusionAttentionPairBias if diffusion else apb.AttentionPairBias
    module = _randomize(
        cls(c_q=16, c_k=16, c_v=16, c_s=8, c_z=4, c_hidden=4, no_heads=4), 2
    )
    n, samples = 11, 3
    lead = (1, samples) if diffusion else (1,)
    inputs = {
        "a": torch.randn(*lead, n, 16),
        "z": torch.randn(1, n, n, 4),
        "mask": (torch.rand(*lead, n) > 0.2).float(),
    }
    if diffusion:
        inputs["s"] = torch.randn(*lead, n, 8)
    _compare(_Call(module, use_high_precision_attention=True), inputs, _force)


def test_clash_with_of3_kernel_flags_is_rejected(kit):
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    custom = {"settings": {"memory": {"eval": {"use_evoflash_attention": True}}}}
    with pytest.raises(KitConfigError, match="use_triton_triangle_kernels"):
        OF3ProjectEntry().get_model_config_with_update(ModelUpdate(custom=custom))
    custom["settings"]["memory"]["eval"]["use_triton_triangle_kernels"] = False
    config = OF3ProjectEntry().get_model_config_with_update(ModelUpdate(custom=custom))
    assert config.settings.memory.eval.use_evoflash_attention is True
