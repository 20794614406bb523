"""EvoFlash-3D: launchers, autograd function and functional API.

``O = softmax(scale * Q K^T + mask_bias + pair_bias) V`` over ``[B, S, N, H, D]``
inputs with a pair bias shared by the S slices (triangle attention, the diffusion
transformer, single attention), without materialising the ``[B, S, H, N, N]``
logits. See ``_fwd`` and ``_bwd`` for the kernels.
"""

from __future__ import annotations

import copy
import functools

import torch
import triton

from .._launch import TunedKernel
from ..backend import cdiv, multiprocessors, runs_on
from . import configs, tuned
from ._bwd import (
    _evoflash_bwd_dbias_kernel,
    _evoflash_bwd_dbias_sum_kernel,
    _evoflash_bwd_dkdv_kernel,
    _evoflash_bwd_dq_kernel,
    _evoflash_bwd_preprocess_kernel,
)
from ._fwd import _evoflash_fwd_kernel, _evoflash_mask_range_kernel

_HEURISTICS = {
    "EVEN_N": lambda a: a["N"] % a["BLOCK_M"] == 0 and a["N"] % a["BLOCK_N"] == 0,
    "PAD_D": lambda a: a["D"] != a["BLOCK_D"],
    "COL_MASK": lambda a: bool(a["HAS_MASK"]) or a["N"] % a["BLOCK_N"] != 0,
}
_KEY = ["N_BUCKET", "S_BUCKET", "H", "BLOCK_D", "HAS_MASK", "PRECISION"]
# Logits (B S H N^2) from which a masked call computes its key mask's ranges
# (_Inputs.mask_range), so that the forward, dQ and bias-gradient kernels skip the
# mask in the key blocks it leaves zero. Below, the call is bound by the host, and
# one more launch there buys little: on the H200 the skip took the
# kernels of triangle N=1024 from 14.24 to 13.50 ms, but those of N=384 (2.3e8
# logits) only from 0.89 to 0.84 ms, while that call's wall time is about 1.2 ms of
# host work. Triangle attention from N=512 and the diffusion transformer's S=48
# N=768 are above it.
MASK_RANGE_MIN_LOGITS = 2**28


def _tunable(kernel, name: str, tuned_configs, key, reset_to_zero=None,
             restore_value=None) -> TunedKernel:
    """The kernel with its heuristics, autotuned over ``tuned_configs`` on ``key``
    (under the interpreter: the fixed ``configs.INTERPRETER_CONFIGS[name]``),
    launched through :class:`TunedKernel` with the shipped choices for this GPU
    (:mod:`.tuned`). ``reset_to_zero``/``restore_value``: arguments the autotuner
    zeroes or restores between its timed runs."""
    presets = functools.partial(tuned.tuned_configs, kernel.fn.__name__)
    kernel = triton.heuristics(_HEURISTICS)(kernel)
    if configs.INTERPRET:
        return TunedKernel(kernel, fixed=configs.INTERPRETER_CONFIGS[name])
    options = {
        "configs": tuned_configs,
        "key": key,
        "prune_configs_by": {"early_config_prune": configs.prune_configs},
        "reset_to_zero": reset_to_zero,
        "restore_value": restore_value,
    }
    try:
        autotuned = triton.autotune(cache_results=True, **options)(kernel)
    except TypeError:  # a Triton without the on-disk autotuning cache
        autotuned = triton.autotune(**options)(kernel)
    return TunedKernel(autotuned, presets=presets)


_fwd = _tunable(_evoflash_fwd_kernel, "fwd",
                configs.FWD_CONFIGS + configs.FWD_CONFIGS_FP32,
                _KEY + ["HAS_BIAS", "BIAS_PER_S"])
# In a gated backward dO lives in dQ's slot of the packed gradient (evoflash_bwd):
# the autotuner's timed runs overwrite it, so it restores dO after each.
_dq = _tunable(_evoflash_bwd_dq_kernel, "dq",
               configs.DQ_CONFIGS + configs.DQ_CONFIGS_FP32,
               _KEY + ["HAS_BIAS", "BIAS_PER_S", "COMPUTE_DQ", "STORE_DS"],
               restore_value=["DO"])
_dkdv = _tunable(_evoflash_bwd_dkdv_kernel, "dkdv",
                 configs.DKDV_CONFIGS + configs.DKDV_CONFIGS_FP32,
                 _KEY + ["HAS_BIAS", "BIAS_PER_S"])
