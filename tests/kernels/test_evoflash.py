"""EvoFlash-3D against a float64 reference: forward and every gradient.

On CPU the kernels run under the Triton interpreter at small sizes (block 16, two
S slices per program, see ``configs.INTERPRETER_CONFIGS``); the ``gpu`` cases use
the tuned kernels at OF3's call-site shapes.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

from of3_megafold.kernels.backend import cuda_tf32
from of3_megafold.kernels.evoflash import (
    configs,
    evoflash_attention,
    evoflash_attention_projected,
    evoflash_attention_reference,
    function,
    projected,
)
from of3_megafold.kernels.evoflash.tolerances import FACTOR, FLOOR

INF = 1e9  # OF3's mask value


@dataclass(frozen=True)
class Case:
    B: int
    S: int
    N: int
    H: int
    D: int
    dtype: torch.dtype = torch.float32
    mask: str = "padded"  # none | padded (random keys and whole slices masked)
    #                       | tail (OF3's crop padding: the last keys masked)
    bias: str = "shared"  # none | shared [B,1,H,N,N] | per_s [B,S,H,N,N]
    #                       | permuted (a [B,1,N,N,H] view) | batch1 [1,1,H,N,N]
    bias_dtype: torch.dtype | None = None  # default: the input dtype
    high_precision: bool = False
    fused_qkv: bool = False  # q, k, v as slices of one [.., 3D] tensor
    projected: int = 0  # 3: evoflash_attention_projected from x [B, S, N, C] and
    #                     a [3, H, D, C] weight; 4: with a gate
    channels: int = 12  # C of a projected case

    def __str__(self):
        dt = str(self.dtype).removeprefix("torch.")
        hp = "-hp" if self.high_precision else ""
        fused = "-fused" if self.fused_qkv else ""
        fused += f"-projected{self.projected}C{self.channels}" if self.projected else ""
        bdt = str(self.bias_dtype).removeprefix("torch.") if self.bias_dtype else ""
        bdt = f"-{bdt}" if bdt else ""
        return (f"B{self.B}S{self.S}N{self.N}H{self.H}D{self.D}-{dt}{hp}"
                f"-mask_{self.mask}-bias_{self.bias}{bdt}{fused}")


def make_inputs(case: Case, device: str, seed: int):
    """Random q, k, v, mask bias, pair bias and output gradient (never zeros); for a
    projected case x, the stacked weight and its bias in place of q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    B, S, N, H, D = case.B, case.S, case.N, case.H, case.D

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if case.projected:
        C = case.channels
        q = randn(B, S, N, C)  # x
        k = randn(case.projected, H, D, C) * C ** -0.5  # the stacked weight
        v = randn(case.projected, H, D) * 0.5  # its bias
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    elif case.fused_qkv:
        qkv = randn(B, S, N, H, 3 * D)
        q, k, v = (t.detach().requires_grad_() for t in qkv.split(D, dim=-1))
    else:
        q, k, v = (randn(B, S, N, H, D).requires_grad_() for _ in range(3))

    mask_bias = None
    if case.mask == "padded":
        keep = (torch.rand(B, S, N, generator=gen) > 0.25).float()
        keep[..., 0] = 1.0
        if S > 1:
            keep[:, 1] = 0.0  # every key of slice 1 masked: uniform weights
        elif N > 1:
            keep[..., N // 2:] = 0.0
    elif case.mask == "tail":
        # the last quarter of the keys masked from the last key of a 16-key block,
        # in every slice but slice 0 (none) and slice 2 (only key 16, a block's
        # first): the ranges' ends sit on the interpreter's block edges, where the
        # key blocks before or after them skip the mask (_tiles._key_block_masked)
        keep = torch.ones(B, S, N)
        keep[:, 1:, max(0, N * 3 // 4 // 16 * 16 - 1):] = 0.0
        if N > 32 and S > 2:
            keep[:, 2] = 1.0
            keep[:, 2, 16] = 0.0
    if case.mask != "none":
        # fp16 cannot hold OF3's -1e9 (it becomes -inf, and a fully masked slice
        # NaN in torch and in the fp64 oracle): its cases keep the mask in fp32.
        mask_dtype = torch.float32 if case.dtype == torch.float16 else case.dtype
        mask_bias = (INF * (keep - 1.0))[:, :, None, None, :].to(device=device,
                                                                 dtype=mask_dtype)

    bias_dtype = case.bias_dtype or case.dtype
    pair_bias = None
    if case.bias == "shared":
        pair_bias = randn(B, 1, H, N, N, dtype=bias_dtype)
    elif case.bias == "per_s":
        pair_bias = randn(B, S, H, N, N, dtype=bias_dtype)
    elif case.bias == "batch1":
        pair_bias = randn(1, 1, H, N, N, dtype=bias_dtype)
    elif case.bias == "permuted":
        pair_bias = randn(B, 1, N, N, H, dtype=bias_dtype).permute(0, 1, 4, 2, 3)
    if pair_bias is not None:
        pair_bias.requires_grad_()
    do = randn(B, S, N, H, D)
    return q, k, v, mask_bias, pair_bias, do


def _kind(case: Case) -> str:
    if case.dtype == torch.bfloat16:
        return "bf16"
    if case.dtype == torch.float16:
        return "fp16"
    on_gpu = torch.cuda.is_available()
    return "tf32" if on_gpu and not case.high_precision else "fp32"


def _outputs(fn, q, k, v, mask_bias, pair_bias, do):
    """Output and gradients (q, k, v, pair_bias) of ``fn`` (x, the weight and its
    bias for a projected case)."""
    o = fn(q, k, v, mask_bias, pair_bias)
    leaves = [q, k, v] + ([pair_bias] if pair_bias is not None else [])
    return [o.detach()] + list(torch.autograd.grad(o, leaves, do))


def _projected(fn):
    """``fn`` (separate q, k, v) from x, the stacked ``[P, H, D, C]`` weight and its
    bias: the projection in x's dtype, OF3's gating for ``P = 4`` (``o *
    sigmoid(g)`` in the dtype ``fn`` returns)."""

    def call(x, weight, bias, m, b):
        qkv = torch.einsum("bsnc,phdc->bsnphd", x, weight) + bias
        q, k, v, *gate = qkv.unbind(3)
        o = fn(q, k, v, m, b)
        return o * torch.sigmoid(gate[0].to(o.dtype)) if gate else o

    return call


def check_case(case: Case, device: str, seed: int = 0, deterministic: bool = True):
    """Run ``case`` through the kernel, plain torch and the fp64 oracle; returns
    rows (name, kernel error, torch error, allowed) and asserts each passes."""
    q, k, v, mask_bias, pair_bias, do = make_inputs(case, device, seed)

    def kernel(q, k, v, m, b):
        if case.projected:
            return evoflash_attention_projected(q, k, v, m, b,
                                                deterministic=deterministic)
        return evoflash_attention(q, k, v, m, b, high_precision=case.high_precision,
                                  deterministic=deterministic)

    def plain(q, k, v, m, b):
        if m is not None and q.dtype == torch.float16 and not case.high_precision:
            m = m.clamp_min(-6e4)  # -1e9 is -inf in fp16 logits: NaN rows in torch
        return evoflash_attention_reference(q, k, v, m, b,
                                            upcast=case.high_precision)

    def oracle(q, k, v, m, b):
        return evoflash_attention_reference(q, k, v, m, b)

    if case.projected:
        plain, oracle = _projected(plain), _projected(oracle)

    kind = _kind(case)
    got = _outputs(kernel, q, k, v, mask_bias, pair_bias, do)
    with cuda_tf32(kind == "tf32"):
        base = _outputs(plain, q, k, v, mask_bias, pair_bias, do)
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None
                for t in (q, k, v)]
    bias64 = (pair_bias.detach().double().requires_grad_()
              if pair_bias is not None else None)
    want = _outputs(oracle, *leaves64, mask_bias, bias64, do.double())

    names = (["o", "dx", "dweight", "dproj_bias", "dbias"] if case.projected
             else ["o", "dq", "dk", "dv", "dbias"])
    rows = []
    for i, (name, g, b, w) in enumerate(zip(names, got, base, want, strict=False)):
        assert g.shape == w.shape and g.dtype == b.dtype, name
        assert torch.isfinite(g).all(), f"{case}: {name} not finite"
        err = (g.double() - w).abs().max().item()
        err_torch = (b.double() - w).abs().max().item()
        floor = FLOOR[kind][0 if i == 0 else 1]
        allowed = FACTOR * err_torch + floor * max(w.abs().max().item(), 1.0)
        rows.append((name, err, err_torch, allowed))
    bad = [r for r in rows if not r[1] <= r[3]]
    assert not bad, f"{case}: " + "; ".join(
        f"{n}: err {e:.3g} > allowed {a:.3g} (torch {t:.3g})" for n, e, t, a in bad)
    return rows


CPU_CASES = [
    Case(1, 1, 1, 2, 8),
    Case(1, 3, 16, 2, 32),
    Case(1, 3, 17, 1, 24, torch.bfloat16),
    Case(2, 1, 33, 2, 48, torch.bfloat16),
    Case(1, 3, 33, 2, 8, bias="none"),
    Case(1, 3, 17, 2, 48, torch.bfloat16, high_precision=True),
    Case(1, 3, 17, 2, 24, bias="per_s"),
    Case(1, 3, 16, 2, 32, torch.bfloat16, mask="none", bias="permuted",
         bias_dtype=torch.float32),
    Case(2, 3, 17, 1, 32, bias="batch1", fused_qkv=True),
    Case(1, 1, 1, 1, 24, torch.bfloat16),
    Case(1, 1, 33, 2, 24, high_precision=True, mask="none"),
    Case(1, 3, 16, 1, 48, mask="none", bias="none"),
    Case(1, 3, 17, 2, 16, torch.float16),
    # q/k/v[/gate] projected inside (the extension's self-attention path)
    Case(1, 3, 17, 2, 24, torch.bfloat16, projected=4),
    Case(2, 1, 33, 2, 16, bias="none", projected=3, channels=8),
    Case(1, 3, 16, 2, 32, projected=4, channels=20),
    Case(1, 1, 1, 1, 8, projected=4, channels=3),
    # crop padding: key blocks without masked keys skip the mask
    Case(1, 3, 65, 2, 32, mask="tail"),
    Case(2, 3, 50, 1, 24, torch.bfloat16, mask="tail", projected=4),
]


def _with_mask_ranges(case: Case, monkeypatch) -> None:
    """Tail-mask cases compute their mask ranges at any size (the kit does from
    ``MASK_RANGE_MIN_LOGITS``); the other masked cases add the mask to every block."""
    if case.mask == "tail":
        monkeypatch.setattr(function, "MASK_RANGE_MIN_LOGITS", 0)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_matches_fp64_reference(case, device, monkeypatch):
    _with_mask_ranges(case, monkeypatch)
    check_case(case, device, seed=zlib.crc32(str(case).encode()))


@pytest.mark.parametrize("projected", [0, 4])
def test_atomic_dq_variant(device, projected):
    case = Case(1, 3, 33, 2, 24, torch.bfloat16, projected=projected)
    check_case(case, device, seed=1, deterministic=False)


def _mask_range_reference(mask_bias: torch.Tensor, n: int) -> torch.Tensor:
    """(lo, hi) per slice of a ``[BM, SM, 1, 1, N|1]`` mask, in torch."""
    m = mask_bias[:, :, 0, 0, :].expand(-1, -1, n).float().cpu()
    out = torch.zeros(*m.shape[:2], 2, dtype=torch.int32)
    for b, s in itertools.product(range(m.shape[0]), range(m.shape[1])):
        idx = torch.nonzero(m[b, s] != 0).flatten()
        if idx.numel():
            out[b, s] = torch.tensor([idx.min(), idx.max() + 1])
    return out


def test_mask_range(device):
    """The per-slice range of nonzero key-mask values that decides which key blocks
    get the mask: random, tail, empty, full and single-key masks, NaN, a mask
    broadcast over S or over its keys, N past the kernel's block (1024)."""
    gen = torch.Generator().manual_seed(12)
    n = 70 if configs.INTERPRET else 1100
    m = torch.zeros(2, 6, 1, 1, n)
    m[0, 0] = (torch.rand(n, generator=gen) > 0.7).float() * -INF
    m[0, 1, ..., n - 9:] = -INF
    m[0, 3] = -INF
    m[0, 4, ..., 5] = -0.5
    m[0, 5, ..., n - 1] = float("nan")
    m[1, 2, ..., 1:3] = float("-inf")
    q = torch.zeros(2, 6, n, 1, 16, device=device)
    for mask in (m, m[:, :1], torch.full((1, 6, 1, 1, 1), -INF),
                 torch.zeros(2, 1, 1, 1, 1)):
        got = function._Inputs(q, q, q, mask.to(device), None).mask_range()
        torch.testing.assert_close(got.cpu(), _mask_range_reference(mask, n),
                                   rtol=0, atol=0)


def test_mask_ranges_only_where_they_pay(device, monkeypatch):
    """Below ``MASK_RANGE_MIN_LOGITS`` no ranges are computed (one launch less on
    host-bound calls) and the mask reaches every key block; from it they are."""
    case = Case(1, 3, 40, 2, 16, mask="tail")
    q, k, v, mask_bias, pair_bias, _ = make_inputs(case, device, seed=13)
    logits = 3 * 2 * 40 * 40
    for threshold, computed in ((logits + 1, False), (logits, True)):
        monkeypatch.setattr(function, "MASK_RANGE_MIN_LOGITS", threshold)
        inp = function._Inputs(q, k, v, mask_bias, pair_bias)
        assert inp.mask_ranges_pay() is computed
        *_, krange = function.evoflash_fwd(inp, 0.25, False)
        assert (krange is not None) is computed
    assert not function._Inputs(q, k, v, None, pair_bias).mask_ranges_pay()


def test_chunks(monkeypatch):
    """One chunk while the whole projection fits in ``CHUNK_BYTES``; past it, per
    b, equal runs of S slices that cover each slice once."""
    whole = (slice(None), slice(None))
    assert projected.chunks(2, 5, projected.CHUNK_BYTES // 10) == [whole]
    assert projected.chunks(0, 5, 30) == [] and projected.chunks(2, 0, 30) == []
    monkeypatch.setattr(projected, "CHUNK_BYTES", 100)
    assert projected.chunks(2, 5, 30) == [
        (slice(0, 1), slice(0, 3)), (slice(0, 1), slice(3, 5)),
        (slice(1, 2), slice(0, 3)), (slice(1, 2), slice(3, 5)),
    ]
    assert projected.chunks(1, 3, 200) == [(slice(0, 1), slice(s, s + 1))
                                           for s in range(3)]


PROJECTED_CHUNK_CASES = [
    Case(2, 5, 17, 2, 16, torch.bfloat16, projected=4),
    Case(1, 4, 16, 2, 24, bias="per_s", projected=3),
    Case(2, 3, 33, 1, 16, mask="tail", bias="batch1", projected=4),
]


@pytest.mark.parametrize("case", PROJECTED_CHUNK_CASES, ids=str)
def test_projected_in_chunks(case, device, monkeypatch):
    """In chunks of two S slices (the backward recomputes each chunk's projection
    and sums the weight, bias and pair-bias gradients over the chunks in fp32) the
    projected call passes the fp64 rule, and its output is the one-chunk call's
    (bit for bit under the interpreter's fixed configs; on a GPU a one-slice chunk
    has its own autotuning key, so a config whose key blocks sum in another order)."""
    _with_mask_ranges(case, monkeypatch)
    x, w, b, mask_bias, pair_bias, do = make_inputs(case, device, seed=14)
    projections = []
    project = projected._project
    monkeypatch.setattr(projected, "_project",
                        lambda *a: projections.append(1) or project(*a))
    one = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
    one.backward(do, retain_graph=True)
    assert len(projections) == 1  # one chunk: saved for the backward
    grads = [t.grad.clone() for t in (x, w, b, pair_bias)]
    for t in (x, w, b, pair_bias):
        t.grad = None
    one.backward(do)  # a second backward (retain_graph) uses it again
    assert len(projections) == 1
    for t, g in zip((x, w, b, pair_bias), grads, strict=True):
        assert torch.equal(t.grad, g)
    slice_bytes = case.N * case.projected * case.H * case.D * x.element_size()
    monkeypatch.setattr(projected, "CHUNK_BYTES", 2 * slice_bytes)
    chunks = len(projected.chunks(case.B, case.S, slice_bytes))
    assert chunks > 1
    projections.clear()
    many = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
    many.backward(do)
    assert len(projections) == 2 * chunks  # recomputed in the backward
    if configs.INTERPRET:  # fixed configs: the chunks run the one-chunk arithmetic
        assert torch.equal(many, one)
    else:  # a chunk of one slice is another S bucket, tuned apart (block sizes)
        torch.testing.assert_close(many, one, **fp32_tol(0, 0))
    check_case(case, device, seed=15)


def test_projected_projection_dropped_under_checkpointing(device, monkeypatch):
    """Under activation checkpointing (OF3 checkpoints its pairformer blocks) no
    projection outlives the forward: the one-chunk projection is saved through
    save_for_backward, which the checkpoint drops and recomputes. Without a
    checkpoint it is kept until the backward."""
    import weakref

    from torch.utils.checkpoint import checkpoint

    case = PROJECTED_CHUNK_CASES[0]
    x, w, b, mask_bias, pair_bias, do = make_inputs(case, device, seed=16)
    alive = []
    project = projected._project

    def tracked(*args):
        qkv = project(*args)
        alive.append(weakref.ref(qkv))
        return qkv

    monkeypatch.setattr(projected, "_project", tracked)

    def call(x):
        return evoflash_attention_projected(x, w, b, mask_bias, pair_bias)

    plain = call(x)
    assert [r() is not None for r in alive] == [True]
    plain.backward(do)
    grads = [t.grad.clone() for t in (x, w, b, pair_bias)]
    for t in (x, w, b, pair_bias):
        t.grad = None
    alive.clear()
    out = checkpoint(call, x, use_reentrant=False)
    assert len(alive) == 1 and alive[0]() is None
    out.backward(do)  # the recompute projects again
    assert len(alive) == 2
    assert torch.equal(out, plain)
    for t, g in zip((x, w, b, pair_bias), grads, strict=True):
        assert torch.equal(t.grad, g)


@pytest.mark.parametrize("wanted", ["x", "weights", "pair_bias"])
def test_projected_only_requested_gradients(wanted, device):
    """Only the requested gradients come back, each equal to the all-gradients
    call's (the pair bias's alone still runs the gate gradient on the side)."""
    case = Case(1, 3, 17, 2, 16, projected=4)
    x, w, b, mask_bias, pair_bias, do = make_inputs(case, device, seed=9)
    o = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
    full = dict(zip(("x", "w", "b", "pair_bias"),
                    torch.autograd.grad(o, (x, w, b, pair_bias), do), strict=True))
    leaves = {"x": ["x"], "weights": ["w", "b"], "pair_bias": ["pair_bias"]}[wanted]
    tensors = {"x": x, "w": w, "b": b, "pair_bias": pair_bias}
    args = {k: t if k in leaves else t.detach() for k, t in tensors.items()}
    o = evoflash_attention_projected(args["x"], args["w"], args["b"], mask_bias,
                                     args["pair_bias"])
    got = torch.autograd.grad(o, [args[k] for k in leaves], do)
    for name, g in zip(leaves, got, strict=True):
        assert torch.equal(g, full[name]), name


def test_projected_ignores_autocast(device):
    """Dots in x's dtype in the forward and the backward, whatever autocast says
    around either (autograd may run the backward under another autocast state than
    the forward's, as a training step whose backward sits inside its autocast)."""
    case = Case(1, 2, 16, 2, 16, projected=4)
    x, w, b, mask_bias, pair_bias, do = make_inputs(case, device, seed=17)
    leaves = (x, w, b, pair_bias)
    o = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
    want = torch.autograd.grad(o, leaves, do)
    device_type = torch.device(device).type
    for forward_on, backward_on in ((False, True), (True, False)):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=forward_on):
            got_o = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=backward_on):
            got = torch.autograd.grad(got_o, leaves, do)
        assert got_o.dtype == torch.float32 and torch.equal(got_o, o)
        for g, w_ in zip(got, want, strict=True):
            assert torch.equal(g, w_)


def test_projected_rejects_bad_shapes(device):
    x = torch.randn(1, 2, 8, 6, device=device)
    w = torch.randn(4, 2, 16, 6, device=device)
    with pytest.raises(ValueError, match="3 or 4"):
        evoflash_attention_projected(x, w[:2])
    with pytest.raises(ValueError, match="C"):
        evoflash_attention_projected(x, w[..., :5])
    with pytest.raises(ValueError, match="bias must be"):
        evoflash_attention_projected(x, w, torch.zeros(4, 2, 8, device=device))
    with pytest.raises(ValueError, match="dtype"):
        evoflash_attention_projected(x, w.double())


def test_one_slice_per_program(device, monkeypatch):
    """S_GROUP = 1 and unequal blocks (the interpreter default pairs slices)."""
    if not configs.INTERPRET:
        pytest.skip("sets the interpreter's fixed configs (the GPU autotunes)")
    cfgs = {name: {**c, "BLOCK_M": 32, "BLOCK_N": 16} for name, c in
            configs.INTERPRETER_CONFIGS.items()}
    for name in ("fwd", "dq", "dkdv"):
        cfgs[name]["S_GROUP"] = 1
    # The kernels took their fixed configs at import: give them these, and forget
    # the keys already launched.
    kernels = {"fwd": function._fwd, "dq": function._dq, "dkdv": function._dkdv,
               "dbias": function._dbias}
    for name, kernel in kernels.items():
        monkeypatch.setattr(kernel, "_fixed", cfgs[name])
        monkeypatch.setattr(kernel, "_chosen", {})
    check_case(Case(1, 3, 33, 1, 32), device, seed=2)
    for name in ("fwd", "dq", "dkdv"):
        launched = [meta for meta, _ in kernels[name]._chosen.values()]
        assert launched and all(
            m["S_GROUP"] == 1 and (m["BLOCK_M"], m["BLOCK_N"]) == (32, 16)
            for m in launched
        ), (name, launched)


def fp32_tol(atol: float, rtol: float) -> dict:
    """``assert_close`` tolerances for fp32 inputs without high precision: these
    under the interpreter's IEEE fp32 dots; on a GPU the kernels take TF32 dots
    (10-bit mantissa: ~5e-4 relative per product; the H200 showed gradient errors up
    to 4e-3 at these sizes), so 1e-2. A wrong answer in the tests that use this
    (weights not uniform, a gradient zeroed or missing a term) is off by O(0.1);
    precision itself is what the 2x-torch tests above check."""
    return dict(atol=atol, rtol=rtol) if configs.INTERPRET else dict(atol=1e-2,
                                                                     rtol=1e-2)


def test_fully_masked_slice_is_uniform(device):
    """OF3's -1e9 mask: a query with every key masked averages V, and the
    backward sends dS = P (dP - delta) through it as torch's softmax does."""
    case = Case(1, 2, 17, 2, 16)
    q, k, v, _, pair_bias, do = make_inputs(case, device, seed=3)
    mask_bias = torch.zeros(1, 2, 1, 1, 17, device=device)
    mask_bias[:, 1] = -INF
    o = evoflash_attention(q, k, v, mask_bias, pair_bias)
    torch.testing.assert_close(o[:, 1], v[:, 1].mean(dim=1, keepdim=True).expand_as(
        o[:, 1]), **fp32_tol(1e-5, 1e-5))
    dq = torch.autograd.grad(o, q, do)[0]
    o_ref = evoflash_attention_reference(q, k, v, mask_bias, pair_bias)
    dq_ref = torch.autograd.grad(o_ref, q, do)[0]
    assert dq[:, 1].abs().max() > 1e-3  # not silently zeroed
    torch.testing.assert_close(dq, dq_ref, **fp32_tol(1e-5, 1e-4))


def test_keys_masked_twice_weigh_nothing_beside_keys_masked_once(device):
    """A query with every key masked, some of them twice (OF3's -1e9 plus another
    -2e9, as sequence parallelism masks padding keys): uniform over the keys masked
    once, as OF3's fp32 softmax gives, forward and backward."""
    case = Case(1, 2, 17, 2, 16)
    q, k, v, _, pair_bias, do = make_inputs(case, device, seed=5)
    mask_bias = torch.zeros(1, 2, 1, 1, 17, device=device)
    mask_bias[:, 1] = -INF
    mask_bias[..., 12:] -= 2 * INF  # both slices: padding keys
    o = evoflash_attention(q, k, v, mask_bias, pair_bias)
    once = v[:, 1, :12].mean(dim=1, keepdim=True).expand_as(o[:, 1])
    torch.testing.assert_close(o[:, 1], once, **fp32_tol(1e-5, 1e-5))
    o_ref = evoflash_attention_reference(q, k, v, mask_bias, pair_bias)
    torch.testing.assert_close(o, o_ref, **fp32_tol(1e-5, 1e-5))
    grads = torch.autograd.grad(o, (q, k, v, pair_bias), do)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v, pair_bias), do)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, **fp32_tol(1e-5, 1e-4))


