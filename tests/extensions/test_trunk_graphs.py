"""Trunk graphs: OF3's MSA module and pairformer stack replayed from CUDA graphs in
the trunk's cycles without autograd.

On the CPU a graph is stood in for by a recording of the call that re-runs it on
its static input buffers at every replay (``conftest.FakeGraph``): that checks which
call runs as OF3's, which is captured, which replays, across training steps and
inside a real OF3 step. The GPU tests capture real graphs and compare training
steps with the key on and off.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from of3_megafold import registry
from of3_megafold.errors import KitConfigError
from tests.extensions.conftest import fake_capture

NAME = "trunk_graphs"
FLAG = "use_trunk_cuda_graphs"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _harness(device: str, on: bool, num_recycles: int = 3):
    from of3_megafold.bench.step import TrainingStepHarness

    update = {"settings": {"memory": {"train": {FLAG: on}}}}
    return TrainingStepHarness(
        "tiny", "stock", device, num_recycles=num_recycles, update=update
    )


def _batch(harness, n_token: int = 24):
    from of3_megafold.bench.step import random_training_batch

    return random_training_batch(n_token, 8, 2, harness.device)


class _FakeAutogradGraphs:
    """Stands in for a call captured with its backward: a replay runs the call
    with autograd (what the graphs compute) and logs "replay"."""

    def __init__(self, original, module, log: list[str]):
        self.original, self.module, self.log = original, module, log
        self.waiting = False

    def busy(self) -> bool:
        return self.waiting

    def replay(self, arguments):
        self.log.append("replay")
        return self.original(self.module, **arguments)


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Graph every CPU stack call through a fake graph; the value lists what
    happened, call by call, as ``(stack class, stack id, autograd, events)``."""
    from of3_megafold.extensions import trunk_graphs
    from of3_megafold.runtime import autograd_graphs

    log: list = []
    events: list[str] = []
    captures = {"PairFormerStack": fake_capture(events, outputs=2),
                "MSAModuleStack": fake_capture(events, outputs=1)}

    def logged(method, autograd):
        def call(self, original, module, arguments):
            events.clear()
            out = method(self, original, module, arguments)
            log.append((type(module).__name__, id(module), autograd,
                        tuple(events) or ("call",)))
            return out
        return call

    def capture(original, module, arguments):
        return captures[type(module).__name__](original, module, arguments)

    def capture_with_autograd(original, module, arguments, differentiable,
                              parameters, draws):
        assert isinstance(draws, autograd_graphs.RandomDraws)
        events.append("capture")
        return _FakeAutogradGraphs(original, module, events)

    @contextlib.contextmanager
    def recording_draws(checkpoint_hook):
        yield autograd_graphs.RandomDraws()

    monkeypatch.setattr(registry.get(NAME), "device_check", lambda: (True, "test"))
    monkeypatch.setattr(trunk_graphs, "graphable",
                        lambda arguments: arguments.get("chunk_size") is None)
    monkeypatch.setattr(trunk_graphs, "capture", capture)
    monkeypatch.setattr(trunk_graphs, "capture_with_autograd", capture_with_autograd)
    monkeypatch.setattr(autograd_graphs, "recording_draws", recording_draws)
    for method, autograd in (("call", False), ("call_with_autograd", True)):
        monkeypatch.setattr(trunk_graphs.StackGraphs, method,
                            logged(getattr(trunk_graphs.StackGraphs, method), autograd))
    return log


def _per_stack(log, autograd: bool) -> dict[tuple[str, int], list]:
    stacks: dict = {}
    for name, ident, with_autograd, events in log:
        if with_autograd == autograd:
            stacks.setdefault((name, ident), []).append(events)
    return stacks


