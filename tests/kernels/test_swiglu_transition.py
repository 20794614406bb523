"""Fused SwiGLU transition against an fp64 oracle and against OF3's own modules.

Acceptance rule (flash-attention / TransformerEngine style): the kernel's largest
error against the fp64 reference may be at most twice plain torch's largest error in
the same dtype, plus a floor relative to the reference's magnitude. Plain torch here
is OF3's eager math (``swiglu_transition_reference(upcast=False)``), which rounds
every intermediate to the compute dtype; the kernel rounds fewer of them, so it is
usually well inside the bound.
"""

from __future__ import annotations

import pytest
import torch

from of3_megafold.kernels.backend import cuda_tf32
from of3_megafold.kernels.swiglu_transition import (
    SwiGLUTransitionFunction,
    swiglu_mlp,
    swiglu_transition,
    swiglu_transition_reference,
)
from of3_megafold.kernels.swiglu_transition import function as transition_function
from of3_megafold.kernels.swiglu_transition.function import MAX_FUSED_CHANNELS

# Floors relative to max|reference|. Forward: one rounding of the output plus the
# fp32 accumulation order. Backward floors are looser: the weight gradients sum
# over every row and the LayerNorm backward subtracts two row means of the
# gradient, which cancels digits torch's fp64-exact oracle keeps.
FLOORS = {
    torch.float32: {"fwd": 2e-6, "bwd": 1e-5},
    torch.float16: {"fwd": 1e-3, "bwd": 2e-3},
    torch.bfloat16: {"fwd": 2e-3, "bwd": 5e-3},
}
GRAD_NAMES = ("x", "ln_weight", "ln_bias", "w_a", "w_b", "w_out")