def test_minus_inf_mask_gives_uniform_weights(device):
    """An all -inf key mask: uniform weights (torch would give NaN), finite grads."""
    case = Case(1, 2, 17, 1, 16, mask="none")
    q, k, v, _, pair_bias, do = make_inputs(case, device, seed=8)
    mask_bias = torch.zeros(1, 2, 1, 1, 17, device=device)
    mask_bias[:, 1] = float("-inf")
    mask_bias[:, 0, ..., 3] = float("-inf")
    o = evoflash_attention(q, k, v, mask_bias, pair_bias)
    torch.testing.assert_close(o[:, 1], v[:, 1].mean(dim=1, keepdim=True).expand_as(
        o[:, 1]), **fp32_tol(1e-5, 1e-5))
    finite = mask_bias.clamp(min=-INF)
    torch.testing.assert_close(o, evoflash_attention_reference(q, k, v, finite,
                                                               pair_bias),
                               **fp32_tol(1e-5, 1.3e-6))  # assert_close's fp32
    grads = torch.autograd.grad(o, (q, k, v, pair_bias), do)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("wanted", ["q", "kv", "bias", "q_bias"])
def test_only_requested_gradients(wanted, device):
    case = Case(1, 3, 17, 2, 24)
    q, k, v, mask_bias, pair_bias, do = make_inputs(case, device, seed=4)
    leaves = {"q": [q], "kv": [k, v], "bias": [pair_bias], "q_bias": [q, pair_bias]}
    for t in (q, k, v, pair_bias):
        t.requires_grad_(any(t is x for x in leaves[wanted]))
    o = evoflash_attention(q, k, v, mask_bias, pair_bias)
    got = torch.autograd.grad(o, leaves[wanted], do)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves[wanted]]
    args = {id(t): t64 for t, t64 in zip(leaves[wanted], leaves64, strict=True)}
    full = [args.get(id(t), t.detach().double()) for t in (q, k, v, pair_bias)]
    o64 = evoflash_attention_reference(full[0], full[1], full[2], mask_bias, full[3])
    want = torch.autograd.grad(o64, leaves64, do.double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **fp32_tol(1e-4, 1e-4))


