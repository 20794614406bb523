"""A paper model of EvoSP-3D: communication against compute per pairformer block.

A model, not a measurement: it counts the floating-point operations of one OF3
``PairFormerBlock`` and the bytes each rank of an SP group receives for it, and
turns both into time with a peak throughput, an achieved fraction of it and a
link bandwidth. It predicts the pairformer stack's share of a training step and
the scaling efficiency ``t(1) / (P * t(P))``; what it leaves out (the replicated
modules, the diffusion module, kernel launch and collective latency, memory
traffic) makes it an upper bound on the speed-up.

Per block, forward, one sample of ``N`` tokens (OF3's dimensions: ``c_z = c_mul =
128``; triangle attention 4 heads x 32; single representation 384, 16 heads x 24):

- FLOPs: the two triangle multiplications ``2 * 2 N^3 c_mul`` plus their
  projections ``2 * 2 N^2 (4 c_z c_mul + c_z^2 + c_mul c_z)``; the two triangle
  attentions ``2 * 4 N^3 H c`` plus projections ``2 * 2 N^2 (5 c_z H c + c_z H)``;
  the pair transition ``2 N^2 * 12 c_z^2``; attention with pair bias on ``s``
  ``4 N^2 H_s c_s' + 2 N^2 c_z H_s`` (its ``N c_s^2`` projections are left out).
  Sharded over P ranks, each rank does ``1/P`` of it.
- Elements received per rank (``(P-1)/P`` of each collective's full size): the
  ``b`` and ``a`` all-gathers of the triangle multiplications ``2 N^2 c_mul``, the
  two triangle-attention bias all-gathers ``2 N^2 H``, four ``all_to_all`` axis
  swaps of the rank's ``N^2 c_z / P`` shard; ``N c_s`` for the single
  representation (left out).
- Backward: twice the forward FLOPs and the same volume again (a reduce-scatter
  per gather, the inverse swap per swap); with activation checkpointing (OF3
  trains with one block per checkpoint) the forward runs twice: 4x the forward
  FLOPs and 3x its volume per training step.

:func:`kit_exposed_comm_s` models the schedule the kit runs with its fused
triangle multiplication in the shards: each operand gather of the forward hidden
behind the rank's own block of the product (``2 (N/P)^2 N c_mul`` FLOPs), the
backward's second gather and its reduce-scatter each behind a GEMM of the rank's
whole share (``2 N^3 c_mul / P``), the bias gathers and the swaps exposed. It
assumes a collective in flight does not slow the GEMM beside it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairformerDims:
    """OF3's pairformer (``model_config.py``) and the training precision."""

    c_z: int = 128
    c_mul: int = 128
    tri_heads: int = 4
    tri_head_dim: int = 32
    c_s: int = 384
    apb_heads: int = 16
    apb_head_dim: int = 24
    blocks: int = 48
    bytes_per_element: int = 2  # bf16 activations


@dataclass(frozen=True)
class Hardware:
    """One GPU and its link to the others of the SP group.

    Attributes:
        peak_flops: dense bf16 tensor-core peak, FLOP/s (H200: about 790e12 as
            quoted for this model; NVIDIA lists 989e12 for the SXM part).
        efficiency: fraction of the peak the block's kernels reach.
        link_bytes_per_s: bytes per second a GPU receives (NVLink on an H200:
            about 900e9 both directions together, so 450e9 each way).
    """

    peak_flops: float = 790e12
    efficiency: float = 0.4
    link_bytes_per_s: float = 450e9


def block_flops(n: int, dims: PairformerDims = PairformerDims()) -> float:
    """Forward FLOPs of one ``PairFormerBlock`` on ``n`` tokens (one process)."""
    cz, cm = dims.c_z, dims.c_mul
    hc = dims.tri_heads * dims.tri_head_dim
    tri_mul = 2 * (2 * n**3 * cm + 2 * n**2 * (4 * cz * cm + cz * cz + cm * cz))
    tri_att = 2 * (4 * n**3 * hc + 2 * n**2 * (5 * cz * hc + cz * dims.tri_heads))
    transition = 2 * n**2 * 12 * cz * cz
    apb = 4 * n**2 * dims.apb_heads * dims.apb_head_dim + 2 * n**2 * cz * dims.apb_heads
    return float(tri_mul + tri_att + transition + apb)


def block_received_elements(
    n: int, sp: int, dims: PairformerDims = PairformerDims()
) -> float:
    """Forward elements one rank of an SP group of ``sp`` receives per block."""
    if sp == 1:
        return 0.0
    gathers = 2 * n**2 * dims.c_mul + 2 * n**2 * dims.tri_heads
    swaps = 4 * n**2 * dims.c_z / sp
    return (sp - 1) / sp * (gathers + swaps)


