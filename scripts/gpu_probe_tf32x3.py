"""Probe: a Triton 3xTF32 GEMM against cuBLAS in fp32 (FFMA) and in TF32, one GPU.

    python scripts/gpu_probe_tf32x3.py [OUT_DIR]

For the fp32 matmul shapes of OF3's diffusion transformer at 48 samples x 768 tokens
(and a few others), times ``a @ b`` with cuBLAS with TF32 off and on, and with a plain
Triton GEMM whose dots use ``input_precision="tf32x3"`` (each fp32 operand split into
a TF32 part and a TF32 residual, three tensor-core products), ``b`` both N-major and
K-major (``F.linear``'s weight layout). Errors are the largest deviation from the
fp64 product relative to its largest entry. Writes ``tf32x3_probe.json`` to OUT_DIR
($OUT by default). A measurement for docs/benchmarks.md ("Full training step",
session 21), not a kit kernel.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[
        triton.Config({"BM": 128, "BN": 128, "BK": 32}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 128, "BK": 16}, num_warps=8, num_stages=4),
        triton.Config({"BM": 128, "BN": 256, "BK": 16}, num_warps=8, num_stages=3),
        triton.Config({"BM": 64, "BN": 128, "BK": 32}, num_warps=4, num_stages=4),
        triton.Config({"BM": 128, "BN": 64, "BK": 32}, num_warps=4, num_stages=4),
        triton.Config({"BM": 256, "BN": 128, "BK": 16}, num_warps=8, num_stages=3),
    ],
    key=["M", "N", "K", "PREC"],
)
@triton.jit
def _matmul(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn, PREC: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``C = A @ B`` in fp32; PREC 3: 3xTF32 dots, else TF32."""
    group = 8
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BM)
    blocks_n = tl.cdiv(N, BN)
    first = (pid // (group * blocks_n)) * group
    size = min(blocks_m - first, group)
    pm = first + (pid % (group * blocks_n)) % size
    pn = (pid % (group * blocks_n)) // size
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = A + rm[:, None] * sam + rk[None, :] * sak
    b_ptr = B + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(b_ptr, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        if PREC == 3:
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        a_ptr += BK * sak
        b_ptr += BK * sbk
    tl.store(C + rm[:, None] * scm + rn[None, :] * scn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def tf32x3_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    _matmul[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                  b.stride(1), c.stride(0), c.stride(1), PREC=3)
    return c


SHAPES = [(36864, 768, 768), (36864, 3072, 768), (36864, 768, 1536),
          (768, 768, 36864), (18432, 768, 768), (589824, 16, 128), (147456, 128, 128)]


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    bench = triton.testing.do_bench
    rows = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda") / k**0.5
        b_k_major = b.t().contiguous().t()
        exact = a.double() @ b.double()

        def err(c, exact=exact):
            return ((c.double() - exact).abs().max() / exact.abs().max()).item()

        matmul = torch.backends.cuda.matmul
        matmul.allow_tf32 = False
        row = {"shape": [m, n, k], "err_fp32": err(a @ b),
               "cublas_fp32_ms": bench(lambda a=a, b=b: a @ b)}
        matmul.allow_tf32 = True
        row.update(err_tf32=err(a @ b), cublas_tf32_ms=bench(lambda a=a, b=b: a @ b))
        matmul.allow_tf32 = False
        row.update(
            err_tf32x3=err(tf32x3_matmul(a, b)),
            tf32x3_ms=bench(lambda a=a, b=b: tf32x3_matmul(a, b)),
            tf32x3_bT_ms=bench(lambda a=a, b=b_k_major: tf32x3_matmul(a, b)),
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(out, "tf32x3_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