def test_mask_gets_no_gradient(device):
    case = Case(1, 1, 16, 1, 16)
    q, k, v, mask_bias, pair_bias, do = make_inputs(case, device, seed=5)
    mask_bias.requires_grad_()
    o = evoflash_attention(q, k, v, mask_bias, pair_bias)
    (o * do).sum().backward()
    assert mask_bias.grad is None and q.grad is not None


def test_backward_leaves_no_tensor_on_the_node(device):
    """After its backward the autograd node holds no input: nodes live until the
    whole graph is freed, so a tensor kept there stays alive through the rest of the
    model's backward (this once doubled a training step's peak memory)."""
    import weakref

    case = Case(1, 2, 16, 1, 16)
    q, k, v, mask_bias, pair_bias, do = make_inputs(case, device, seed=6)
    qh = q.detach().clone().requires_grad_()
    view = qh * 1.0  # a non-leaf input: only the graph can keep it alive
    o = evoflash_attention(view, k, v, mask_bias, pair_bias)
    node, ref = o.grad_fn, weakref.ref(view)
    del view
    (o * do).sum().backward()
    assert ref() is None and node is o.grad_fn


def test_rejects_bad_shapes(device):
    q = torch.randn(1, 2, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="shapes differ"):
        evoflash_attention(q, q[:, :1], q)
    with pytest.raises(ValueError, match=r"\[N, N\]"):
        evoflash_attention(q, q, q, pair_bias=torch.randn(1, 1, 2, 8, 4, device=device))


