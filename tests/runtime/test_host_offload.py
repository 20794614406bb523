"""HostOffload: saved tensors parked on the host between forward and backward.

On the CPU the hook runs with ``devices=("cpu",)``, where every copy is a clone:
that checks what is moved, what is returned, the prefetch order and that nothing
is kept after the backward took it. The GPU tests move real CUDA tensors and check
the device memory the checkpoints no longer hold and that the gradients are the
same bits as without the hook.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from of3_megafold.runtime import host_offload
from of3_megafold.runtime.host_offload import HostOffload

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Block(torch.nn.Module):
    """A residual block with dropout (the checkpoint must replay its RNG)."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(c)
        self.linear = torch.nn.Linear(c, c)

    def forward(self, x, s):
        h = torch.nn.functional.dropout(self.linear(self.norm(x)), 0.25, True)
        return x + torch.sigmoid(h) * s.unsqueeze(-2), s * 1.5


def _stack(n_blocks: int, c: int, device: str, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(_Block(c) for _ in range(n_blocks)).to(device)


def _run(blocks, x, s, use_reentrant: bool, offload: HostOffload | None, seed=1):
    """Forward through checkpointed blocks (under ``offload``), backward; returns the
    outputs and every gradient."""
    x = x.detach().requires_grad_()
    s = s.detach().requires_grad_()
    torch.manual_seed(seed)
    with offload if offload is not None else torch.enable_grad():
        a, b = x, s
        for block in blocks:
            a, b = checkpoint(block, a, b, use_reentrant=use_reentrant)
    (a.square().sum() + b.sum()).backward()
    grads = [x.grad, s.grad] + [p.grad for p in blocks.parameters()]
    for p in blocks.parameters():
        p.grad = None
    return [a.detach(), b.detach()], grads


@pytest.mark.parametrize("piece_floor", [host_offload.PIECE_FLOOR, 16])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_inputs_move_and_gradients_are_unchanged(use_reentrant, piece_floor):
    blocks = _stack(5, 24, "cpu")
    x, s = torch.randn(3, 7, 24), torch.randn(3, 24)
    out, grads = _run(blocks, x, s, use_reentrant, None)
    offload = HostOffload(min_bytes=0, devices=("cpu",), piece_floor=piece_floor)
    out_o, grads_o = _run(blocks, x, s, use_reentrant, offload)
    for got, want in zip(out_o + grads_o, out + grads, strict=True):
        assert torch.equal(got, want)
    # every block's inputs (x-like and s-like), nothing else: the blocks' own
    # saved activations go to the checkpoint
    per_block = (x.numel() + s.numel()) * x.element_size()
    assert offload.moved_bytes == 5 * per_block


@pytest.mark.parametrize(
    ("nbytes", "floor", "lengths"),
    [
        (2176**2 * 256, 1 << 20, [1 << 30, 1 << 27, 1 << 22]),  # z at 2176 tokens
        (1 << 30, 1 << 20, [1 << 30]),
        ((1 << 20) + 5, 1 << 20, [1 << 20, 5]),
        (1000, 1 << 20, [1000]),
        (1000, 64, [512, 256, 128, 64, 40]),
        (0, 64, []),
    ],
)
def test_host_pieces_are_exact_powers_of_two(nbytes, floor, lengths):
    pieces = host_offload.host_pieces(nbytes, floor)
    assert [length for _, length in pieces] == lengths
    offsets = [offset for offset, _ in pieces]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))]


def test_small_tensors_stay_where_they_are():
    blocks = _stack(3, 8, "cpu")
    x, s = torch.randn(2, 5, 8), torch.randn(2, 8)
    offload = HostOffload(min_bytes=x.numel() * x.element_size(), devices=("cpu",))
    out, grads = _run(blocks, x, s, False, None)
    out_o, grads_o = _run(blocks, x, s, False, offload)
    assert offload.moved_bytes == 3 * x.numel() * x.element_size()  # not the s's
    for got, want in zip(out_o + grads_o, out + grads, strict=True):
        assert torch.equal(got, want)


def test_tensors_stay_when_the_host_runs_low(monkeypatch, caplog):
    """Past the host reserve tensors stay on the device (warned once); the rest
    still move, and the gradients do not change."""
    blocks = _stack(4, 16, "cpu")
    x, s = torch.randn(2, 9, 16), torch.randn(2, 16)
    x_bytes = x.numel() * x.element_size()
    available = iter([10 * x_bytes, 10 * x_bytes] + [x_bytes] * 100)
    monkeypatch.setattr(host_offload, "host_available_bytes", lambda: next(available))
    out, grads = _run(blocks, x, s, False, None)
    offload = HostOffload(min_bytes=x_bytes, devices=("cpu",),
                          host_reserve=2 * x_bytes)
    with caplog.at_level("WARNING", logger=host_offload.__name__):
        out_o, grads_o = _run(blocks, x, s, False, offload)
    assert offload.moved_bytes == 2 * x_bytes  # the first two blocks' x
    assert offload.kept_bytes == 2 * x_bytes
    assert [r.getMessage().startswith("host memory low") for r in caplog.records] == [
        True]
    for got, want in zip(out_o + grads_o, out + grads, strict=True):
        assert torch.equal(got, want)


def test_host_available_bytes_reads_meminfo():
    available = host_offload.host_available_bytes()
    assert available is None or available > 0


