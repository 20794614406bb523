"""The fused triangle multiplication's sharded schedule on one GPU, without transfers.

    python -m tools.gpu_check_sharded_triangle_multiplication
    python -m tools.gpu_check_sharded_triangle_multiplication --tokens 1536 --ranks 2 4
    TRITON_INTERPRET=1 python -m tools.gpu_check_sharded_triangle_multiplication \\
        --cpu --check-tokens 12 --ranks 2 3 --tokens     # dry run, no timing

One process plays every rank of a sequence-parallel group. For rank ``r`` a
:class:`Replay` exchange hands the autograd function the results its collectives
would have on the group (every rank's contributions, recorded in earlier passes), so
each rank runs its own schedule on exact data with nothing transferred:

- check (``--check-tokens``, both directions, bf16, a masked pair): each rank's
  output and input-gradient shards and the rank-summed parameter gradients against
  the unsharded kernel on the whole ``z``, both measured against OF3's math in fp32
  (relative max error; the ratio should be about 1);
- timing (``--tokens``, outgoing, rank 0, CUDA events): forward + backward of the
  shard with every collective's result ready at once, against the unsharded kernel's
  forward + backward divided by P; and, for each collective, the GPU time of the
  GEMMs issued between its launch and its wait (the window it can hide in) against
  its transfer time at the sequence-parallel cost model's link rate. The fraction
  of that transfer a window can hide, measured here, is what
  ``parallel/cost_model.py`` assumes from FLOP counts.

OF3's pair dimensions: ``C_z = C_h = 128``. Prints each check and timing; ``--out``
gets the checks and the timing rows, which are appended to
``docs/benchmarks/sp_trimul_schedule.json`` as rows of record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from of3_megafold.bench.common import environment_metadata
from of3_megafold.kernels.triangle_multiplication import function
from of3_megafold.kernels.triangle_multiplication.reference import (
    triangle_multiplication_reference,
)
from of3_megafold.parallel.cost_model import Hardware

CZ = CH = 128
NAMES = (
    "out",
    "dz",
    "dln_in_w",
    "dln_in_b",
    "dw_a_p",
    "dw_a_g",
    "dw_b_p",
    "dw_b_g",
    "dw_g",
    "dln_out_w",
    "dln_out_b",
    "dw_z",
)


class _Ready:
    """A collective whose result is already there; optionally records CUDA events
    at its launch and its wait."""

    def __init__(self, result, log, name):
        self._result, self._log, self._name = result, log, name
        if log is not None:
            self._start = _event()

    def wait(self):
        if self._log is not None:
            self._log.append((self._name, self._start, _event()))
        return self._result


def _event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Replay:
    """``ShardExchange`` for rank ``rank`` of ``size`` played in one process.

    ``gathers`` and ``scatters`` are the results its all-gathers and
    reduce-scatters return, in call order (zeros once they run out); what the rank
    sends is kept in ``sent`` when ``record`` is set; with ``log`` (a list) each
    collective's launch and wait are logged as CUDA events.
    """

    def __init__(self, rank, size, gathers=(), scatters=(), record=False, log=None):
        self.rank, self.size = rank, size
        self._gathers, self._scatters = list(gathers), list(scatters)
        self.record, self.log, self.sent = record, log, {"gather": [], "scatter": []}

    def start_gather(self, t):
        if self.record:
            self.sent["gather"].append(t.detach().clone())
        shape = (self.size * t.shape[0], *t.shape[1:])
        result = self._gathers.pop(0) if self._gathers else t.new_zeros(shape)
        return _Ready(result, self.log, "gather")

    def start_reduce_scatter(self, t):
        if self.record:
            self.sent["scatter"].append(t.detach().clone())
        shape = (t.shape[0] // self.size, *t.shape[1:])
        result = self._scatters.pop(0) if self._scatters else t.new_zeros(shape)
        return _Ready(result, self.log, "reduce_scatter")


def inputs(n, device, seed=0):
    """bf16 ``z`` ``[1, N, N, C_z]``, a pair mask, OF3's parameters (in
    ``fused_triangle_multiplication``'s order) and an output gradient."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen, device=device) * scale + shift

    z = randn(1, n, n, CZ, scale=2.0, shift=0.5).bfloat16()
    mask = (randn(1, n, n) > -0.8).float()
    params = [
        randn(CZ, scale=0.3, shift=1.0),
        randn(CZ, scale=0.3),
        *(randn(CH, CZ, scale=CZ**-0.5).bfloat16() for _ in range(4)),
        randn(CZ, CZ, scale=CZ**-0.5).bfloat16(),
        randn(CH, scale=0.3, shift=1.0),
        randn(CH, scale=0.3),
        randn(CZ, CH, scale=CH**-0.5).bfloat16(),
    ]
    dout = randn(1, n, n, CZ).bfloat16()
    return z, mask, params, dout