def make_inputs(shape, c, n, dtype, device, seed=0, mask_kind="zeros"):
    """x ``[*shape, c]`` in ``dtype`` and fp32 parameters (as OF3 keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    h = n * c

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = randn(*shape, c) * 2.0 + 0.5
    params = {
        "ln_weight": 1.0 + 0.2 * randn(c),
        "ln_bias": 0.2 * randn(c),
        "w_a": randn(h, c) * (2.0 / c) ** 0.5,
        "w_b": randn(h, c) * (2.0 / c) ** 0.5,
        "w_out": randn(c, h) * (1.0 / h) ** 0.5,
    }
    if mask_kind is None:
        mask = None
    else:
        mask = (torch.rand(*shape, generator=gen) > 0.3).double()
        if mask.numel() > 1:
            mask.view(-1)[0] = 0.0
            mask.view(-1)[-1] = 1.0
    x = x.to(device=device, dtype=dtype)
    params = {k: v.to(device=device, dtype=torch.float32) for k, v in params.items()}
    if mask is not None:
        mask = mask.to(device)
    return x, params, mask


def leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def run(fn, x, params, mask, dy, **kwargs):
    """Output and the gradients of every input (``None`` where not required)."""
    x = leaf(x)
    ps = {k: leaf(v) for k, v in params.items()}
    args = [x, ps["ln_weight"], ps["ln_bias"], ps["w_a"], ps["w_b"], ps["w_out"]]
    y = fn(*args, mask=mask, **kwargs)
    y.backward(dy.to(y.dtype))
    return y.detach(), [a.grad for a in args]


def oracle(x, params, mask, dy, normalize=True):
    p64 = {k: v.double() for k, v in params.items()}
    m64 = mask.double() if mask is not None else None
    return run(
        lambda *a, mask: swiglu_transition_reference(
            *a, mask=mask, normalize=normalize
        ),
        x.double(), p64, m64, dy.double(),
    )  # fmt: skip


def max_err(a, ref):
    return (a.double() - ref).abs().max().item() if ref.numel() else 0.0


# How far the torch baseline itself may be from the fp64 oracle, relative to the
# largest value, in units of the dtype's floor: rounding only. A baseline that means
# something else than the oracle (OF3's module with other math) is O(1) away, and
# fails here instead of widening the 2x rule.
AGREE = 25.0


def assert_within_2x_torch(name, out, torch_out, ref, floor):
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch_err = max_err(torch_out, ref)
    assert torch_err <= AGREE * floor * max(scale, 1e-3), (
        f"{name}: the torch baseline is {torch_err:.3g} from the oracle (max "
        f"{scale:.2g}): they do not compute the same thing"
    )
    tol = 2.0 * torch_err + floor * max(scale, 1e-3)
    err = max_err(out, ref)
    assert err <= tol, (
        f"{name}: error {err:.3g} > {tol:.3g} (torch {torch_err:.3g}, max {scale:.2g})"
    )


def check_against_oracle(x, params, mask, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    y, grads = run(swiglu_transition, x, params, mask, dy)
    y_t, grads_t = run(swiglu_transition_reference, x, params, mask, dy)
    y_r, grads_r = oracle(x, params, mask, dy)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_within_2x_torch("y", y, y_t, y_r, FLOORS[dtype]["fwd"])
    for name, g, g_t, g_r in zip(GRAD_NAMES, grads, grads_t, grads_r, strict=True):
        assert g is not None and g.dtype == (x.dtype if name == "x" else torch.float32)
        assert_within_2x_torch(f"d{name}", g, g_t, g_r, FLOORS[dtype]["bwd"])
    if mask is not None:
        # masked rows get exactly zero output and zero input gradient
        dead = mask == 0
        assert torch.all(y[dead] == 0)
        assert torch.all(grads[0][dead] == 0)


# (rows, c, n): one row, a row count below, just past and well past a 32-row block,
# channel counts below / between powers of two.
CASES = [
    (1, 8, 2),
    (7, 24, 4),
    (33, 64, 2),
    (130, 24, 2),
    (33, 8, 4),
    (130, 64, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,c,n", CASES)
def test_matches_fp64(rows, c, n, dtype, device):
    x, params, mask = make_inputs((rows,), c, n, dtype, device)
    check_against_oracle(x, params, mask, dtype)


@pytest.mark.parametrize(
    "path,chunks", [("gemm", 2), ("kernel", 5), ("auto", 4), ("auto", 5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_grad_paths_over_row_chunks(path, chunks, dtype, device, monkeypatch):
    """Both ways of reducing the weight gradients over the rows, the "gemm" one with
    the rows split into chunks (the last one ragged), and "auto" choosing between
    them by the number of chunks: every gradient against the oracle, and the
    chunks' LayerNorm partial sums land where the sum reads them."""
    monkeypatch.setattr(transition_function, "WEIGHT_GRAD_PATH", path)
    monkeypatch.setattr(transition_function, "HIDDEN_CHUNK_BYTES", 1)
    sms = transition_function._num_sms(0 if device == "cuda" else None)
    chunk = transition_function._hidden_chunk_rows(10**6, 24, 48, 4, sms)  # 1 wave
    rows = (chunks - 1) * chunk + 77
    calls = []
    launch = transition_function._bwd_input_rows

    def counted(r0, n, *args):
        calls.append((r0, n))
        launch(r0, n, *args)

    monkeypatch.setattr(transition_function, "_bwd_input_rows", counted)
    x, params, mask = make_inputs((rows,), 24, 2, dtype, device)
    check_against_oracle(x, params, mask, dtype)
    by_gemm = path == "gemm" or (  # "auto": from GEMM_MIN_CHUNKS full chunks up
        path == "auto" and rows >= transition_function.GEMM_MIN_CHUNKS * chunk
    )
    if by_gemm:
        full = [(i * chunk, chunk) for i in range(chunks - 1)]
        assert calls == full + [((chunks - 1) * chunk, 77)]
    else:
        assert calls == [(0, rows)]


