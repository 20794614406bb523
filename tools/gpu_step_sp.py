"""The full-model training step under sequence parallelism: one process per GPU.

    python -m torch.distributed.run --standalone --nproc_per_node P \\
        -m tools.gpu_step_sp OUT.json [--provider kit] [--tokens 768,1280]
        [--repeats 2] [--warmup 1] [--num-recycles 1] [--replicate-diffusion]
        [--config full|tiny] [--n-msa 1024] [--n-templ 4] [--memory-windows 25]
        [--memory-depth 5]

What ``tools/gpu_step.py`` measures on one GPU, with the ``sequence_parallel``
extension on over all P ranks (``sequence_parallel_size = P``: one group, no data
parallelism). Every rank builds the same model (provider ``--provider``, same
seed) and steps on the same random batch. The pair representation is sharded
across the ranks inside the pairformer stacks, and each rank runs ``no_samples / P``
of the diffusion samples (unless ``--replicate-diffusion``). After each backward
the gradients are averaged over the ranks in one flat ``all_reduce``, as DDP would.

Per size, rank 0 appends one row to OUT.json:
- the step time of the slowest rank (forward + loss + backward + that
  ``all_reduce``; median over ``--repeats`` steps after ``--warmup``);
- every rank's peak memory during forward, loss and backward
  (``max_memory_allocated``; the largest is ``peak_gib``). The flat gradient buffer
  of the ``all_reduce`` (one fp32 copy of the gradients, 1.4 GiB for the full model)
  comes after the activations are freed and is not in it;
- the loss breakdown (averaged over the group by the extension).

``--memory-windows K``: after the timed steps of a size, one more step with
:class:`~of3_megafold.bench.memory_windows.MemoryWindows` on every rank (model and
loss modules to ``--memory-depth``, default 5: deep enough for the blocks of the
diffusion transformer and the confidence head's pairformer; and OF3's loss terms,
which are functions: ``_loss_terms``); each rank writes the K
windows with the highest peaks to ``OUT.memory-<tokens>-rank<r>.txt``: where in the
step the peak memory sits, which the sharded pairformer does not show by itself.
With ``--nproc_per_node 1`` the same report comes from one unsharded GPU.

A size that does not fit ends the run. The rank that ran out of memory exits with
status 3, and the launcher stops the others, which would otherwise wait in a
collective. The rows measured before it are kept. A largest-crop search is
therefore one launch per size::

    for n in 1280 1536 1792 2048; do python -m torch.distributed.run ... \\
        --tokens $n --repeats 1 || break; done

``--config tiny`` with small ``--tokens`` is a CPU dry run over ``gloo``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from of3_megafold.bench.common import parse_ints

OUT_OF_MEMORY_EXIT = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_json", type=Path, help="JSON file to append rows to")
    parser.add_argument("--provider", default="kit", help="step-harness provider")
    parser.add_argument("--tokens", type=parse_ints, default=[768])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--num-recycles", type=int, default=1)
    parser.add_argument("--n-msa", type=int, default=1024)
    parser.add_argument("--n-templ", type=int, default=4)
    parser.add_argument(
        "--replicate-diffusion",
        action="store_true",
        help="every rank runs all diffusion samples (default: split them)",
    )
    parser.add_argument("--config", default="full", help="'full', or 'tiny' on CPU")
    parser.add_argument(
        "--memory-windows",
        type=int,
        default=0,
        metavar="K",
        help="one more step per size with the memory-window recorder; the top K "
        "windows per rank to OUT.memory-<tokens>-rank<r>.txt (0: off)",
    )
    parser.add_argument(
        "--memory-depth",
        type=int,
        default=5,
        help="deepest module-name level the recorder hooks",
    )
    return parser.parse_args(argv)


def _average_gradients(model, dist) -> None:
    """Average every gradient over the world in one flat ``all_reduce``."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _timed_step(harness, batch, dist) -> tuple[float, object]:
    """One step plus the gradient average; (ms of the slowest rank, StepResult)."""
    import torch

    result = harness.step(batch)
    started = time.perf_counter()
    _average_gradients(harness.model, dist)
    if harness.device.type == "cuda":
        torch.cuda.synchronize(harness.device)
    # on the rank's device: CUDA for NCCL, the CPU for gloo
    ms = torch.tensor(
        [result.ms + (time.perf_counter() - started) * 1e3], device=harness.device
    )
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms), result


def _gathered(value: float, dist, device) -> list[float]:
    import torch

    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(v) for v in every]


