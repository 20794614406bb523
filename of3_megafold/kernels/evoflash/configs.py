"""Launch configurations of the EvoFlash kernels.

Tuned for the H200 (sm_90, 132 SMs, 60 MB L2) at OF3's shapes: triangle attention
``[1, N, N, 4, 32]`` (N 256..2048), diffusion ``[1, 48, N, 16, 48]`` and trunk single
attention ``[1, 1, N, 16, 24]``. The lists are short on purpose (compile time): a
few tile shapes around 64/128, 4 or 8 warps, 2 or 3 stages, with and without
pairing two S slices per program (``S_GROUP``, which halves the pair-bias traffic).
The last entries of the bf16 lists (4 warps, 3 stages, small tiles) are the winners
of a wider sweep on the H200 (``python -m tools.gpu_check_evoflash --wide``,
docs/benchmarks.md): at triangle N=1024 and diffusion S=48 N=768 they beat every
earlier entry, by up to a third (the dbias kernel at N=1024).

The autotuning key is (head-dim block, heads, dtypes, bucketed N, bucketed S, flags),
so a training run tunes once per crop-size bucket, not once per crop size; with
``cache_results`` the choice is also kept on disk across runs, and the choices
measured on a GPU model ship with the kit (``tuned/``: no tuning there for the keys
they list). Under the Triton interpreter nothing is tuned: one small fixed
configuration runs.
"""

from __future__ import annotations

import hashlib

import triton

from ..backend import interpreter_enabled, next_power_of_2

INTERPRET = interpreter_enabled()


def _cfg(block_m: int, block_n: int, s_group: int | None, warps: int, stages: int):
    kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if s_group is not None:
        kwargs["S_GROUP"] = s_group
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


# Forward and dQ: BLOCK_M query rows owned, BLOCK_N keys per step.
FWD_CONFIGS = [
    _cfg(128, 64, 2, 8, 2),
    _cfg(128, 64, 1, 4, 3),
    _cfg(64, 64, 2, 4, 2),
    _cfg(128, 128, 1, 8, 2),
    _cfg(64, 128, 2, 4, 2),
    _cfg(64, 64, 1, 4, 3),
    _cfg(128, 32, 1, 4, 3),
    _cfg(64, 64, 2, 4, 3),
]
DQ_CONFIGS = [
    _cfg(128, 64, 2, 8, 2),
    _cfg(128, 64, 1, 8, 2),
    _cfg(64, 64, 2, 4, 2),
    _cfg(64, 128, 1, 4, 2),
    _cfg(64, 32, 1, 4, 3),
    _cfg(64, 32, 2, 4, 3),
    _cfg(128, 32, 1, 4, 3),
]
# dK/dV: BLOCK_N keys owned, BLOCK_M query rows per step.
DKDV_CONFIGS = [
    _cfg(64, 128, 1, 8, 2),
    _cfg(64, 128, 2, 8, 2),
    _cfg(64, 64, 2, 4, 2),
    _cfg(128, 64, 1, 8, 2),
    _cfg(32, 64, 1, 4, 3),
    _cfg(64, 64, 1, 4, 3),
]
# fp32 tiles (fp32 inputs or high precision) hold twice the registers: smaller.
FWD_CONFIGS_FP32 = [
    _cfg(64, 64, 1, 4, 2),
    _cfg(64, 32, 1, 4, 2),
    _cfg(128, 32, 1, 8, 2),
]
DQ_CONFIGS_FP32 = [
    _cfg(64, 64, 1, 4, 2),
    _cfg(64, 32, 1, 4, 2),
    _cfg(128, 32, 1, 8, 2),
]
DKDV_CONFIGS_FP32 = [
    _cfg(32, 64, 1, 4, 2),
    _cfg(32, 128, 1, 8, 2),
]
# dbias: a BLOCK_M x BLOCK_N tile of the bias gradient owned, S walked.
DBIAS_CONFIGS = [
    _cfg(64, 64, None, 4, 2),
    _cfg(128, 64, None, 8, 2),
    _cfg(64, 128, None, 8, 2),
    _cfg(64, 64, None, 4, 3),
]
DBIAS_CONFIGS_FP32 = [
    _cfg(64, 32, None, 4, 2),
    _cfg(32, 64, None, 4, 2),
    _cfg(64, 64, None, 8, 2),
]