def test_steps_capture_once_then_replay_every_cycle(kit, recorded_graphs):
    stock = _harness("cpu", on=False)
    batch = _batch(stock)
    stock_steps = [stock.step(batch) for _ in range(2)]
    assert recorded_graphs == []  # key off: never reached
    harness = _harness("cpu", on=True)
    steps = [harness.step(batch) for _ in range(2)]
    # 3 recycles: 3 cycles without autograd per step. Step 1: OF3's call, the
    # capture (then its replay), a replay; step 2: replays only (the graph
    # outlives it).
    without = _per_stack(recorded_graphs, autograd=False)
    assert sorted(name for name, _ in without) == ["MSAModuleStack", "PairFormerStack"]
    for stack, events in without.items():
        assert events == [
            ("call",), ("capture", "replay"), ("replay",),
            ("replay",), ("replay",), ("replay",),
        ], stack
    # The last cycle, with autograd, once per step (and the confidence heads'
    # pairformer): OF3's call in step 1, captured with its backward in step 2.
    with_autograd = _per_stack(recorded_graphs, autograd=True)
    assert {name for name, _ in with_autograd} == {"MSAModuleStack", "PairFormerStack"}
    for stack, events in with_autograd.items():
        assert events == [("call",), ("capture", "replay")], stack
    for kit_, stock_ in zip(steps, stock_steps, strict=True):
        assert kit_.loss == stock_.loss
        assert kit_.grad_norm == stock_.grad_norm


@pytest.mark.parametrize("offload_from_bytes", [0, 1 << 40], ids=["long", "short"])
def test_with_checkpoint_offload_calls_with_autograd_split_by_size(
    kit, recorded_graphs, monkeypatch, caplog, offload_from_bytes
):
    from of3_megafold.bench.step import TrainingStepHarness
    from of3_megafold.extensions import checkpoint_offload, trunk_graphs

    monkeypatch.setattr(registry.get(checkpoint_offload.NAME), "device_check",
                        lambda: (True, "test"))
    monkeypatch.setattr(checkpoint_offload, "OFFLOAD_DEVICES", ("cpu",))
    monkeypatch.setattr(checkpoint_offload, "MIN_BYTES", 0)
    monkeypatch.setattr(trunk_graphs, "OFFLOAD_FROM_BYTES", offload_from_bytes)
    caplog.set_level(logging.DEBUG, logger=checkpoint_offload.__name__)
    update = {"settings": {"memory": {"train": {
        FLAG: True, checkpoint_offload.FLAG: True}}}}
    harness = TrainingStepHarness("tiny", "stock", "cpu", num_recycles=1,
                                  update=update)
    for _ in range(2):
        harness.step(_batch(harness))
    moved = [r.args[1] for r in caplog.records
             if r.name == checkpoint_offload.__name__ and r.args[2] > 0]
    with_autograd = _per_stack(recorded_graphs, autograd=True)
    assert "TemplatePairBlock" in moved  # a stack the trunk graphs leave to OF3
    if offload_from_bytes:  # short: graphed, nothing of the two stacks offloaded
        assert "PairFormerBlock" not in moved and "MSAModuleBlock" not in moved
        assert {name for name, _ in with_autograd} == {
            "MSAModuleStack", "PairFormerStack"}
        for stack, events in with_autograd.items():
            assert events == [("call",), ("capture", "replay")], stack
    else:  # long: offloaded, as OF3's
        assert moved.count("PairFormerBlock") == 4  # trunk and confidence heads
        assert moved.count("MSAModuleBlock") == 2
        assert with_autograd == {}


