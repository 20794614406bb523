"""Sequence parallelism on GPUs: one OF3 PairFormerBlock sharded over P ranks (NCCL)
against the same block, same weights and inputs, on one GPU.

    python -m tools.gpu_check_sequence_parallel --ranks 2 --tokens 384 768
    python -m tools.gpu_check_sequence_parallel --cpu --tokens 9   # gloo dry run

OF3's pairformer dimensions (c_s 384, c_z 128, 16 x 24 single-attention heads, 4 x 32
triangle heads, trimul hidden 128, SwiGLU n=4; ``--cpu`` uses small ones), fp32 at
torch's "highest" matmul precision, eval mode (no dropout). Each rank runs the stock
block on its own device as the reference and the sharded block
(:func:`of3_megafold.parallel.pairformer.sharded_pairformer_forward`) on the group;
rank 0 prints the largest relative errors of the outputs, the input gradients and the
world-averaged parameter gradients, then forward + backward time (median of timed
repeats, all ranks synchronised) and peak memory above the inputs, stock on one
device against sharded per rank. Diagnostic: no JSON rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FULL = dict(
    c_s=384,
    c_z=128,
    c_hidden_pair_bias=24,
    no_heads_pair_bias=16,
    c_hidden_mul=128,
    c_hidden_pair_att=32,
    no_heads_pair=4,
    transition_n=4,
)
SMALL = dict(
    c_s=8,
    c_z=8,
    c_hidden_pair_bias=4,
    no_heads_pair_bias=2,
    c_hidden_mul=6,
    c_hidden_pair_att=4,
    no_heads_pair=2,
    transition_n=2,
)


def make_block(dims: dict, seed: int, device):
    from openfold3.core.model.latent.pairformer import PairFormerBlock

    block = PairFormerBlock(
        **dims,
        transition_type="swiglu",
        pair_dropout=0.25,
        fuse_projection_weights=False,
        inf=1e9,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # AF3 zero-initialises some projections: randomise all
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.to(device).eval()


def make_inputs(dims: dict, n: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, dims["c_s"], generator=gen)
    z = torch.randn(1, n, n, dims["c_z"], generator=gen)
    token_mask = torch.ones(1, n)
    token_mask[:, n - max(1, n // 20) :] = 0.0
    pair_mask = token_mask[:, :, None] * token_mask[:, None, :]
    grads = (torch.randn(s.shape, generator=gen), torch.randn(z.shape, generator=gen))
    inputs = [t.to(device) for t in (s, z, token_mask, pair_mask)]
    return inputs, [g.to(device) for g in grads]


def step(forward, block, inputs, grads):
    s, z, single_mask, pair_mask = inputs
    s = s.clone().requires_grad_()
    z = z.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    s_out, z_out = forward(s, z, single_mask, pair_mask)
    ((s_out * grads[0]).sum() + (z_out * grads[1]).sum()).backward()
    return [s_out.detach(), z_out.detach(), s.grad, z.grad] + [
        p.grad for p in block.parameters()
    ]


def relative_error(actual, expected) -> float:
    scale = expected.abs().max().clamp_min(1e-2)
    return ((actual - expected).abs().max() / scale).item()


def timed(fn, device, repeats: int) -> tuple[float, float]:
    """Median ms of ``fn`` (all ranks synchronised) and peak MiB above the start."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (
        (torch.cuda.max_memory_allocated(device) - before) / 2**20
        if device.type == "cuda"
        else float("nan")
    )
    return statistics.median(times), peak


def check_size(n: int, dims: dict, group, device, repeats: int) -> None:
    """Errors and timings of one block at ``n`` tokens (printed by rank 0)."""
    from of3_megafold.parallel.pairformer import sharded_pairformer_forward

    world, rank = dist.get_world_size(), dist.get_rank()
    block = make_block(dims, 0, device)
    inputs, grads = make_inputs(dims, n, 1, device)

    def stock(s, z, sm, pm):
        return block(s, z, single_mask=sm, pair_mask=pm)

    def sharded(s, z, sm, pm):
        return sharded_pairformer_forward([block], s, z, sm, pm, group)

    ref = step(stock, block, inputs, grads)
    got = step(sharded, block, inputs, grads)
    params = []
    for g in got[4:]:
        g = g.clone()
        dist.all_reduce(g)
        params.append(g / world)

    def worst(actual, expected):
        return max(relative_error(a, e) for a, e in zip(actual, expected, strict=True))

    errors = {
        "outputs": worst(got[:2], ref[:2]),
        "input grads": worst(got[2:4], ref[2:4]),
        "param grads (world avg)": worst(params, ref[4:]),
    }
    stock_ms, stock_mib = timed(
        lambda: step(stock, block, inputs, grads), device, repeats
    )
    sharded_ms, sharded_mib = timed(
        lambda: step(sharded, block, inputs, grads), device, repeats
    )
    peaks = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([sharded_mib], device=device))
    if rank == 0:
        err = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
        print(f"N={n:5} P={world}: max relative error: {err}")
        print(
            f"N={n:5} fwd+bwd one block: one device {stock_ms:9.2f} ms, "
            f"peak {stock_mib:9.1f} MiB | sharded over {world}: "
            f"{sharded_ms:9.2f} ms, peak per rank "
            f"{', '.join(f'{p.item():.1f}' for p in peaks)} MiB",
            flush=True,
        )


def body(rank: int, world: int, store: str, args) -> None:
    cpu = args.cpu
    device = torch.device("cpu" if cpu else f"cuda:{rank}")
    if not cpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
    )
    group = dist.new_group(list(range(world)))
    try:
        for n in args.tokens:
            check_size(n, SMALL if cpu else FULL, group, device, args.repeats)
            if not cpu:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, small dims")
    args = parser.parse_args()
    if not args.cpu and torch.cuda.device_count() < args.ranks:
        print(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "rendezvous")
        mp.spawn(body, args=(args.ranks, store, args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