def test_fp16_batched_shape(device):
    x, params, mask = make_inputs((2, 3, 11), 24, 4, torch.float16, device)
    check_against_oracle(x, params, mask, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_no_mask(dtype, device):
    x, params, _ = make_inputs((3, 13), 24, 2, dtype, device)
    check_against_oracle(x, params, None, dtype)


@pytest.mark.parametrize("kind", ["trailing_one", "bool", "broadcast"])
def test_mask_forms(kind, device):
    x, params, mask = make_inputs((4, 9), 16, 2, torch.float32, device)
    if kind == "trailing_one":
        given = mask.unsqueeze(-1)  # how OF3's _transition receives it
    elif kind == "bool":
        given = mask.bool()
    else:
        mask = mask[:1].expand(4, 9)
        given = mask[:1]
    args = [x, *params.values()]
    y = swiglu_transition(*args, mask=given)
    y_r = swiglu_transition_reference(*args, mask=mask.float())
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)


def test_noncontiguous_input(device):
    x, params, mask = make_inputs((6, 5), 16, 2, torch.float32, device)
    x_t = x.transpose(0, 1)  # rows no longer one stride apart
    check_against_oracle(x_t, params, mask.transpose(0, 1), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_mlp_without_layernorm(dtype, device):
    """The core for ConditionedTransitionBlock: no LayerNorm in the kernel."""
    x, params, mask = make_inputs((37,), 24, 2, dtype, device)
    ws = [params[k] for k in ("w_a", "w_b", "w_out")]
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device)

    def outputs(fn, x, ws, mask, dy):
        x = leaf(x)
        ws = [leaf(w) for w in ws]
        y = fn(x, *ws, mask)
        y.backward(dy.to(y.dtype))
        return [y.detach(), x.grad, *(w.grad for w in ws)]

    def ref(x, *ws_mask):
        return swiglu_transition_reference(x, None, None, *ws_mask, normalize=False)

    got = outputs(swiglu_mlp, x, ws, mask, dy)
    plain = outputs(ref, x, ws, mask, dy)
    exact = outputs(ref, x.double(), [w.double() for w in ws], mask.double(), dy)
    for name, g, g_t, g_r in zip(
        ("y", "x", "w_a", "w_b", "w_out"), got, plain, exact, strict=True
    ):
        key = "fwd" if name == "y" else "bwd"
        assert_within_2x_torch(name, g, g_t, g_r, FLOORS[dtype][key])


@pytest.mark.parametrize(
    "wanted",
    [("x",), ("w_a", "w_b", "w_out"), ("w_out",), ("ln_weight",), ("x", "w_b")],
)
def test_only_requested_gradients(wanted, device):
    x, params, mask = make_inputs((19,), 16, 2, torch.float32, device)
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(x.shape, generator=gen).to(device)
    tensors = dict(x=x, **params)
    leaves = {k: leaf(v, k in wanted) for k, v in tensors.items()}
    args = [leaves[k] for k in GRAD_NAMES]
    swiglu_transition(*args, mask=mask).backward(dy)
    _, grads_r = oracle(x, params, mask, dy)
    for name, g_r in zip(GRAD_NAMES, grads_r, strict=True):
        g = leaves[name].grad
        if name in wanted:
            torch.testing.assert_close(g.double(), g_r, rtol=1e-4, atol=1e-4)
        else:
            assert g is None


def test_zero_rows(device):
    x, params, _ = make_inputs((0,), 16, 2, torch.float32, device, mask_kind=None)
    dy = torch.zeros_like(x)
    y, grads = run(swiglu_transition, x, params, None, dy)
    assert y.shape == (0, 16)
    assert all(g is not None and torch.all(g == 0) for g in grads)


def test_wide_channels_take_torch_path(device):
    def grad_fn_name(c):
        x, params, mask = make_inputs((5,), c, 2, torch.float32, device)
        args = [leaf(x), *(leaf(p) for p in params.values())]
        y = swiglu_transition(*args, mask=mask)
        torch.testing.assert_close(y, swiglu_transition_reference(*args, mask=mask))
        return type(y.grad_fn).__name__

    assert "SwiGLUTransitionFunction" in grad_fn_name(MAX_FUSED_CHANNELS)
    assert "SwiGLUTransitionFunction" not in grad_fn_name(MAX_FUSED_CHANNELS + 32)