def kit_exposed_comm_s(
    n: int,
    sp: int,
    hardware: Hardware = Hardware(),
    dims: PairformerDims = PairformerDims(),
    checkpointing: bool = True,
) -> float:
    """Seconds per training step of the stack's communication that the kit's
    schedule (module docstring) leaves exposed, per rank."""
    if sp == 1:
        return 0.0
    rate = hardware.peak_flops * hardware.efficiency
    share = (sp - 1) / sp * dims.bytes_per_element / hardware.link_bytes_per_s
    gather = share * n**2 * dims.c_mul
    bias = share * n**2 * dims.tri_heads
    swap = share * n**2 * dims.c_z / sp
    own_block = 2 * (n / sp) ** 2 * n * dims.c_mul / rate
    whole_share = 2 * n**3 * dims.c_mul / sp / rate
    forward = 2 * max(0.0, gather - own_block) + 2 * bias + 4 * swap
    backward = 2 * 2 * max(0.0, gather - whole_share) + 2 * bias + 4 * swap
    forwards = 2 if checkpointing else 1
    return dims.blocks * (forwards * forward + backward)


@dataclass(frozen=True)
class StackEstimate:
    """The pairformer stack's share of one training step (forward, backward and
    the checkpoint recomputation), per rank.

    Attributes:
        tokens, sp: ``N`` and the SP size.
        tflop: FLOPs per rank, in 1e12.
        gbyte: bytes received per rank, in 1e9.
        compute_s, comm_s: their times on :class:`Hardware`.
        serial_s: ``compute_s + comm_s`` (collectives wait for compute).
        overlap_s: ``max(compute_s, comm_s)`` (perfect overlap).
        kit_s: ``compute_s`` plus :func:`kit_exposed_comm_s`.
        efficiency, overlap_efficiency, kit_efficiency: ``t(1) / (sp * t(sp))``
            for each.
    """

    tokens: int
    sp: int
    tflop: float
    gbyte: float
    compute_s: float
    comm_s: float
    serial_s: float
    overlap_s: float
    kit_s: float
    efficiency: float
    overlap_efficiency: float
    kit_efficiency: float


def estimate_stack(
    n: int,
    sp: int,
    hardware: Hardware = Hardware(),
    dims: PairformerDims = PairformerDims(),
    checkpointing: bool = True,
) -> StackEstimate:
    """Predicted time of the pairformer stack in one training step on ``sp`` GPUs.

    Args:
        n: tokens (the crop).
        sp: SP group size (1: one GPU, nothing sharded).
        hardware, dims: the GPU and link, OF3's dimensions.
        checkpointing: one block per activation checkpoint (OF3's training
            setting): the forward, and its collectives, run twice.
    """
    forwards = 2 if checkpointing else 1
    flops = (forwards + 2) * dims.blocks * block_flops(n, dims) / sp
    volume = (forwards + 1) * dims.blocks * block_received_elements(n, sp, dims)
    nbytes = volume * dims.bytes_per_element
    compute = flops / (hardware.peak_flops * hardware.efficiency)
    comm = nbytes / hardware.link_bytes_per_s
    one = (forwards + 2) * dims.blocks * block_flops(n, dims)
    one_s = one / (hardware.peak_flops * hardware.efficiency)
    serial, overlap = compute + comm, max(compute, comm)
    kit = compute + kit_exposed_comm_s(n, sp, hardware, dims, checkpointing)
    return StackEstimate(
        tokens=n,
        sp=sp,
        tflop=flops / 1e12,
        gbyte=nbytes / 1e9,
        compute_s=compute,
        comm_s=comm,
        serial_s=serial,
        overlap_s=overlap,
        kit_s=kit,
        efficiency=one_s / (sp * serial),
        overlap_efficiency=one_s / (sp * overlap),
        kit_efficiency=one_s / (sp * kit),
    )


def markdown_table(
    tokens: tuple[int, ...] = (768, 1024, 1536, 2048, 3072, 4096),
    sizes: tuple[int, ...] = (2, 4, 8),
    hardware: Hardware = Hardware(),
) -> str:
    """The model's table for the docs: one row per (tokens, SP size)."""
    lines = [
        "| N | SP | TFLOP / rank | GB received / rank | compute (s) | comm (s) "
        "| step, serial (s) | efficiency | step, kit schedule (s) | efficiency "
        "| step, overlapped (s) | efficiency |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in tokens:
        one = estimate_stack(n, 1, hardware)
        lines.append(
            f"| {n} | 1 | {one.tflop:.1f} | 0 | {one.compute_s:.3f} | 0 "
            f"| {one.serial_s:.3f} | 1.00 | {one.kit_s:.3f} | 1.00 "
            f"| {one.overlap_s:.3f} | 1.00 |"
        )
        for sp in sizes:
            e = estimate_stack(n, sp, hardware)
            lines.append(
                f"| {n} | {sp} | {e.tflop:.1f} | {e.gbyte:.1f} | {e.compute_s:.3f} "
                f"| {e.comm_s:.3f} | {e.serial_s:.3f} | {e.efficiency:.2f} "
                f"| {e.kit_s:.3f} | {e.kit_efficiency:.2f} "
                f"| {e.overlap_s:.3f} | {e.overlap_efficiency:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
