"""EvoFlash-3D inside OF3's attention modules: same weights, key on vs off.

Errors are measured against OF3's own module in float64; the kit (fp32, Triton; the
interpreter on CPU) must stay within 2x the error of OF3's fp32 torch path plus a
small floor, for the output and every gradient (input, pair input, weights).
"""

import contextlib
import copy

import pytest
import torch
from ml_collections import ConfigDict

from of3_megafold import activate, registry
from of3_megafold.errors import KitConfigError


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    # AF3 initialises several projections to zero; random weights test every path.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _run(module, inputs: dict, grad_out: torch.Tensor):
    inputs = {
        k: v.detach().clone().requires_grad_(v.is_floating_point() and k != "mask")
        for k, v in inputs.items()
    }
    module.zero_grad()
    out = module(**inputs)
    out.backward(grad_out.to(out.dtype))
    grads = [v.grad for k, v in inputs.items() if v.requires_grad]
    grads += [p.grad for p in module.parameters()]
    return [out.detach(), *grads]


@contextlib.contextmanager
def _counted_kernel_calls():
    """Calls of the extension's kernel path while inside (a list, one per call)."""
    from of3_megafold.extensions import evoflash_attention as extension

    calls = []
    forward = extension.evoflash_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    extension.evoflash_forward = counted
    try:
        yield calls
    finally:
        extension.evoflash_forward = forward


@pytest.fixture
def kernel_entries(monkeypatch):
    """Calls of the two kernel entry points: ``{"projected": n, "separate": n}``."""
    from of3_megafold.kernels import evoflash

    counts = {"projected": 0, "separate": 0}
    for name, attr in (("projected", "evoflash_attention_projected"),
                       ("separate", "evoflash_attention")):
        entry = getattr(evoflash, attr)

        def counted(*args, _entry=entry, _name=name, **kwargs):
            counts[_name] += 1
            return _entry(*args, **kwargs)

        monkeypatch.setattr(evoflash, attr, counted)
    return counts


def _compare(module, inputs, forced_or_tagged):
    """Errors of kit-fp32 and stock-fp32 against stock-fp64."""
    torch.manual_seed(1)
    ref_module = copy.deepcopy(module).double()
    # fp64 still resolves logits next to OF3's -1e9 mask bias, where fp32 and the
    # kernel swallow them: a query whose keys are all masked gets softmax(logits) in
    # fp64 but uniform weights in OF3's fp32 (and the kit). A mask bias far past
    # fp64's resolution gives the reference OF3's fp32 semantics there; with 1e9 both
    # paths had ~17% error on those rows and the 2x rule could not fail.
    for m in ref_module.modules():
        if hasattr(m, "inf"):
            m.inf = 1e30
    ref_inputs = {k: v.double() for k, v in inputs.items()}
    out_shape = module(**inputs).shape
    grad_out = torch.randn(out_shape, dtype=torch.float64)
    reference = _run(ref_module, ref_inputs, grad_out)
    with _counted_kernel_calls() as calls:
        stock = _run(module, inputs, grad_out)
        assert not calls, "the kernel ran with the key off"
        forced_or_tagged()
        kit = _run(module, inputs, grad_out)
        activate()
    # kit == stock passes the error rule trivially: the kit's path must have run
    assert calls, "the kernel did not run (the extension took OF3's path)"
    overall = max(r.abs().max().item() for r in reference if r is not None)
    for name, r, s, k in zip(range(len(reference)), reference, stock, kit, strict=True):
        if r is None:
            continue
        scale = r.abs().max().item()
        if scale <= 1e-9 * overall:
            # Zero in exact arithmetic: the pair input's LayerNorm bias shifts every
            # logit of a query by the same amount, and softmax ignores that. Both
            # fp32 paths return round-off there, so the 2x rule would compare noise
            # (it failed at random on fresh inputs); require round-off level instead.
            kit_abs = (k.double() - r).abs().max().item()
            assert kit_abs <= 1e-5 * overall, (name, kit_abs, overall)
            continue
        stock_err = (s.double() - r).abs().max().item() / scale
        kit_err = (k.double() - r).abs().max().item() / scale
        assert kit_err <= 2 * stock_err + 1e-5, (name, kit_err, stock_err)


def _force():
    activate(force=["evoflash_attention"])


@pytest.mark.parametrize(("starting", "n"), [(True, 17), (False, 6)])
def test_triangle_attention(kit, interpreted_kernels, kernel_entries, starting, n):
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    module = _randomize(
        TriangleAttention(c_in=8, c_hidden=8, no_heads=2, starting=starting), 0
    )
    x = torch.randn(1, n, n, 8)
    mask = (torch.rand(1, n, n) > 0.2).float()
    mask[0, 1] = 0.0  # a fully masked row: OF3 gives it uniform attention
    _compare(module, {"x": x, "mask": mask}, _force)
    # self-attention: the projections inside the kernel's function, gated there
    assert kernel_entries == {"projected": 1, "separate": 0}