_dbias = _tunable(_evoflash_bwd_dbias_kernel, "dbias",
                  configs.DBIAS_CONFIGS + configs.DBIAS_CONFIGS_FP32,
                  _KEY + ["FUSE_DQ"], reset_to_zero=["DQ_ACC"])
_preprocess = TunedKernel(_evoflash_bwd_preprocess_kernel)
_dbias_sum = TunedKernel(_evoflash_bwd_dbias_sum_kernel, options={"num_warps": 4})
_mask_range = TunedKernel(_evoflash_mask_range_kernel, options={"num_warps": 4})


def _precision(high_precision: bool) -> int:
    """The kernels' PRECISION: 0 dots in the input dtype; 1 fp32 tiles, tf32 dots;
    2 fp32 tiles, 3xTF32 dots. High precision follows torch's float32 matmul
    precision, as OF3's fp32 einsum does: fp32 accuracy at "highest" (torch's
    default, and OF3's in training unless ``--use_tf32``), tf32 at "high"/"medium"
    (what ``run_openfold predict`` sets). fp32 accuracy comes from 3xTF32
    tensor-core dots, not ieee CUDA-core dots: on the H200 both met the same fp32
    tolerance and 3xTF32 was 4.6x faster (docs/benchmarks.md). The interpreter
    computes every dot in ieee fp32."""
    if not high_precision:
        return 0
    return 2 if torch.get_float32_matmul_precision() == "highest" else 1


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(b, s, n, h) strides of a ``[B, S, N, H, D]`` tensor."""
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _as_5d(t: torch.Tensor) -> torch.Tensor:
    return t[(None,) * (5 - t.dim())] if t.dim() < 5 else t


class _Inputs:
    """Shape checks and the strided views the kernels read."""

    def __init__(self, q, k, v, mask_bias, pair_bias):
        if q.dim() != 5:
            raise ValueError(f"q must be [B, S, N, H, D], got shape {tuple(q.shape)}")
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(
                f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {q.dtype}")
        self.B, self.S, self.N, self.H, self.D = q.shape
        if self.D > 128:
            raise ValueError(f"head dim {self.D} > 128 is not supported")
        self.q, self.k, self.v = (t if t.stride(-1) == 1 else t.contiguous()
                                  for t in (q, k, v))
        B, S, N, H = self.B, self.S, self.N, self.H
        self.mask = None
        self.mask_strides = (0, 0, 0)
        if mask_bias is not None:
            m = _as_5d(mask_bias)
            if m.shape[2:4] != (1, 1):
                raise ValueError(
                    f"mask_bias must broadcast to [B, S, 1, 1, N], got "
                    f"{tuple(mask_bias.shape)}"
                )
            # Read by the kernels in place, in its dtype (they pin OF3's -1e9 and
            # -inf, see _tiles._load_key_mask); broadcast dims get stride 0.
            self.mask = m
            m = m[:, :, 0, 0, :].expand(B, S, N)
            self.mask_strides = (m.stride(0), m.stride(1), m.stride(2))
        self.bias = None
        self.bias_shape = None
        self.bias_strides = (0, 0, 0, 0)
        self.bias_per_s = False
        if pair_bias is not None:
            self.bias_shape = pair_bias.shape
            pb = _as_5d(pair_bias)
            if pb.shape[-2:] != (N, N):
                raise ValueError(
                    f"pair_bias must end in [N, N] = [{N}, {N}], got "
                    f"{tuple(pair_bias.shape)}"
                )
            if pb.stride(-1) != 1:
                # One copy of the (small, N^2 H) bias so the kernels read it
                # coalesced; OF3's bias is a permuted view of a [*, N, N, H] linear.
                pb = pb.contiguous()
            self.bias = pb
            pbe = pb.expand(B, S, H, N, N)
            self.bias_strides = (pbe.stride(0), pbe.stride(1), pbe.stride(2),
                                 pbe.stride(3))
            self.bias_per_s = S > 1 and pbe.stride(1) != 0

    def tensors(self) -> tuple:
        """``(q, k, v, mask, bias)`` as the kernels read them (mask, bias: None
        when absent)."""
        return self.q, self.k, self.v, self.mask, self.bias

    def with_tensors(self, q, k, v, mask, bias) -> _Inputs:
        """A copy with these checked shapes, strides and flags and other tensors:
        ``None`` for the autograd node (the tensors go through save_for_backward),
        the saved ones in the backward."""
        inp = copy.copy(self)
        inp.q, inp.k, inp.v, inp.mask, inp.bias = q, k, v, mask, bias
        return inp

    def common_args(self, high_precision: bool) -> dict:
        return dict(
            stride_mb=self.mask_strides[0], stride_ms=self.mask_strides[1],
            stride_mn=self.mask_strides[2],
            S=self.S, N=self.N, H=self.H, D=self.D,
            N_BUCKET=configs.n_bucket(self.N), S_BUCKET=configs.s_bucket(self.S),
            HAS_MASK=self.mask is not None,
            PRECISION=_precision(high_precision),
            BLOCK_D=configs.d_block(self.D),
        )

    def mask_range(self) -> torch.Tensor:
        """int32 ``[BM, SM, 2]`` over the key mask's own (unbroadcast) B and S: per
        slice, the keys ``[lo, hi)`` that hold its nonzero values (one launch of
        ``_evoflash_mask_range_kernel``; needs a mask). The kernels add the mask
        only to the key blocks that overlap that range."""
        m = self.mask[:, :, 0, 0, :].expand(-1, -1, self.N)
        bm, sm = m.shape[:2]
        out = torch.empty((bm, sm, 2), dtype=torch.int32, device=m.device)
        _mask_range[(bm * sm,)](m, out, self.N, sm, *m.stride(),
                                BLOCK=min(1024, triton.next_power_of_2(self.N)))
        return out

    def mask_ranges_pay(self) -> bool:
        """Whether this call computes its mask ranges: a mask, and at least
        :data:`MASK_RANGE_MIN_LOGITS` logits."""
        return (self.mask is not None
                and self.B * self.S * self.H * self.N * self.N >= MASK_RANGE_MIN_LOGITS)

    def mask_range_args(self, krange: torch.Tensor | None,
                        placeholder: torch.Tensor) -> dict:
        """The kernels' ``KRANGE``, its (b, s) strides (0 where the mask is
        broadcast) and ``MASK_RANGES``; without ranges ``placeholder``, an int32
        tensor (a mask then goes to every key block)."""
        if krange is None:
            return dict(KRANGE=placeholder, stride_rb=0, stride_rs=0,
                        MASK_RANGES=False)
        return dict(KRANGE=krange,
                    stride_rb=krange.stride(0) if krange.shape[0] > 1 else 0,
                    stride_rs=krange.stride(1) if krange.shape[1] > 1 else 0,
                    MASK_RANGES=True)

    def bias_args(self) -> dict:
        sb, ss, sh, si = self.bias_strides
        return dict(stride_bb=sb, stride_bs=ss, stride_bh=sh, stride_bi=si,
                    HAS_BIAS=self.bias is not None, BIAS_PER_S=self.bias_per_s)


def _gate_strides(gate: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(b, s, n, h) strides of the gate; zeros without one."""
    return _strides(gate) if gate is not None else (0, 0, 0, 0)