def shard(t, outgoing, rank, size):
    """Rank ``rank``'s rows (outgoing) or columns (incoming) of ``[1, N, N(, C)]``."""
    return t.chunk(size, dim=1 if outgoing else 2)[rank].contiguous()


def _run(fn, z, mask, params, dout, backward=True, **kwargs):
    """``[out, dz, d(param) ...]`` of one forward (+ backward)."""
    leaves = [t.detach().requires_grad_(backward) for t in (z, *params)]
    out = fn(leaves[0], mask, *leaves[1:], **kwargs)
    if not backward:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def sharded_results(z, mask, params, dout, outgoing, size):
    """Every rank's ``[out, dz, d(param) ...]`` of the sharded update, its
    collectives replayed: forward sends first, then the backward's reduce-scatter
    inputs with the true gathered operand, then the run with every result true."""
    shards = [
        [shard(t, outgoing, r, size) for t in (z, mask, dout)] for r in range(size)
    ]

    def play(rank, backward, **replay):
        exchange = Replay(rank, size, **replay)
        zr, mr, dr = shards[rank]
        got = _run(
            function.fused_triangle_multiplication,
            zr,
            mr,
            params,
            dr,
            backward,
            outgoing=outgoing,
            exchange=exchange,
        )
        return got, exchange

    sent = [play(r, False, record=True)[1].sent["gather"][0] for r in range(size)]
    whole = torch.cat(sent)  # [P n, B C_h, N]: the gathered operand
    reduced = sum(
        play(r, True, gathers=(whole, whole), record=True)[1].sent["scatter"][0]
        for r in range(size)
    )
    parts = reduced.chunk(size)
    return [
        play(r, True, gathers=(whole, whole), scatters=(parts[r],))[0]
        for r in range(size)
    ]


# A sharded result fails when its error exceeds twice the unsharded kernel's plus
# this (relative to the largest entry; bf16 rounds at 2^-8).
FLOOR = 2e-3


def check(n, size, outgoing, device, seed=0):
    """Relative max errors against OF3's math in fp32: ``{name: (sharded,
    unsharded)}`` for the output, ``dz`` and every parameter gradient."""
    z, mask, params, dout = inputs(n, device, seed)
    whole = _run(
        function.fused_triangle_multiplication, z, mask, params, dout, outgoing=outgoing
    )
    want = _run(
        triangle_multiplication_reference,
        z.float(),
        mask,
        [p.float() for p in params],
        dout.float(),
        outgoing=outgoing,
    )
    ranks = sharded_results(z, mask, params, dout, outgoing, size)
    dim = 1 if outgoing else 2
    got = [torch.cat([r[i] for r in ranks], dim=dim) for i in range(2)]
    got += [sum(r[i].float() for r in ranks) for i in range(2, len(NAMES))]

    def rel(t, w):
        return ((t.float() - w).abs().max() / w.abs().max()).item()

    return {
        name: (rel(g, w), rel(u, w))
        for name, g, u, w in zip(NAMES, got, whole, want, strict=True)
    }