def test_triangle_attention_in_chunks(kit, interpreted_kernels, kernel_entries,
                                      monkeypatch):
    """The ending-node module (transposed input) with its projection in chunks of two
    rows, recomputed in the backward: still within the error rule against OF3."""
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    from of3_megafold.kernels.evoflash import projected

    n = 7
    module = _randomize(
        TriangleAttention(c_in=8, c_hidden=8, no_heads=2, starting=False), 4
    )
    slice_bytes = n * 4 * 2 * 8 * 4  # N x (4 projections x 2 heads x 8) fp32
    monkeypatch.setattr(projected, "CHUNK_BYTES", 2 * slice_bytes)
    assert len(projected.chunks(1, n, slice_bytes)) == 4
    x = torch.randn(1, n, n, 8)
    mask = (torch.rand(1, n, n) > 0.2).float()
    _compare(module, {"x": x, "mask": mask}, _force)
    assert kernel_entries == {"projected": 1, "separate": 0}


@pytest.mark.parametrize("gating", [True, False])
def test_attention_with_separate_key_input(kit, interpreted_kernels, kernel_entries,
                                           gating):
    """``q_x`` and ``kv_x`` distinct (same length): OF3's separate projections and
    gating around the kernel; and ungated self-attention on the projected path."""
    from openfold3.core.model.primitives.attention import Attention

    attention = _randomize(Attention(8, 8, 8, c_hidden=4, no_heads=2,
                                     gating=gating), 6)
    n = 9

    class Call(torch.nn.Module):
        def __init__(self, same):
            super().__init__()
            self.inner, self.same = attention, same

        def forward(self, q_x, kv_x, bias):
            return self.inner(q_x, q_x if self.same else kv_x, biases=[bias])

    inputs = {"q_x": torch.randn(1, 3, n, 8), "kv_x": torch.randn(1, 3, n, 8),
              "bias": torch.randn(1, 1, 2, n, n)}
    _compare(Call(same=False), inputs, _force)
    assert kernel_entries == {"projected": 0, "separate": 1}
    _compare(Call(same=True), inputs, _force)
    assert kernel_entries == {"projected": 1, "separate": 1}


def test_fixed_precision_projection_is_not_stacked(kit):
    """OF3's ``Linear.precision`` (a projection computed at its own precision)
    keeps the projections separate; otherwise the stacked weights and biases
    (zeros for q, k, v, which have none) give the four projections."""
    from openfold3.core.model.primitives.attention import Attention

    from of3_megafold.extensions.evoflash_attention import stacked_projection

    attention = _randomize(Attention(8, 8, 8, c_hidden=4, no_heads=2), 7)
    x = torch.randn(5, 8)
    assert stacked_projection(attention)[1] is None  # OF3's have no biases
    attention.linear_g.bias = torch.nn.Parameter(torch.randn(8))
    separate = torch.stack([attention.linear_q(x), attention.linear_k(x),
                            attention.linear_v(x), attention.linear_g(x)], 1)
    weight, bias = stacked_projection(attention)
    assert weight.shape == (4, 2, 4, 8) and bias.shape == (4, 2, 4)
    stacked = torch.einsum("nc,phdc->nphd", x, weight) + bias
    torch.testing.assert_close(stacked, separate.view(5, 4, 2, 4))
    attention.linear_k.precision = torch.float32
    assert stacked_projection(attention) is None


def test_projection_dtype_is_of3s(kit):
    """As OF3's ``Linear.forward``: bf16 stays bf16 (autocast or not), fp32 follows
    autocast."""
    from of3_megafold.extensions.evoflash_attention import projection_dtype

    x = torch.randn(2, 3)
    assert projection_dtype(x) is torch.float32
    assert projection_dtype(x.bfloat16()) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert projection_dtype(x) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert projection_dtype(x) is torch.float16
        assert projection_dtype(x.bfloat16()) is torch.bfloat16


def test_triangle_attention_reads_model_settings(kit, interpreted_kernels):
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


@pytest.mark.parametrize(("diffusion", "high_precision"),
                         [(False, True), (True, True), (False, False)])
def test_attention_pair_bias(kit, interpreted_kernels, kernel_entries, diffusion,
                             high_precision):
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
    module_kwargs = {"use_high_precision_attention": high_precision}

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, **kw):
            return self.inner(**kw, **module_kwargs)

    _compare(Call(), inputs, _force)
    # high precision keeps OF3's projections (q, k, v upcast), else the projected path
    projected = int(not high_precision)
    assert kernel_entries == {"projected": projected, "separate": 1 - projected}


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


def test_cpu_tensors_take_ofs_path_without_the_interpreter(
    kit, monkeypatch, device_fallback_messages
):
    """On a GPU machine without the interpreter the kernels cannot take CPU tensors
    (OF3's CPU tests run there too): the forced extension must run OF3's own path."""
    from openfold3.core.model.layers.triangular_attention import TriangleAttention

    from of3_megafold.extensions import evoflash_attention

    module = _randomize(TriangleAttention(c_in=8, c_hidden=8, no_heads=2), 5)
    x = torch.randn(1, 6, 6, 8)
    mask = (torch.rand(1, 6, 6) > 0.2).float()
    expected = module(x=x, mask=mask)
    _force()
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def kernel_called(*args, **kwargs):
        raise AssertionError("the kernel path ran on CPU tensors")

    monkeypatch.setattr(evoflash_attention, "evoflash_forward", kernel_called)
    assert torch.equal(module(x=x, mask=mask), expected)
    assert torch.equal(module(x=x, mask=mask), expected)
    said = device_fallback_messages()
    assert len(said) == 1 and "evoflash_attention" in said[0]