def test_swiglu_mlp_on_the_torch_path_skips_the_layernorm(device):
    """Past the fused width swiglu_mlp falls back to torch without normalising, as
    its fused path does; swiglu_transition refuses to run without its LayerNorm
    (its fallback would have normalised without the affine, its kernels not)."""
    c = MAX_FUSED_CHANNELS + 32
    x, params, mask = make_inputs((5,), c, 2, torch.float32, device)
    ws = (params["w_a"], params["w_b"], params["w_out"])
    torch.testing.assert_close(
        swiglu_mlp(x, *ws, mask),
        swiglu_transition_reference(x, None, None, *ws, mask, normalize=False),
    )
    with pytest.raises(ValueError, match="needs both LayerNorm parameters"):
        swiglu_transition(x, None, None, *ws, mask)


def test_torch_path_returns_the_compute_dtype(device):
    """Under autocast both paths return the autocast dtype, fp32 inputs or not."""
    for c in (MAX_FUSED_CHANNELS, MAX_FUSED_CHANNELS + 32):
        x, params, mask = make_inputs((3,), c, 2, torch.float32, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = swiglu_transition(x, *params.values(), mask=mask)
            y_mlp = swiglu_mlp(x, params["w_a"], params["w_b"], params["w_out"])
        assert y.dtype == y_mlp.dtype == torch.bfloat16, c


def test_autograd_function_direct(device):
    x, params, mask = make_inputs((9,), 16, 2, torch.float32, device)
    args = [leaf(x), *(leaf(p) for p in params.values())]
    y = SwiGLUTransitionFunction.apply(*args, mask, 1e-5, torch.float32)
    torch.testing.assert_close(
        y, swiglu_transition_reference(*args, mask=mask).detach()
    )


# --- against OF3's own modules -------------------------------------------------


def _of3_swiglu_transition(c, n, params, device):
    from openfold3.core.model.layers.transition import SwiGLUTransition

    module = SwiGLUTransition(c_in=c, n=n).to(device)
    with torch.no_grad():
        module.layer_norm.weight.copy_(params["ln_weight"])
        module.layer_norm.bias.copy_(params["ln_bias"])
        module.swiglu.linear_a.weight.copy_(params["w_a"])
        module.swiglu.linear_b.weight.copy_(params["w_b"])
        module.linear_out.weight.copy_(params["w_out"])  # OF3 initialises it to 0
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_of3_swiglu_transition(dtype, device):
    pytest.importorskip("openfold3")
    c, n = 24, 4
    x, params, mask = make_inputs((3, 11), c, n, dtype, device)
    module = _of3_swiglu_transition(c, n, params, device)
    gen = torch.Generator().manual_seed(7)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device)

    x_of3 = leaf(x)
    # OF3 multiplies by the mask in the mask's dtype: hand it one in x's dtype.
    y_of3 = module(x_of3, mask=mask.to(dtype))
    y_of3.backward(dy.to(dtype))
    of3_grads = [x_of3.grad] + [
        p.grad
        for p in (
            module.layer_norm.weight,
            module.layer_norm.bias,
            module.swiglu.linear_a.weight,
            module.swiglu.linear_b.weight,
            module.linear_out.weight,
        )
    ]
    y, grads = run(swiglu_transition, x, params, mask, dy)
    y_r, grads_r = oracle(x, params, mask, dy)
    assert y.dtype == y_of3.dtype
    assert_within_2x_torch("y", y, y_of3, y_r, FLOORS[dtype]["fwd"])
    for name, g, g_of3, g_r in zip(GRAD_NAMES, grads, of3_grads, grads_r, strict=True):
        assert_within_2x_torch(f"d{name}", g, g_of3, g_r, FLOORS[dtype]["bwd"])