# Under the interpreter: small blocks so that N = 17, 33 cross block boundaries,
# and S_GROUP = 2 so the paired-slice path (and its S tail) is what CI checks.
INTERPRETER_CONFIGS = {
    "fwd": {"BLOCK_M": 16, "BLOCK_N": 16, "S_GROUP": 2},
    "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "S_GROUP": 2},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16, "S_GROUP": 2},
    "dbias": {"BLOCK_M": 16, "BLOCK_N": 16},
}


def d_block(d: int) -> int:
    """``BLOCK_D`` of head dim ``d``: the next power of two, at least 16 (the depth
    of a 16-bit tensor-core dot); smaller head dims are zero padded."""
    return max(16, next_power_of_2(d))


def n_bucket(n: int) -> int:
    """Sequence-length bucket of the autotuning key: the next power of two."""
    return next_power_of_2(max(n, 16))


def s_bucket(s: int) -> int:
    """S bucket of the autotuning key: 1, a few (<= 16), tens (<= 64), many."""
    if s == 1:
        return 1
    if s <= 16:
        return 16
    if s <= 64:
        return 64
    return 256


def _block_area(cfg) -> int:
    return cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"]


FP32_CONFIGS = {id(c) for c in (FWD_CONFIGS_FP32 + DQ_CONFIGS_FP32
                                 + DKDV_CONFIGS_FP32 + DBIAS_CONFIGS_FP32)}

# Every kernel's candidates, both precisions, by the kernel's name.
CANDIDATES = {
    "_evoflash_fwd_kernel": FWD_CONFIGS + FWD_CONFIGS_FP32,
    "_evoflash_bwd_dq_kernel": DQ_CONFIGS + DQ_CONFIGS_FP32,
    "_evoflash_bwd_dkdv_kernel": DKDV_CONFIGS + DKDV_CONFIGS_FP32,
    "_evoflash_bwd_dbias_kernel": DBIAS_CONFIGS + DBIAS_CONFIGS_FP32,
}


def lists_fingerprint(kernel: str) -> str:
    """A digest of ``kernel``'s candidates in :data:`CANDIDATES`. A shipped table
    records it per kernel: a kernel's choices competed only with the configurations
    listed then, so after its list changes they are ignored until the table is
    rebuilt (``tuned``); the other kernels' choices stay valid."""
    text = repr([(sorted(c.kwargs.items()), c.num_warps, c.num_stages)
                 for c in CANDIDATES[kernel]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prune_configs(configs, named_args, **kwargs):
    """Keep the configurations that can pay off for this call: the fp32-tile list
    for fp32 inputs or high precision (else the bf16/fp16 one), no paired S slices
    when there is one slice or the bias has its own S axis, no blocks larger than
    the sequence. Keeps at least one."""
    args = {**named_args, **kwargs}
    fp32_tiles = args["PRECISION"] > 0 or args["Q"].dtype.itemsize == 4
    configs = [c for c in configs if (id(c) in FP32_CONFIGS) == fp32_tiles]
    n_cap = max(16, next_power_of_2(args["N"]))
    single_s = args["S"] == 1 or args.get("BIAS_PER_S", False)
    kept = []
    for cfg in configs:
        kw = cfg.kwargs
        if single_s and kw.get("S_GROUP", 1) > 1:
            continue
        if kw["BLOCK_M"] > n_cap or kw["BLOCK_N"] > n_cap:
            continue
        kept.append(cfg)
    return kept or [min(configs, key=_block_area)]