def test_cpu_tensors_stay_unless_cpu_is_named():
    offload = HostOffload(min_bytes=0)  # CUDA only
    x = torch.randn(4, 4, requires_grad=True)
    with offload:
        y = (x * 2).sigmoid()  # sigmoid saves its output
    y.sum().backward()
    assert offload.moved_bytes == 0 and x.grad is not None


@pytest.fixture
def fetch_log(monkeypatch):
    """Events ``(what, block)`` in order: a block's input stash prefetched or
    unpacked, blocks numbered by their position in the forward."""
    log: list[tuple[str, int]] = []
    index: dict[int, int] = {}
    pack, unpack = HostOffload._pack, HostOffload._unpack
    start = host_offload._start_fetch

    # (torch 2.11's non-reentrant checkpoint also saves an empty tensor through
    # the ambient hook: it stays, and is not numbered)
    def logged_pack(self, tensor):
        packed = pack(self, tensor)
        if isinstance(packed, host_offload._Stash):
            index[id(packed)] = len(index)
        return packed

    def logged_unpack(self, packed):
        if isinstance(packed, host_offload._Stash):
            log.append(("unpack", index[id(packed)]))
        return unpack(self, packed)

    def logged_start(stash):
        if stash.fetched is None:
            log.append(("prefetch", index[id(stash)]))
        start(stash)

    monkeypatch.setattr(HostOffload, "_pack", logged_pack)
    monkeypatch.setattr(HostOffload, "_unpack", logged_unpack)
    monkeypatch.setattr(host_offload, "_start_fetch", logged_start)
    return log


def test_backward_prefetches_the_previous_block_while_it_recomputes(fetch_log):
    class One(torch.nn.Module):  # one input per block: stash i is block i's input
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 6)

        def forward(self, x):
            return x + torch.tanh(self.linear(x))

    torch.manual_seed(0)
    blocks = [One() for _ in range(4)]
    x = torch.randn(5, 6, requires_grad=True)
    with HostOffload(min_bytes=0, devices=("cpu",)):
        a = x
        for block in blocks:
            a = checkpoint(block, a, use_reentrant=False)
    a.sum().backward()
    # the backward takes block 3's input first; each unpack starts the copy of the
    # block before, which is then handed over (not copied again) at its unpack
    assert fetch_log == [
        ("unpack", 3), ("prefetch", 2),
        ("unpack", 2), ("prefetch", 1),
        ("unpack", 1), ("prefetch", 0),
        ("unpack", 0),
    ]


def test_unpacked_stashes_keep_no_device_copy():
    blocks = _stack(3, 8, "cpu")
    stashes = []
    offload = HostOffload(min_bytes=0, devices=("cpu",))
    pack = offload._pack

    def keep(tensor):
        packed = pack(tensor)
        if isinstance(packed, host_offload._Stash):
            stashes.append(packed)
        return packed

    offload.pack_hook = keep  # saved_tensors_hooks reads it on __enter__
    _run(blocks, torch.randn(2, 3, 8), torch.randn(2, 8), False, offload)
    assert len(stashes) == 6
    assert all(st.unpacked and st.fetched is None for st in stashes)
    assert offload._last is None  # the context let go of the chain on exit


def _reference_gpu(n_blocks, shape, dtype):
    blocks = _stack(n_blocks, shape[-1], "cuda").to(dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    s = torch.randn(shape[0], shape[-1], device="cuda", dtype=dtype)
    return blocks, x, s


@gpu
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gpu_checkpoint_inputs_leave_the_device_and_gradients_are_unchanged(
    use_reentrant,
):
    n_blocks, shape = 8, (64, 512, 256)  # 32 MiB per block input in fp32
    blocks, x, s = _reference_gpu(n_blocks, shape, torch.float32)
    out, grads = _run(blocks, x, s, use_reentrant, None)

    x_ = x.detach().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    offload = HostOffload()
    with offload:
        a, b = x_, s
        for block in blocks:
            a, b = checkpoint(block, a, b, use_reentrant=use_reentrant)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del a, b
    x_bytes = x.numel() * x.element_size()
    # without the hook the graph would hold the 7 inner inputs plus the output
    assert held < 2 * x_bytes
    assert offload.moved_bytes >= n_blocks * x_bytes

    out_o, grads_o = _run(blocks, x, s, use_reentrant, HostOffload())
    for got, want in zip(out_o + grads_o, out + grads, strict=True):
        assert torch.equal(got, want)


@gpu
def test_gpu_bf16_non_contiguous_saved_tensors_round_trip():
    """Tensors saved by plain ops (no checkpoint), a non-contiguous bf16 leaf among
    them: the same gradient bits as without the hook."""
    leaf = torch.randn(96, 128, 300, device="cuda", dtype=torch.bfloat16)

    def grad(offload):
        x = leaf.transpose(0, 2).detach().requires_grad_()
        with offload if offload is not None else torch.enable_grad():
            y = torch.sigmoid(x.float())  # saves its fp32 output
            z = x * y.to(x.dtype)  # saves x (non-contiguous) and the cast
        z.float().square().sum().backward()
        return x.grad

    offload = HostOffload(min_bytes=0)
    assert torch.equal(grad(offload), grad(None))
    assert offload.moved_bytes >= leaf.numel() * (2 + 4 + 2)
