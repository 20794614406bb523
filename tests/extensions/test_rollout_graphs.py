"""Rollout graphs: OF3's rollout replays its diffusion module, or the module's token
transformer, from a CUDA graph.

On the CPU the graph is stood in for by a recording of the call that re-runs it on
its static input buffers at every replay: that checks the session logic (which call
runs as OF3's, which is captured, which replays, what the buffers receive) inside a
real OF3 training step. The GPU tests capture real graphs and compare a training
step with the key on and off.
"""

from __future__ import annotations

import pytest
import torch

from of3_megafold import registry
from tests.extensions.conftest import fake_capture

NAME = "rollout_graphs"
FLAG = "use_rollout_cuda_graphs"
SYNC_FREE = "use_sync_free_indexing"
SYNC_FREE_NAME = "sync_free_indexing"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _harness(device: str, on: bool, steps: int = 6, sync_free: bool = False):
    """The tiny model with the key ``on`` or off; ``sync_free`` turns on
    sync-free indexing, with which the rollout graphs whole diffusion-module calls."""
    from of3_megafold.bench.step import TrainingStepHarness

    update = {
        "architecture": {"shared": {"diffusion": {"no_mini_rollout_steps": steps}}},
        "settings": {"memory": {"train": {FLAG: on, SYNC_FREE: sync_free}}},
    }
    return TrainingStepHarness("tiny", "stock", device, num_recycles=1, update=update)


def _step(harness, n_token: int = 24):
    from of3_megafold.bench.step import random_training_batch

    return harness.step(random_training_batch(n_token, 8, 2, harness.device))


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Graph every CPU call of the rollout's scope through a fake graph; the value
    lists what happened, call by call ("call <module class>", "capture",
    "replay")."""
    from of3_megafold.extensions import rollout_graphs

    log: list[str] = []
    original_call = rollout_graphs._RolloutGraphs.call

    def call(self, original, module, arguments, constants=frozenset()):
        log.append(f"call {type(module).__name__}")
        return original_call(self, original, module, arguments, constants)

    monkeypatch.setattr(registry.get(NAME), "device_check", lambda: (True, "test"))
    monkeypatch.setattr(rollout_graphs, "graphable", lambda a: True)
    monkeypatch.setattr(rollout_graphs, "capture", fake_capture(log, outputs=1))
    monkeypatch.setattr(rollout_graphs._RolloutGraphs, "call", call)
    return log


def _session_log(scope: str) -> list[str]:
    """6 rollout steps: OF3's call, the capture (then its replay), 4 replays."""
    call = f"call {scope}"
    return [call, call, "capture", "replay"] + [call, "replay"] * 4


def test_session_captures_the_second_call_and_replays_the_rest(
    kit, recorded_graphs, caplog
):
    from of3_megafold.extensions import rollout_graphs

    rollout_graphs._say_scope.cache_clear()
    stock = _step(_harness("cpu", on=False))
    assert recorded_graphs == []  # key off: never reached
    with caplog.at_level("INFO", logger=rollout_graphs.__name__):
        kit_ = _step(_harness("cpu", on=True))
        _step(_harness("cpu", on=True))
    # without sync-free indexing the atom encoder synchronises: the transformer only
    assert recorded_graphs == _session_log("DiffusionTransformer") * 2
    assert kit_.loss == stock.loss
    assert kit_.grad_norm == stock.grad_norm
    # ... and the user is told why, once per process
    said = [r.getMessage() for r in caplog.records if "token transformer only" in
            r.getMessage()]
    assert said == [
        f"{NAME}: graphing the rollout's token transformer only, not the whole "
        f"diffusion module: {SYNC_FREE} is off"
    ]


def test_with_sync_free_indexing_the_whole_module_is_graphed(kit, recorded_graphs):
    stock = _step(_harness("cpu", on=False, sync_free=True))
    kit_ = _step(_harness("cpu", on=True, sync_free=True))
    # the token transformer's calls happen inside the module's graph, not graphed
    # on their own
    assert recorded_graphs == _session_log("DiffusionModule")
    assert kit_.loss == stock.loss
    assert kit_.grad_norm == stock.grad_norm


def test_a_whole_module_graph_reads_the_rollouts_constants_in_place(
    kit, recorded_graphs, monkeypatch
):
    """The graph copies in only what changes between rollout steps, keeps the
    constant arguments and the broadcast layouts the call took from sync-free
    indexing's cache alive, and the captured call stops the host nowhere (the
    condition for capture on the GPU, where it would fail)."""
    from of3_megafold.extensions import rollout_graphs
    from tests.extensions.test_sync_free_indexing import _SyncingOps

    fake = rollout_graphs.capture
    captured = []

    def capture(original, module, arguments, constants=frozenset()):
        with torch.no_grad(), _SyncingOps() as syncing:
            original(module, **arguments)
        graphed = fake(original, module, arguments, constants)
        captured.append((syncing.sites, graphed))
        return graphed

    monkeypatch.setattr(rollout_graphs, "capture", capture)
    _step(_harness("cpu", on=True, sync_free=True))
    [(sites, graphed)] = captured
    # one_hot checks its class values on the host on the CPU only (on CUDA it
    # leaves them to the scatter's device asserts)
    assert {function for _, function in sites} <= {"binned_one_hot"}, sites
    assert set(graphed.inputs) == {"xl_noisy", "t"}
    held = [v for v in graphed.held if isinstance(v, tuple)]  # (index, n_atoms)
    assert held and all(isinstance(index, torch.Tensor) for index, _ in held)
    assert any(v is graphed.graph.arguments["batch"] for v in graphed.held)