class _Stack(torch.nn.Module):
    """A stand-in stack: ``z -> z @ w`` (any call through the cache)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, z, chunk_size=None):
        return z @ self.w


def _call(graphs, stack, z):
    with torch.no_grad():  # as the extension calls it
        return graphs.call(type(stack).forward, stack, {"z": z, "chunk_size": None})


def test_graphs_are_bounded_least_recently_used_first(monkeypatch):
    from of3_megafold.extensions import trunk_graphs

    log: list[str] = []
    monkeypatch.setattr(trunk_graphs, "capture", fake_capture(log, outputs=1))
    stack, graphs = _Stack(), trunk_graphs.StackGraphs()
    sizes = [2, 3, 4]
    for n in sizes:  # each seen, then captured
        for _ in range(2):
            _call(graphs, stack, torch.randn(n, 3))
    assert log.count("capture") == 3
    assert len(graphs.graphs) == trunk_graphs.MAX_GRAPHS == 2
    # a key's first part is the call signature: (argument name, description)
    kept = {dict(key[0][0])["z"][0][0] for key in graphs.graphs}  # z's rows
    assert kept == {3, 4}
    log.clear()
    z = torch.randn(2, 3)  # evicted: seen afresh, then captured again
    torch.testing.assert_close(_call(graphs, stack, z), z @ stack.w)
    assert log == []
    torch.testing.assert_close(_call(graphs, stack, z), z @ stack.w)
    assert log == ["capture", "replay"]


def test_seen_keys_are_bounded(monkeypatch):
    from of3_megafold.extensions import trunk_graphs

    monkeypatch.setattr(trunk_graphs, "capture", fake_capture([], outputs=1))
    stack, graphs = _Stack(), trunk_graphs.StackGraphs()
    for n in range(1, trunk_graphs.MAX_SEEN + 6):
        _call(graphs, stack, torch.randn(n, 3))
    assert len(graphs.seen) == trunk_graphs.MAX_SEEN
    assert not graphs.graphs


def test_replays_read_updated_weights_and_moved_weights_make_a_new_key(monkeypatch):
    from of3_megafold.extensions import trunk_graphs

    log: list[str] = []
    monkeypatch.setattr(trunk_graphs, "capture", fake_capture(log, outputs=1))
    stack, graphs = _Stack(), trunk_graphs.StackGraphs()
    z = torch.randn(5, 3)
    for _ in range(2):
        _call(graphs, stack, z)
    with torch.no_grad():
        stack.w.mul_(2.0)  # an optimizer step: in place
    log.clear()
    torch.testing.assert_close(_call(graphs, stack, z), z @ stack.w)
    assert log == ["replay"]
    stack.w = torch.nn.Parameter(stack.w.detach().clone())  # other memory
    log.clear()
    torch.testing.assert_close(_call(graphs, stack, z), z @ stack.w)
    assert log == []  # a new key: OF3's call


def test_a_copied_stack_starts_without_graphs(monkeypatch):
    import copy
    import pickle

    from of3_megafold.extensions import trunk_graphs

    monkeypatch.setattr(trunk_graphs, "capture", fake_capture([], outputs=1))
    stack, graphs = _Stack(), trunk_graphs.StackGraphs()
    for _ in range(2):
        _call(graphs, stack, torch.randn(4, 3))
    stack.__dict__["_megafold_trunk_graphs"] = graphs
    assert graphs.graphs
    for copied in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
        fresh = copied.__dict__["_megafold_trunk_graphs"]
        assert fresh is not graphs and not fresh.graphs and not fresh.seen


def test_a_forward_waiting_for_its_backward_and_frozen_weights_are_not_replayed(
    monkeypatch,
):
    """With autograd: OF3's call, then the capture and its replay, then replays;
    while a replay's backward is pending its graph is busy and the call runs as
    OF3's; freezing a weight makes a new key."""
    from of3_megafold.extensions import trunk_graphs
    from of3_megafold.runtime import autograd_graphs

    log: list[str] = []
    captured = []

    def capture_with_autograd(original, module, arguments, differentiable,
                              parameters, draws):
        log.append("capture")
        assert differentiable == ("z",) and parameters == (module.w,)
        captured.append(_FakeAutogradGraphs(original, module, log))
        return captured[-1]

    @contextlib.contextmanager
    def recording_draws(checkpoint_hook):
        log.append("record")
        yield autograd_graphs.RandomDraws()

    monkeypatch.setattr(trunk_graphs, "capture_with_autograd", capture_with_autograd)
    monkeypatch.setattr(autograd_graphs, "recording_draws", recording_draws)
    stack, graphs = _Stack(), trunk_graphs.StackGraphs()
    z = torch.randn(2, 3, requires_grad=True)

    def call():
        log.clear()
        out = graphs.call_with_autograd(
            type(stack).forward, stack, {"z": z, "chunk_size": None})
        torch.testing.assert_close(out, z @ stack.w)
        assert out.requires_grad
        return list(log)

    assert call() == ["record"]
    assert call() == ["capture", "replay"]
    assert call() == ["replay"]
    captured[0].waiting = True
    assert call() == []
    captured[0].waiting = False
    assert call() == ["replay"]
    stack.w.requires_grad_(False)
    assert call() == ["record"]