def _gpu_ms(fn, repeats):
    """Median GPU milliseconds of ``fn()`` over ``repeats`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = _event()
        fn()
        end = _event()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# The collectives of one forward + backward, in the order their waits come.
COLLECTIVES = ("forward gather", "backward gather", "reduce-scatter")


def timing(n, size, repeats=5):
    """Rank 0's schedule at ``N = n`` over ``size`` ranks (outgoing), as rows:
    ``shard`` (the shard's forward + backward, ms), ``whole/P`` (the unsharded
    kernel's over ``size``) and one per collective (the GPU time of the GEMMs
    between its launch and its wait), each with ``transfer_ms``, the collective's
    time at the cost model's link rate."""
    z, mask, params, dout = inputs(n, "cuda")
    zr, mr, dr = (shard(t, True, 0, size) for t in (z, mask, dout))
    m = n // size
    whole = torch.randn(n, CH, n, device="cuda").bfloat16()
    part = torch.randn(CH, m, n, device="cuda").bfloat16()

    def sharded(log=None):
        exchange = Replay(0, size, (whole, whole), (part,), log=log)
        _run(
            function.fused_triangle_multiplication,
            zr,
            mr,
            params,
            dr,
            exchange=exchange,
        )

    def unsharded():
        _run(function.fused_triangle_multiplication, z, mask, params, dout)

    ms = {"shard": _gpu_ms(sharded, repeats), "whole/P": _gpu_ms(unsharded, repeats)}
    ms["whole/P"] /= size
    windows = {name: [] for name in COLLECTIVES}
    for _ in range(repeats):
        log = []
        sharded(log)
        torch.cuda.synchronize()
        for name, (_, start, end) in zip(COLLECTIVES, log, strict=True):
            windows[name].append(start.elapsed_time(end))
    ms.update({name: statistics.median(times) for name, times in windows.items()})
    received = (size - 1) / size * n * n * CH * 2  # bytes, bf16
    transfer_ms = received / Hardware().link_bytes_per_s * 1e3
    meta = environment_metadata("cuda")
    return [
        {
            "bench": "sp_trimul_schedule",
            "provider": provider,
            "n_token": n,
            "sp_size": size,
            "c_z": CZ,
            "ms": round(value, 3),
            "transfer_ms": round(transfer_ms, 3),
            "repeats": repeats,
            **meta,
        }
        for provider, value in ms.items()
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, nargs="*", default=[768, 1536, 2048, 3072]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--check-tokens", type=int, nargs="*", default=[768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="check on the CPU only")
    parser.add_argument(
        "--out",
        help="JSON file: the checks, and the timing rows (for "
        "docs/benchmarks/sp_trimul_schedule.json)",
    )
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    results = {"check": [], "rows": []}
    failed = False
    for n in args.check_tokens:
        for size in args.ranks:
            for outgoing in (True, False):
                errors = check(n, size, outgoing, device)
                failed |= any(s > 2 * u + FLOOR for s, u in errors.values())
                worst = max(s / max(u, 1e-12) for s, u in errors.values())
                row = {
                    "tokens": n,
                    "ranks": size,
                    "outgoing": outgoing,
                    "worst_ratio": round(worst, 3),
                    **{k: [f"{s:.2e}", f"{u:.2e}"] for k, (s, u) in errors.items()},
                }
                results["check"].append(row)
                print(json.dumps(row), flush=True)
    if not args.cpu:
        for n in args.tokens:
            for size in args.ranks:
                rows = timing(n, size, args.repeats)
                results["rows"] += rows
                print(json.dumps({r["provider"]: r["ms"] for r in rows}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(
        "check:",
        "FAILED (a sharded error over twice the unsharded one)"
        if failed
        else "every sharded error within twice the unsharded one",
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