def test_whole_module_scope_needs_a_batch_that_never_stops_the_host(kit):
    from of3_megafold.extensions import rollout_graphs

    def arguments(batch):
        return {"batch": batch, "xl_noisy": torch.zeros(1, 4, 3)}

    linear = {"token_mask": torch.ones(1, 3), "cyclic_mask": torch.zeros(1, 3).bool()}
    cyclic = {**linear, "cyclic_mask": torch.tensor([[True, False, False]])}
    with torch.inference_mode():
        inference = {k: v.clone() for k, v in linear.items()}
    registry.FORCED.variants[SYNC_FREE_NAME] = ""
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(rollout_graphs, "graphable", lambda a: True)
            why = rollout_graphs.why_not_whole_module
            assert why(arguments(linear)) is None
            assert why(arguments({"token_mask": linear["token_mask"]})) is None
            assert why(arguments(cyclic)) == "a chain is cyclic"
            assert why(arguments(inference)) == (
                "the batch was made under torch.inference_mode"
            )
        assert rollout_graphs.why_not_whole_module(arguments(linear)) == (
            "its tensors are not on a CUDA device"
        ) == rollout_graphs.NOT_ON_CUDA
    finally:
        registry.FORCED.variants.pop(SYNC_FREE_NAME, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_graphs, "graphable", lambda a: True)
        assert rollout_graphs.why_not_whole_module(arguments(linear)) == (
            f"{SYNC_FREE} is off"
        )


def test_a_denoiser_without_a_token_transformer_runs_as_of3s(kit):
    """OF3's sampler takes any denoiser module (its own tests pass stand-ins)."""
    from openfold3.core.model.structure.diffusion_module import SampleDiffusion

    class Denoiser(torch.nn.Module):
        def forward(self, batch, xl_noisy, **kwargs):
            return 0.5 * xl_noisy

    sampler = SampleDiffusion(gamma_0=0.8, gamma_min=1.0, noise_scale=1.0,
                              step_scale=1.5, diffusion_module=Denoiser())
    atom_mask = torch.ones(1, 5)
    torch.manual_seed(0)
    with torch.no_grad():
        xl = sampler._sample_rollout(
            batch={"token_mask": torch.ones(1, 3)}, xl=torch.randn(1, 1, 5, 3),
            atom_mask=atom_mask, si_input=None, si_trunk=None, zij_trunk=None,
            noise_schedule=torch.linspace(2.0, 0.1, 4), start_step=0,
            use_conditioning=True,
        )
    assert xl.shape == (1, 1, 5, 3) and torch.isfinite(xl).all()


def test_failed_capture_says_which_key_to_turn_off(kit, recorded_graphs, monkeypatch):
    from of3_megafold.extensions import rollout_graphs

    def capture(original, module, arguments, constants=frozenset()):
        recorded_graphs.append("capture")
        raise rollout_graphs.RolloutCaptureError(f"... set {FLAG}: false")

    monkeypatch.setattr(rollout_graphs, "capture", capture)
    with pytest.raises(rollout_graphs.RolloutCaptureError, match=FLAG):
        _step(_harness("cpu", on=True))
    assert recorded_graphs == ["call DiffusionTransformer"] * 2 + ["capture"]


@gpu
@pytest.mark.parametrize(
    ("sync_free", "scope"),
    [(False, "DiffusionTransformer"), (True, "DiffusionModule")],
)
def test_gpu_step_equals_stock(kit, monkeypatch, sync_free, scope):
    """A training step with real graphs of the token transformer (or, with
    sync-free indexing, of the whole diffusion module): the same losses and
    gradient norm as with the key off (the same kernels replayed)."""
    from of3_megafold.extensions import rollout_graphs

    real = rollout_graphs.capture
    captured = []

    def capture(original, module, arguments, constants=frozenset()):
        captured.append(type(module).__name__)
        return real(original, module, arguments, constants)

    monkeypatch.setattr(rollout_graphs, "capture", capture)
    stock = _step(_harness("cuda", on=False, sync_free=sync_free))
    kit_ = _step(_harness("cuda", on=True, sync_free=sync_free))
    assert captured == [scope]
    for name, value in stock.loss.items():
        assert kit_.loss[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert kit_.grad_norm == pytest.approx(stock.grad_norm, rel=1e-6)


_SYNCING_ROLLOUT = """
import pytest
from openfold3.core.model.layers import diffusion_transformer
from of3_megafold import activate
from of3_megafold.extensions import rollout_graphs
from tests.extensions.test_rollout_graphs import FLAG, _harness, _step

block = diffusion_transformer.DiffusionTransformerBlock.forward

def syncing(self, a, *args, **kwargs):
    float(a.detach().sum())  # host sync: not allowed while capturing
    return block(self, a, *args, **kwargs)

activate()
diffusion_transformer.DiffusionTransformerBlock.forward = syncing
with pytest.raises(rollout_graphs.RolloutCaptureError, match=FLAG):
    _step(_harness("cuda", on=True))
print("raised")
"""


@gpu
def test_gpu_host_sync_in_the_transformer_raises_naming_the_key():
    """An op that needs the host inside the transformer breaks capture: a clear
    error naming the key. In a process of its own: after a failed capture the CUDA
    generator stays in capture mode, which would fail later tests."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SYNCING_ROLLOUT], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-3000:]