def test_chunks_cpu_tensors_and_offloaded_checkpoints_run_as_of3s(kit, monkeypatch):
    from openfold3.core.model.latent.pairformer import PairFormerStack

    from of3_megafold.extensions import trunk_graphs

    assert not trunk_graphs.graphable({"z": torch.ones(2), "chunk_size": None})
    if torch.cuda.is_available():
        cuda = torch.ones(2, device="cuda")
        assert trunk_graphs.graphable({"z": cuda, "chunk_size": None})
        assert not trunk_graphs.graphable({"z": cuda, "chunk_size": 4})

    reached = []
    for method in ("call", "call_with_autograd"):
        monkeypatch.setattr(trunk_graphs.StackGraphs, method,
                            lambda *a: reached.append(a))
    monkeypatch.setattr(trunk_graphs, "graphable", lambda arguments: True)
    for name in (NAME, "checkpoint_offload"):
        monkeypatch.setattr(registry.get(name), "device_check", lambda: (True, "test"))
    # one cycle, with autograd, whose checkpoints offload: offloading wins
    monkeypatch.setattr(trunk_graphs, "OFFLOAD_FROM_BYTES", 0)
    update = {"settings": {"memory": {"train": {
        FLAG: True, "use_checkpoint_offload": True}}}}
    from of3_megafold.bench.step import TrainingStepHarness

    harness = TrainingStepHarness("tiny", "stock", "cpu", num_recycles=0,
                                  update=update)
    harness.step(_batch(harness))
    assert reached == []
    stack = next(m for m in harness.model.modules() if isinstance(m, PairFormerStack))
    assert trunk_graphs.autograd_graphable(stack)
    for attribute, value in (("use_reentrant", True), ("blocks_per_ckpt", None)):
        kept = getattr(stack, attribute)
        setattr(stack, attribute, value)
        assert not trunk_graphs.autograd_graphable(stack), attribute
        setattr(stack, attribute, kept)
    stack.clear_cache_between_blocks = True
    with torch.no_grad():
        s, z = torch.randn(1, 6, 32), torch.randn(1, 6, 6, 16)
        stack.train()
        stack(s, z, torch.ones(1, 6), torch.ones(1, 6, 6))
    assert reached == []


def test_refused_with_sequence_parallelism_in_training(kit):
    from openfold3.projects.of3_all_atom.config.model_config import model_config

    config = model_config.copy_and_resolve_references()
    config.settings.memory.train[FLAG] = True
    config.settings.sequence_parallel_size = 2
    with pytest.raises(KitConfigError, match=f"{FLAG}.*sequence_parallel_size"):
        registry.get(NAME).check_config(config)
    config.settings.memory.train[FLAG] = False
    config.settings.memory.eval[FLAG] = True  # inference is never sharded
    registry.get(NAME).check_config(config)


def test_failed_capture_says_which_key_to_turn_off(kit, recorded_graphs, monkeypatch):
    from of3_megafold.extensions import trunk_graphs

    def capture(original, module, arguments):
        raise trunk_graphs.TrunkCaptureError(f"... set {FLAG}: false")

    monkeypatch.setattr(trunk_graphs, "capture", capture)
    harness = _harness("cpu", on=True)
    with pytest.raises(trunk_graphs.TrunkCaptureError, match=FLAG):
        harness.step(_batch(harness))


@gpu
def test_gpu_steps_equal_the_key_off(kit):
    """Training steps with real graphs (OF3's call, the capture, replays in the
    next step): the same losses and gradient norms as with the key off. Dropout
    runs in these cycles, so equal losses also mean equal random draws."""
    stock = _harness("cuda", on=False)
    kit_ = _harness("cuda", on=True)
    batch = _batch(stock)
    for _ in range(3):
        want, got = stock.step(batch), kit_.step(batch)
        for name, value in want.loss.items():
            assert got.loss[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)


_SYNCING_TRUNK = """
import pytest
from openfold3.core.model.latent import pairformer
from of3_megafold import activate
from of3_megafold.extensions import trunk_graphs
from tests.extensions.test_trunk_graphs import FLAG, _batch, _harness

block = pairformer.PairFormerBlock.forward

def syncing(self, s, z, *args, **kwargs):
    float(z.detach().sum())  # host sync: not allowed while capturing
    return block(self, s, z, *args, **kwargs)

activate()
pairformer.PairFormerBlock.forward = syncing
harness = _harness("cuda", on=True)
with pytest.raises(trunk_graphs.TrunkCaptureError, match=FLAG):
    harness.step(_batch(harness))
print("raised")
"""


@gpu
def test_gpu_host_sync_in_the_stack_raises_naming_the_key():
    """An op that needs the host inside the stack breaks capture: a clear error
    naming the key. In a process of its own: after a failed capture the CUDA
    generator stays in capture mode, which would fail later tests."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SYNCING_TRUNK], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-3000:]