def _loss_terms() -> dict[str, tuple[object, str]]:
    """OF3's loss terms (functions, looked up in these modules by their callers), as
    memory-window events: the loss module's windows split by term."""
    from openfold3.core.loss import diffusion, loss_module

    terms = {"loss.confidence": (loss_module, "confidence_loss"),
             "loss.diffusion": (loss_module, "diffusion_loss"),
             "loss.distogram": (loss_module, "all_atom_distogram_loss")}
    for name in ("mse_loss", "bond_loss", "bond_loss_sparse", "smooth_lddt_loss"):
        terms[f"loss.diffusion.{name}"] = (diffusion, name)
    return terms


def _memory_windows(harness, batch, count: int, depth: int, path: Path) -> None:
    """One more step with the memory-window recorder; its top ``count`` windows to
    ``path`` (off CUDA every peak reads 0: a dry run of the hooks)."""
    from of3_megafold.bench.memory_windows import MemoryWindows

    recorder = MemoryWindows(
        {"": harness.model, "loss": harness.loss_fn},
        depth=depth,
        peak_and_reset=None if harness.device.type == "cuda" else (lambda: 0),
        functions=_loss_terms(),
    )
    with recorder.recording():
        harness.step(batch)  # its own peak figure is void here: the recorder resets
    path.write_text("\n".join(recorder.report(count)) + "\n")


def _measure(harness, args, n_token: int, dist) -> dict:
    """Warm-up and timed steps at ``n_token`` tokens; the row's fields."""

    from of3_megafold.bench.common import free_device_memory, is_out_of_memory
    from of3_megafold.bench.step import random_training_batch

    batch = random_training_batch(
        n_token, args.n_msa, args.n_templ, harness.device, harness.seed
    )
    times, results = [], []
    try:
        for index in range(args.warmup + args.repeats):
            ms, result = _timed_step(harness, batch, dist)
            if index >= args.warmup:
                times.append(ms)
                results.append(result)
        if args.memory_windows:
            name = f"{args.out_json.stem}.memory-{n_token}-rank{dist.get_rank()}.txt"
            _memory_windows(harness, batch, args.memory_windows, args.memory_depth,
                            args.out_json.with_name(name))
            harness.model.zero_grad(set_to_none=True)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        print(
            f"rank {dist.get_rank()}: out of memory at {n_token} tokens",
            file=sys.stderr,
            flush=True,
        )
        os._exit(OUT_OF_MEMORY_EXIT)  # the peers wait in a collective
    del batch
    harness.model.zero_grad(set_to_none=True)
    free_device_memory()
    cuda = harness.device.type == "cuda"
    peaks = _gathered(
        max(r.peak_gib for r in results) if cuda else 0.0, dist, harness.device
    )
    last = results[-1]
    return {
        "ms": statistics.median(times),
        "step_ms": [round(t, 3) for t in times],
        "peak_gib": max(peaks) if cuda else None,
        "peak_gib_ranks": [round(p, 3) for p in peaks] if cuda else None,
        "recycles": last.recycles,
        "loss": last.loss,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    import torch.distributed as dist

    from of3_megafold import activate
    from of3_megafold.bench.common import append_rows, environment_metadata
    from of3_megafold.bench.step import TrainingStepHarness
    from of3_megafold.parallel.groups import reset_sequence_parallel

    cuda = args.config == "full"
    if cuda and not torch.cuda.is_available():
        print("gpu_step_sp.py needs CUDA devices (or --config tiny)", file=sys.stderr)
        return 2
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = not args.replicate_diffusion
    activate()  # registers the sequence_parallel keys in OF3's config
    try:
        harness = TrainingStepHarness(
            args.config,
            args.provider,
            device,
            num_recycles=args.num_recycles,
            update={
                "settings": {
                    "sequence_parallel_size": world,
                    "sequence_parallel_split_diffusion": split,
                    # required with sequence parallelism (the harness does not clip)
                    "gradient_clipping": {"per_sample_clipping": False},
                }
            },
        )
        meta = environment_metadata(device)
        for n_token in args.tokens:
            fields = _measure(harness, args, n_token, dist)
            if rank == 0:
                row = {
                    "bench": "step",
                    "mode": "step_sp",
                    "provider": f"{args.provider}+sp{world}",
                    "config": args.config,
                    "n_token": n_token,
                    "n_msa": args.n_msa,
                    "n_templ": args.n_templ,
                    "no_samples": harness.no_samples,
                    "sp_size": world,
                    "split_diffusion": split,
                    "precision": harness.precision,
                    "params_m": round(harness.params_m, 2),
                    "warmup": args.warmup,
                    "repeats": args.repeats,
                    **fields,
                    **meta,
                }
                append_rows(args.out_json, [row])
                print(
                    f"{row['provider']} @ {n_token} tokens: {fields['ms'] / 1e3:.2f} "
                    f"s/step, peak per rank {fields['peak_gib_ranks']} GiB, "
                    f"loss {fields['loss'].get('loss', float('nan')):.4f}",
                    flush=True,
                )
    finally:
        reset_sequence_parallel()  # the kit's group references go before the world
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