def test_matches_of3_under_autocast(device):
    """bf16 autocast, fp32 inputs and weights: how Lightning's bf16-mixed runs OF3."""
    pytest.importorskip("openfold3")
    c, n = 16, 2
    x, params, mask = make_inputs((21,), c, n, torch.float32, device)
    module = _of3_swiglu_transition(c, n, params, device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        y_of3 = module(x, mask=mask.to(torch.bfloat16))
        y = swiglu_transition(x, *params.values(), mask=mask)
    assert y.dtype == y_of3.dtype == torch.bfloat16
    y_r = swiglu_transition_reference(
        x.double(), *(p.double() for p in params.values()), mask=mask.double()
    )
    assert_within_2x_torch("y", y, y_of3, y_r, FLOORS[torch.bfloat16]["fwd"])


def test_matches_of3_conditioned_transition(device):
    """OF3's ConditionedTransitionBlock rebuilt as torch AdaLN + fused SwiGLU core +
    torch sigmoid gate, on the module's own weights."""
    pytest.importorskip("openfold3")
    from openfold3.core.model.layers.transition import ConditionedTransitionBlock

    c_a, c_s, n = 16, 24, 2
    block = ConditionedTransitionBlock(c_a=c_a, c_s=c_s, n=n).to(device)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in block.parameters():  # OF3's zero/"final" inits would hide errors
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    a = torch.randn(2, 13, c_a, generator=gen).to(device)
    s = torch.randn(2, 13, c_s, generator=gen).to(device)
    mask = (torch.rand(2, 13, generator=gen) > 0.3).float().to(device)

    def kit_block(a, s):
        a_norm = block.layer_norm(a, s)
        core = swiglu_mlp(
            a_norm,
            block.swiglu.linear_a.weight,
            block.swiglu.linear_b.weight,
            block.linear_out.weight,
        )
        return torch.sigmoid(block.linear_g(s)) * core * mask.unsqueeze(-1)

    dy = torch.randn(2, 13, c_a, generator=gen).to(device)
    results = []
    for fn in (lambda a, s: block(a, s, mask=mask), kit_block):
        block.zero_grad()
        a_, s_ = leaf(a), leaf(s)
        out = fn(a_, s_)
        out.backward(dy)
        results.append(
            [out.detach(), a_.grad, s_.grad]
            + [p.grad.clone() for p in block.parameters()]
        )
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


# --- GPU-only: production shapes, the fast-sigmoid path, fp32 on IEEE dots ---------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str
)
@pytest.mark.parametrize(
    "shape,c,n", [((64, 96), 128, 4), ((4097,), 64, 4), ((1000,), 64, 2)]
)
def test_gpu_production_shapes(shape, c, n, dtype):
    x, params, mask = make_inputs(shape, c, n, dtype, "cuda")
    check_against_oracle(x, params, mask, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "gemm"])
@pytest.mark.parametrize("allow_tf32", [False, True])
@pytest.mark.parametrize("c", [128, 32])
def test_gpu_fp32_stays_ieee(c, allow_tf32, path, monkeypatch):
    """fp32 runs IEEE dots even with TF32 allowed globally: forward and backward,
    with either weight-gradient path (the "gemm" one runs cuBLAS). c = 32 with TF32
    allowed is the case Triton 3.6 failed to compile on an H200."""
    monkeypatch.setattr(transition_function, "WEIGHT_GRAD_PATH", path)
    x, params, mask = make_inputs((2048,), c, 4, torch.float32, "cuda")
    with cuda_tf32(allow_tf32):
        dy = torch.randn(x.shape, device="cuda", dtype=torch.float64)
        y, grads = run(swiglu_transition, x, params, mask, dy)
        assert torch.backends.cuda.matmul.allow_tf32 == allow_tf32  # restored
    y_r, grads_r = oracle(x, params, mask, dy)
    # TF32 (10-bit mantissa) would miss these by orders of magnitude.
    for name, got, ref in zip(
        ("y",) + GRAD_NAMES, (y, *grads), (y_r, *grads_r), strict=True
    ):
        assert max_err(got, ref) <= 1e-4 * ref.abs().max().item(), name