# --- GPU: tuned kernels at larger and call-site shapes -----------------------------

GPU_CASES = [
    Case(1, 4, 129, 4, 32, torch.bfloat16),
    Case(1, 48, 300, 4, 24, torch.bfloat16),
    Case(1, 4, 300, 2, 48, torch.float32),
    Case(1, 4, 129, 2, 64, torch.float16),
    Case(1, 48, 129, 2, 32, torch.float32, high_precision=True),
    Case(1, 4, 300, 2, 32, torch.bfloat16, bias="per_s"),
    Case(1, 4, 129, 4, 32, torch.bfloat16, mask="none", bias="permuted",
         bias_dtype=torch.float32),
    # call sites: triangle attention, diffusion transformer, trunk single attention
    Case(1, 256, 256, 4, 32, torch.bfloat16, bias="permuted"),
    Case(1, 48, 384, 16, 48, torch.bfloat16),
    Case(1, 1, 384, 16, 24, torch.bfloat16),
    Case(1, 1, 384, 16, 24, torch.float32, high_precision=True),
    Case(1, 48, 384, 16, 48, torch.bfloat16, high_precision=True),  # OF3's training
    # q/k/v[/gate] projected inside: the extension's path for 16-bit self-attention
    # (triangle attention: c 128)
    Case(1, 256, 256, 4, 32, torch.bfloat16, bias="permuted", projected=4,
         channels=128),
    Case(1, 4, 300, 2, 48, torch.bfloat16, projected=4),
    Case(1, 4, 129, 2, 64, torch.float16, projected=3),
    # crop padding: key blocks without masked keys skip the mask
    Case(1, 4, 300, 4, 32, torch.bfloat16, mask="tail"),
    Case(1, 48, 300, 16, 48, torch.bfloat16, mask="tail", projected=4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_matches_fp64_reference(case, device, monkeypatch):
    _with_mask_ranges(case, monkeypatch)
    check_case(case, device, seed=zlib.crc32(str(case).encode()))


@pytest.mark.gpu
@pytest.mark.parametrize("projected", [0, 4])
def test_gpu_atomic_dq_variant(device, projected):
    check_case(Case(1, 64, 256, 4, 32, torch.bfloat16, projected=projected), device,
               seed=6, deterministic=False)


@pytest.mark.gpu
def test_gpu_projected_in_chunks(device, monkeypatch):
    """Triangle attention at N=384 in three chunks of 128 rows."""
    case = Case(1, 384, 384, 4, 32, torch.bfloat16, mask="tail", bias="permuted",
                projected=4, channels=128)
    monkeypatch.setattr(projected, "CHUNK_BYTES", 128 * 384 * 4 * 128 * 2)
    check_case(case, device, seed=16)


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_reproducible(device):
    case = Case(1, 64, 256, 4, 32, torch.bfloat16)
    q, k, v, mask_bias, pair_bias, do = make_inputs(case, device, seed=7)
    runs = []
    for _ in range(2):
        o = evoflash_attention(q, k, v, mask_bias, pair_bias)
        runs.append(torch.autograd.grad(o, (q, k, v, pair_bias), do))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_shipped_table_keys_have_the_launches_form(device, monkeypatch):
    """Every launch of a 16-bit triangle-like and single-attention call has a tuning
    key whose dtype part (one dtype per tensor argument, in launch order) some
    shipped entry of that kernel has: a kernel that gains a tensor argument, or an
    output whose dtype changes, would otherwise silently miss the shipped table on
    the GPU and tune at first use."""
    import json

    from of3_megafold.kernels._launch import TunedKernel
    from of3_megafold.kernels.evoflash.tuned import tuned_path

    def dtypes(key):
        return tuple(str(k) for k in key if isinstance(k, (str, torch.dtype)))

    table = json.loads(tuned_path("NVIDIA H200").read_text())["kernels"]
    shipped = {name: {dtypes(e["key"]) for e in entries}
               for name, entries in table.items()}
    launched = set()
    launch = TunedKernel._launch

    def record(self, grid, kwargs):
        launched.add((self._jit.fn.__name__, dtypes(self._key(kwargs))))
        launch(self, grid, kwargs)

    monkeypatch.setattr(TunedKernel, "_launch", record)
    # OF3's call sites as its training steps tuned them: triangle attention (bf16),
    # the diffusion transformer at high precision (fp32 throughout) and the trunk's
    # single attention at high precision (q, k, v upcast; bf16 mask and bias); the
    # bias gradient's S chunks split (the interpreter's default) or not (the GPU's at
    # large shapes)
    sites = [("triangle", 3, torch.bfloat16), ("diffusion", 3, torch.float32),
             ("single", 1, torch.bfloat16)]
    for (site, S, dtype), unsplit in itertools.product(sites, (False, True)):
        q, k, v, mask_bias, pair_bias, do = make_inputs(
            Case(1, S, 16, 2, 32, dtype), device, seed=11)
        if site == "single":
            q, k, v, do = (t.detach().float().requires_grad_() for t in (q, k, v, do))
        with monkeypatch.context() as patch:
            if unsplit:
                patch.setattr(function, "_dbias_splits", lambda inp, dev: 1)
            o = evoflash_attention(q, k, v, mask_bias, pair_bias,
                                   high_precision=site != "triangle")
            o.backward(do)
            if site != "triangle":
                continue
            # the extension's projected, gated path, in one chunk and in several (an
            # fp32 bias gradient per chunk)
            x, w, b = (t.detach().requires_grad_() for t in (
                torch.randn(1, S, 16, 8, device=device, dtype=dtype),
                torch.randn(4, 2, 32, 8, device=device, dtype=dtype),
                torch.randn(4, 2, 32, device=device, dtype=dtype)))
            for chunk_bytes in (projected.CHUNK_BYTES, 1):
                patch.setattr(projected, "CHUNK_BYTES", chunk_bytes)
                o = evoflash_attention_projected(x, w, b, mask_bias, pair_bias)
                o.backward(do)
    tuned_launches = {(n, d) for n, d in launched if n in shipped}
    assert {n for n, _ in tuned_launches} == set(shipped)
    for name, key_dtypes in tuned_launches:
        assert key_dtypes in shipped[name], (name, key_dtypes)