def evoflash_fwd(inp: _Inputs, scale: float, high_precision: bool,
                 gate: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """Launch the forward kernel. Returns ``(o, lse, r, flags, krange)``: the
    output in the input layout and dtype (times ``sigmoid(gate)`` with a
    ``[B, S, N, H, D]`` gate; written into ``out``, a view of that shape and dtype
    with a unit last stride, when given), the two fp32 ``[B, S, H, N]`` row
    statistics, the backward's int32 ``[B, S]`` fully-masked-query flags, zeroed
    here, and the key mask's ranges (:meth:`_Inputs.mask_range`; None without a mask
    or where they do not pay, :meth:`_Inputs.mask_ranges_pay`)."""
    B, S, N, H, D = inp.B, inp.S, inp.N, inp.H, inp.D
    q = inp.q
    o = (out if out is not None else
         torch.empty((B, S, N, H, D), dtype=q.dtype, device=q.device))
    lse = torch.empty((B, S, H, N), dtype=torch.float32, device=q.device)
    r = torch.empty_like(lse)
    flags = torch.empty((B, S), dtype=torch.int32, device=q.device)
    krange = inp.mask_range() if inp.mask_ranges_pay() else None

    def grid(meta):
        return (cdiv(N, meta["BLOCK_M"]) * cdiv(S, meta["S_GROUP"])
                * H * B,)

    (sqb, sqs, sqn, sqh), (skb, sks, skn, skh) = _strides(q), _strides(inp.k)
    (svb, svs, svn, svh), (sob, sos, son, soh) = _strides(inp.v), _strides(o)
    sgtb, sgts, sgtn, sgth = _gate_strides(gate)
    _fwd[grid](
        Q=q, K=inp.k, V=inp.v,
        MASK=inp.mask if inp.mask is not None else q,
        BIAS=inp.bias if inp.bias is not None else q,
        OUT=o, LSE=lse, RSCALE=r, RFLAG=flags,
        GATE=gate if gate is not None else q,
        sm_scale=scale,
        stride_qb=sqb, stride_qs=sqs, stride_qn=sqn, stride_qh=sqh,
        stride_kb=skb, stride_ks=sks, stride_kn=skn, stride_kh=skh,
        stride_vb=svb, stride_vs=svs, stride_vn=svn, stride_vh=svh,
        stride_ob=sob, stride_os=sos, stride_on=son, stride_oh=soh,
        stride_gtb=sgtb, stride_gts=sgts, stride_gtn=sgtn, stride_gth=sgth,
        GATED=gate is not None,
        **inp.common_args(high_precision), **inp.bias_args(),
        **inp.mask_range_args(krange, flags),  # last tensor: see evoflash_bwd
    )
    return o, lse, r, flags, krange


def _dbias_splits(inp: _Inputs, device: torch.device) -> int:
    """S chunks for the dbias kernel: enough programs for two waves of 128 x 128
    tiles, at least 16 S slices per chunk (summed afterwards, in a fixed order)."""
    # the interpreter: 2 "SMs", to exercise the split path at small sizes
    sms = multiprocessors(device.index) if device.type == "cuda" else 2
    tiles = inp.B * inp.H * cdiv(inp.N, 128) ** 2
    wanted = cdiv(2 * sms, tiles)
    return max(1, min(wanted, inp.S // 16 if device.type == "cuda" else inp.S))


def _broadcast_dims(shape: torch.Size, full: tuple[int, ...]) -> list[int]:
    """The dims of the 5-d ``full`` over which an input of ``shape`` was
    broadcast (its gradient is summed over them)."""
    target = (1,) * (5 - len(shape)) + tuple(shape)
    return [i for i in range(5) if target[i] == 1 and full[i] != 1]


def _finish_dbias(grad: torch.Tensor, inp: _Inputs, dtype: torch.dtype) -> torch.Tensor:
    """A ``[B, S|1, H, N, N]`` bias gradient in the pair bias's shape, in ``dtype``."""
    dims = _broadcast_dims(inp.bias_shape, tuple(grad.shape))
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(inp.bias_shape).to(dtype)


def evoflash_bwd(
    inp: _Inputs, do: torch.Tensor, o, lse, r, flags, krange, scale: float,
    high_precision: bool,
    deterministic: bool, need_dq: bool, need_dkdv: bool, need_dbias: bool,
    gate: torch.Tensor | None = None, grads: tuple | None = None,
    dbias_dtype: torch.dtype | None = None,
):
    """Launch the backward kernels. Returns ``(dq, dk, dv, dbias)``, None where not
    needed; ``dbias`` has the pair bias's shape, and its dtype or ``dbias_dtype``
    (fp32 for a caller that sums the gradients of several calls).

    With the forward's ``gate``, ``o`` and ``do`` are the gated output and its
    gradient. ``grads``: ``(dq, dk, dv[, dgate])`` ``[B, S, N, H, D]`` views with one
    set of strides (slices of one packed gradient) to write into instead of new
    tensors; required with a gate (the gate gradient is written there)."""
    B, S, N, H, D = inp.B, inp.S, inp.N, inp.H, inp.D
    q = inp.q
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse)
    sob, sos, son, soh = _strides(o)
    sdb, sds, sdn, sdh = _strides(do)
    block_d = configs.d_block(D)
    pre_block = 64 if block_d <= 64 else 32
    gated = gate is not None
    do_in = do
    if gated:
        if grads is None or len(grads) != 4 or grads[3].stride() != gate.stride():
            raise ValueError("a gated backward writes the gate gradient into "
                             "grads[3], which must have the gate's strides")
        # the attention's dO = dO' sigmoid(gate), in dQ's slot until the dQ kernel
        # (the last to read dO) overwrites it row block by row block
        do = grads[0]
    # flags: S slices holding a query whose keys are all masked (r = 1/l there)
    _preprocess[(cdiv(N, pre_block), B * S * H)](
        o, do_in, r, delta, flags,
        gate if gated else o, grads[3] if gated else o, do,
        sob, sos, son, soh, sdb, sds, sdn, sdh,
        *_gate_strides(gate),
        S, N, H, D, GATED=gated, BLOCK_M=pre_block, BLOCK_D=block_d,
    )
    if gated:
        sdb, sds, sdn, sdh = _strides(do)

    # dq, dk, dv: contiguous [B, S, N, H, D], or the given views (one set of
    # strides); the fp32 dQ accumulator of the atomic variant is contiguous
    contiguous_g = (S * N * H * D, N * H * D, H * D, D)
    if grads is not None:
        if len({t.stride() for t in grads}) != 1:
            raise ValueError("the gradient views must share their strides")
        sgb, sgs, sgn, sgh = _strides(grads[0])
    else:
        sgb, sgs, sgn, sgh = contiguous_g
    unused = torch.empty(1, dtype=torch.float32, device=q.device)
    (sqb, sqs, sqn, sqh), (skb, sks, skn, skh) = _strides(q), _strides(inp.k)
    svb, svs, svn, svh = _strides(inp.v)
    args = dict(
        Q=q, K=inp.k, V=inp.v, DO=do,
        MASK=inp.mask if inp.mask is not None else q,
        LSE=lse, RSCALE=r, DELTA=delta,
        sm_scale=scale,
        stride_qb=sqb, stride_qs=sqs, stride_qn=sqn, stride_qh=sqh,
        stride_kb=skb, stride_ks=sks, stride_kn=skn, stride_kh=skh,
        stride_vb=svb, stride_vs=svs, stride_vn=svn, stride_vh=svh,
        stride_dob=sdb, stride_dos=sds, stride_don=sdn, stride_doh=sdh,
        stride_gb=sgb, stride_gs=sgs, stride_gn=sgn, stride_gh=sgh,
        **inp.common_args(high_precision),
    )
    # the last tensor of the dQ and bias-gradient launches: the tuning key lists the
    # tensors' dtypes in the call's order, and the shipped table's keys had it
    # appended. The dK/dV kernel adds its key block's mask, loaded once, to every
    # tile (skipping it where it is zero saved no time on the H200).
    range_args = inp.mask_range_args(krange, flags)
    bias = inp.bias if inp.bias is not None else q
    dq = dk = dv = dbias = None

    if need_dkdv:
        if grads is not None:
            dk, dv = grads[1], grads[2]
        else:
            dk = torch.empty((B, S, N, H, D), dtype=q.dtype, device=q.device)
            dv = torch.empty_like(dk)
        bias_args = inp.bias_args()
        bias_t = bias
        if inp.bias is not None:
            # A transposed copy (N^2 H elements, once) so the dK/dV kernel reads
            # its [keys, queries] bias tiles coalesced, without an smem transpose.
            bias_t = inp.bias.transpose(-1, -2).contiguous()
            bte = bias_t.expand(B, S, H, N, N)
            bias_args.update(stride_bb=bte.stride(0), stride_bs=bte.stride(1),
                             stride_bh=bte.stride(2), stride_bi=bte.stride(3))

        def grid_dkdv(meta):
            return (cdiv(N, meta["BLOCK_N"]) * cdiv(S, meta["S_GROUP"])
                    * H * B,)

        _dkdv[grid_dkdv](DK=dk, DV=dv, BIAS_T=bias_t, RFLAG=flags, **args,
                         **bias_args)

    need_dbias = need_dbias and inp.bias is not None
    reduce_over_s = need_dbias and S > 1 and not inp.bias_per_s
    fuse_dq = need_dq and reduce_over_s and not deterministic
    # The bias gradient goes straight into a tensor of the bias's dtype unless the
    # bias was broadcast over B or H too (then fp32, summed over those at the end).
    bias_s = S if inp.bias_per_s else 1
    direct = need_dbias and not _broadcast_dims(inp.bias_shape, (B, bias_s, H, N, N))
    out_dtype = dbias_dtype or (inp.bias.dtype if need_dbias else None)
    written_dtype = out_dtype if direct else torch.float32
    if reduce_over_s:
        splits = _dbias_splits(inp, q.device)
        s_chunk = cdiv(S, splits)
        splits = cdiv(S, s_chunk)
        dbias = torch.empty((B, 1, H, N, N), dtype=written_dtype, device=q.device)
        part = (dbias.view(1, B, H, N, N) if splits == 1 else
                torch.empty((splits, B, H, N, N), dtype=torch.float32, device=q.device))
        dq_acc = (torch.zeros((B, S, N, H, D), dtype=torch.float32, device=q.device)
                  if fuse_dq else unused)
        sb, _, sh, si = inp.bias_strides

        def grid_dbias(meta):
            return (cdiv(N, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
                    * H * B * splits,)

        dbias_args = dict(args)
        if fuse_dq:
            for name, stride in zip(("stride_gb", "stride_gs", "stride_gn",
                                     "stride_gh"), contiguous_g, strict=True):
                dbias_args[name] = stride
        _dbias[grid_dbias](
            BIAS=bias, **dbias_args,
            DQ_ACC=dq_acc, DBIAS_PART=part,
            stride_bb=sb, stride_bh=sh, stride_bi=si,
            stride_dbp=part.stride(0), stride_dbb=part.stride(1),
            stride_dbh=part.stride(2), stride_dbi=part.stride(3),
            B=B, S_CHUNK=s_chunk, FUSE_DQ=fuse_dq, **range_args,
        )
        if splits > 1:
            block = 1024
            _dbias_sum[(cdiv(dbias.numel(), block),)](
                part, dbias, splits, dbias.numel(), BLOCK=block)
        if fuse_dq:
            dq = grads[0].copy_(dq_acc) if grads is not None else dq_acc.to(q.dtype)

    store_ds = need_dbias and not reduce_over_s
    if (need_dq and not fuse_dq) or store_ds:
        if need_dq and not fuse_dq:
            dq = (grads[0] if grads is not None else
                  torch.empty((B, S, N, H, D), dtype=q.dtype, device=q.device))
        if store_ds:
            dbias = torch.empty((B, bias_s, H, N, N), dtype=written_dtype,
                                device=q.device)
            db_strides = dbias.stride()[:4]
        else:
            db_strides = (0, 0, 0, 0)

        def grid_dq(meta):
            return (cdiv(N, meta["BLOCK_M"]) * cdiv(S, meta["S_GROUP"])
                    * H * B,)

        _dq[grid_dq](
            BIAS=bias, **args, **inp.bias_args(),
            DQ=dq if dq is not None else unused,
            DBIAS=dbias if store_ds else unused,
            stride_dbb=db_strides[0], stride_dbs=db_strides[1],
            stride_dbh=db_strides[2], stride_dbi=db_strides[3],
            COMPUTE_DQ=need_dq and not fuse_dq, STORE_DS=store_ds, **range_args,
        )

    if dbias is not None:
        dbias = (dbias.view(inp.bias_shape) if direct
                 else _finish_dbias(dbias, inp, out_dtype))
    return dq, dk, dv, dbias


def _forward(ctx, inp: _Inputs, scale, high_precision: bool, deterministic: bool):
    """The autograd function's forward: keeps on ``ctx`` what its backward needs
    besides the saved tensors and runs the kernel. Returns ``(o, (lse, r,
    flags, krange))``, or ``(an empty o, None)`` for an empty input (``ctx.empty``).

    The backward reuses the checked views' strides and flags; the tensors travel
    through save_for_backward (in-place modification checks, and freed after the
    backward: the node itself lives until the graph does)."""
    ctx.empty = inp.q.numel() == 0
    ctx.bias_shape = inp.bias_shape
    ctx.inp = inp.with_tensors(None, None, None, None, None)
    ctx.scale = scale if scale is not None else inp.D ** -0.5
    ctx.high_precision = high_precision
    ctx.deterministic = deterministic
    if ctx.empty:
        return torch.empty(inp.q.shape, dtype=inp.q.dtype, device=inp.q.device), None
    o, *stats = evoflash_fwd(inp, ctx.scale, high_precision)
    return o, stats


def _require_device(t: torch.Tensor, name: str) -> None:
    if not runs_on(t):
        raise RuntimeError(
            f"{name} needs a CUDA tensor (or TRITON_INTERPRET=1); use "
            "evoflash_attention_reference on CPU"
        )


class EvoFlashAttentionFunction(torch.autograd.Function):
    """Autograd function behind :func:`evoflash_attention` (same arguments).

    Saves Q, K, V, O, two fp32 statistics per query row, a flag per S slice
    (a fully masked query there: the backward's preprocess sets it) and the key
    mask's nonzero range per slice; the probabilities are recomputed in backward.
    The mask bias gets no gradient (it is a mask).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask_bias, pair_bias, scale, high_precision,
                deterministic):
        inp = _Inputs(q, k, v, mask_bias, pair_bias)
        o, stats = _forward(ctx, inp, scale, high_precision, deterministic)
        if stats is not None:
            ctx.save_for_backward(*inp.tensors(), o, *stats)
        return o

    @staticmethod
    def backward(ctx, do):
        if ctx.empty:
            grads = [torch.zeros_like(do) if need else None
                     for need in ctx.needs_input_grad[:3]]
            bias_grad = (torch.zeros(ctx.bias_shape, dtype=do.dtype, device=do.device)
                         if ctx.needs_input_grad[4] else None)
            return (*grads, None, bias_grad, None, None, None)
        *tensors, o, lse, r, flags, krange = ctx.saved_tensors
        need_dq, need_dk, need_dv, _, need_dbias = ctx.needs_input_grad[:5]
        dq, dk, dv, dbias = evoflash_bwd(
            ctx.inp.with_tensors(*tensors), do, o, lse, r, flags, krange, ctx.scale,
            ctx.high_precision, ctx.deterministic, need_dq, need_dk or need_dv,
            need_dbias,
        )
        return (dq, dk if need_dk else None, dv if need_dv else None, None, dbias,
                None, None, None)


def evoflash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_bias: torch.Tensor | None = None,
    pair_bias: torch.Tensor | None = None,
    scale: float | None = None,
    high_precision: bool = False,
    deterministic: bool = True,
) -> torch.Tensor:
    """Fused ``O = softmax(scale * Q K^T + mask_bias + pair_bias) V``.

    Args:
        q, k, v: ``[B, S, N, H, D]`` (OF3's layout after the q/k/v projections),
            same dtype (fp32, bf16, fp16), any strides with a unit last stride;
            D up to 128 (tuned for 8..64).
        mask_bias: optional additive mask broadcastable to ``[B, S, 1, 1, N]``
            (OF3: ``1e9 * (mask - 1)``). Values below -2^29 act as -2^30, which
            swallows the logits as OF3's fp32 -1e9 does: a query whose keys are all
            masked gets uniform weights, as in OF3. Values below -2^31 (a second
            -1e9 or more on top, or -inf) act as -2^32: beside a -2^30 key they
            weigh nothing, as in OF3's fp32 softmax, and a query whose keys are all
            that low gets uniform weights over them (torch gives NaN for -inf).
            Not differentiated (its gradient is None).
        pair_bias: optional bias broadcastable to ``[B, S, H, N, N]``, typically
            ``[B, 1, H, N, N]``; its gradient is reduced over what it broadcasts.
        scale: logit scale, default ``D ** -0.5``.
        high_precision: OF3's ``use_high_precision``: every tile upcast to fp32,
            dots at torch's float32 matmul precision like OF3's fp32 einsum: fp32
            accuracy at ``"highest"`` (torch's default, OF3's in training; 3xTF32
            tensor-core dots), tf32 at ``"high"`` (``run_openfold predict``, or
            training with ``--use_tf32``). Otherwise dots
            run in the input dtype (tf32 for fp32 inputs). Softmax statistics and
            accumulation are fp32 either way.
        deterministic: the default computes every gradient with a fixed summation
            order; False fuses dQ into the bias-gradient pass with fp32 atomics
            (one pass less, not bit-reproducible).

    Returns:
        ``[B, S, N, H, D]`` in the input dtype.

    Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``; anywhere else it raises
    (use :func:`evoflash_attention_reference`).
    """
    _require_device(q, "evoflash_attention")
    return EvoFlashAttentionFunction.apply(
        q, k, v, mask_bias, pair_bias, scale, high_precision, deterministic
    )
