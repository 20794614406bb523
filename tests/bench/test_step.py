"""CPU smoke tests of the training-step benchmark (tiny config, no timing checks)."""

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from of3_megafold.bench import step
from of3_megafold.bench.common import METADATA_FIELDS
from of3_megafold.bench.step import max_crop, providers
from of3_megafold.bench.step.measure import measure_step

pytestmark = pytest.mark.usefixtures("one_thread")

STEP_FIELDS = {
    "provider",
    "mode",
    "config",
    "n_token",
    "n_atom",
    "n_msa",
    "n_templ",
    "ms",
    "peak_gib",
    "launches",
    "host_launches",
    "gpu_busy_ms",
    "loss",
    "recycles",
    "oom",
}


# One tiny training step on the CPU (tests add providers, sizes, the search).
TINY_RUN = dict(n_msa=8, n_templ=2, config="tiny", repeats=1, warmup=0, device="cpu")


@pytest.fixture
def no_registry(monkeypatch):
    """Stock providers only, whatever the kit has registered by now."""
    monkeypatch.setattr(providers, "_registry_extensions", lambda: {})


def _check_loss(loss):
    assert set(loss) >= {"loss", "diffusion_loss", "smooth_lddt_loss", "mse_loss"}
    assert all(math.isfinite(value) for value in loss.values())
    assert loss["loss"] > 0
    assert loss["diffusion_loss"] > 0


def test_tiny_step_rows_are_written(tmp_path, no_registry):
    out = tmp_path / "step.json"
    rows = step.run_step_bench(
        providers=["stock"], tokens=[16], out_json=out, **TINY_RUN
    )
    assert json.loads(out.read_text()) == rows
    (row,) = rows
    assert STEP_FIELDS | set(METADATA_FIELDS) <= set(row)
    assert row["provider"] == "stock" and row["config"] == "tiny"
    assert row["mode"] == "step" and row["oom"] is False
    assert row["n_token"] == 16 and row["n_msa"] == 8 and row["n_templ"] == 2
    assert row["ms"] > 0 and math.isfinite(row["ms"])
    assert row["peak_gib"] is None and row["launches"] is None  # CPU
    assert row["host_launches"] is None and row["gpu_busy_ms"] is None
    assert row["precision"] == "fp32"
    # OF3's first training draw from its generator seeded with sync_seed 0 (which
    # happens to equal the tiny config's maximum, 3: see the test below).
    assert row["recycles"] == _first_draw(0, 3) == 3
    _check_loss(row["loss"])


@pytest.fixture(scope="module")
def tiny_harness():
    harness = step.TrainingStepHarness("tiny", "stock", "cpu")
    yield harness
    harness.close()


def _first_draw(sync_seed: int, num_recycles: int) -> int:
    """OF3's recycle draw in training (``OpenFold3.forward``), made first."""
    rng = np.random.default_rng(sync_seed)
    return int(rng.integers(low=0, high=num_recycles + 1))


def test_recycles_are_ofs_first_draw():
    """The harness reports the count OF3 drew: a sync seed whose first draw is not
    the configured maximum shows the draw happened."""
    sync_seed = next(s for s in range(1, 100) if _first_draw(s, 3) != 3)
    harness = step.TrainingStepHarness(
        "tiny",
        "stock",
        "cpu",
        update={"architecture": {"shared": {"sync_seed": sync_seed}}},
    )
    try:
        assert harness.config.architecture.shared.num_recycles == 3
        result = harness.step(step.random_training_batch(16, 8, 2))
    finally:
        harness.close()
    assert result.recycles == _first_draw(sync_seed, 3) != 3


def test_steps_are_deterministic_and_recycles_can_be_fixed(tiny_harness):
    harness = tiny_harness
    batch = step.random_training_batch(16, 8, 2)
    first = harness.step(batch)
    second = harness.step(batch)
    assert first.loss == second.loss
    assert first.grad_norm == second.grad_norm > 0
    _check_loss(first.loss)
    harness.num_recycles = 0
    fixed = harness.step(batch)
    assert fixed.recycles == 0
    assert fixed.loss != first.loss
    harness.num_recycles = 7
    with pytest.raises(ValueError, match="outside OF3's range"):
        harness.step(batch)
    harness.num_recycles = None


def test_disabled_losses_are_an_error(tiny_harness):
    """Without the token-level ground truth OF3's alignment gives up and zeroes
    every loss weight: the harness must refuse to report such a step."""
    batch = step.random_training_batch(16, 8, 2)
    for key in step.GROUND_TRUTH_TOKEN_KEYS:
        del batch["ground_truth"][key]
    with pytest.raises(step.LossesDisabledError, match="switched the losses off"):
        tiny_harness.step(batch)


def test_max_crop_searches_after_every_provider_is_timed(
    tmp_path, monkeypatch, fake_registry
):
    """Real tiny steps, except that from a per-provider size on the step raises the
    CUDA out-of-memory error, as it would on a GPU."""
    real_step = step.TrainingStepHarness.step
    limit = {"stock": 24, "chunk": 16}
    probed = []

    def step_with_memory_limit(self, batch):
        n_token = batch["token_mask"].shape[-1]
        probed.append((self.provider, n_token))
        if n_token > limit[self.provider]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(self, batch)

    monkeypatch.setattr(step.TrainingStepHarness, "step", step_with_memory_limit)
    rows = step.run_step_bench(
        providers=["stock", "chunk"],
        tokens=[16],
        out_json=tmp_path / "step.json",
        max_crop=True,
        max_crop_ladder=[16, 24, 32, 48],
        fresh_probes=False,  # the simulated limit lives in this process
        **TINY_RUN,
    )
    # Both providers timed first; then each search starts above what fitted.
    assert probed == [
        ("stock", 16),
        ("chunk", 16),
        ("stock", 24),
        ("stock", 32),
        ("chunk", 24),
    ]
    assert [(r["provider"], r["mode"], r["n_token"], r.get("oom")) for r in rows] == [
        ("stock", "step", 16, False),
        ("chunk", "step", 16, False),
        ("stock", "max_crop_probe", 24, False),
        ("stock", "max_crop_probe", 32, True),
        ("stock", "max_crop", 24, None),
        ("chunk", "max_crop_probe", 24, True),
        ("chunk", "max_crop", 16, None),
    ]
    assert rows[3]["ms"] is None
    assert {r["probe_process"] for r in rows[2:]} == {"same"}
    assert rows[4]["max_crop"] == 24
    assert rows[4]["decided"] == {"16": True, "24": True, "32": False}
    assert rows[6]["decided"] == {"16": True, "24": False}
    # Same weights and batch: the chunked provider computes the same step.
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-4)
    assert rows[1]["grad_norm"] == pytest.approx(rows[0]["grad_norm"], rel=1e-4)


def test_fresh_process_probe_computes_the_same_step(tmp_path, no_registry):
    """A probe in a spawned process builds the same weights and batch: its loss and
    gradient norm are the one-process probe's (the real tiny step, on the CPU)."""
    common = dict(
        providers=["stock"],
        tokens=[],
        out_json=tmp_path / "step.json",
        max_crop=True,
        max_crop_ladder=[24],
        **TINY_RUN,
    )
    fresh = step.run_step_bench(**common, fresh_probes=True)
    same = step.run_step_bench(**common, fresh_probes=False)
    modes = [(r["mode"], r["n_token"], r["probe_process"]) for r in fresh]
    assert modes == [("max_crop_probe", 24, "fresh"), ("max_crop", 24, "fresh")]
    assert fresh[0]["oom"] is False and fresh[1]["decided"] == {"24": True}
    assert fresh[0]["loss"] == same[0]["loss"]
    assert fresh[0]["grad_norm"] == same[0]["grad_norm"] > 0
    assert fresh[0]["params_m"] == same[0]["params_m"]


def test_fresh_probes_summary_without_a_probe(tmp_path, no_registry, monkeypatch):
    """When the timed sizes decide the whole ladder no process is started; the
    summary row still names the model."""
    monkeypatch.setattr(
        max_crop, "probe_in_fresh_process", lambda *a: pytest.fail("a probe ran")
    )
    rows = step.run_step_bench(
        providers=["stock"],
        tokens=[16],
        out_json=tmp_path / "step.json",
        max_crop=True,
        max_crop_ladder=[16],
        **TINY_RUN,
    )
    summary = rows[-1]
    assert (summary["mode"], summary["max_crop"]) == ("max_crop", 16)
    assert summary["params_m"] == rows[0]["params_m"] > 0
    assert summary["probe_process"] == "fresh"


def _exit_without_result(spec, n_token):
    """Runs in the spawned process: dies as the host's out-of-memory killer would."""
    import os

    os._exit(9)


def test_a_probe_process_that_dies_is_an_error():
    spec = max_crop.ProbeSpec("tiny", "stock", "cpu", None, 8, 2, 30)
    with pytest.raises(step.ProbeProcessDied, match="died in its process"):
        max_crop.probe_in_fresh_process(spec, 24, target=_exit_without_result)


def test_a_probe_that_dies_does_not_fit():
    """The search goes on below a probe whose process died; its row says so."""
    rows: list[dict] = []
    identity = {"provider": "kit", "config": "tiny", "no_samples": 2,
                "precision": "fp32", "params_m": 1.0}

    def measure(n_token):
        if n_token > 32:
            raise step.ProbeProcessDied(f"probe at {n_token} died")
        return identity, {"oom": False, "ms": 1.0, "loss": {"loss": 0.5}}

    max_crop.run_max_crop("kit", measure, None, "fresh", 8, 2, [16, 32, 48], 32, (),
                       (), {}, rows.append)
    assert [(r["mode"], r["n_token"], r.get("error")) for r in rows] == [
        ("max_crop_probe", 32, None),
        ("max_crop_probe", 48, "probe at 48 died"),
        ("max_crop", 32, None),
    ]
    assert rows[1]["params_m"] == 1.0 and rows[1]["oom"] is False
    assert rows[2]["decided"] == {"32": True, "48": False}


@pytest.mark.parametrize(
    ("limit", "start", "fits", "too_big", "expected", "probed"),
    [
        (1280, 1280, (), (), 1280, [1280, 1536]),
        (1280, 1536, (), (), 1280, [1536, 1280]),
        (768, 1024, (768,), (), 768, [1024]),
        (1280, 1024, (768,), (), 1280, [1024, 1280, 1536]),
        (1024, 1024, (), (1280,), 1024, [1024]),
        (200, 768, (), (), None, [768, 512, 384]),
        (4096, 1792, (), (), 2048, [1792, 2048]),
    ],
)
def test_search_max_crop(limit, start, fits, too_big, expected, probed):
    calls = []

    def probe(size):
        calls.append(size)
        return size <= limit

    largest, decided = max_crop.search_max_crop(
        probe, step.MAX_CROP_LADDER, start, fits, too_big
    )
    assert largest == expected
    assert calls == probed
    assert all(ok == (size <= limit) for size, ok in decided.items())


def test_stock_providers(no_registry):
    assert step.PROVIDERS["stock"] == {}
    assert step.available_providers("cpu") == ["stock"]
    assert step.available_providers("cuda") == ["stock", "stock-triton"]
    ok, reason = step.provider_availability("stock-triton", "cpu")
    assert not ok and "CUDA" in reason
    with pytest.raises(ValueError, match="unavailable: OF3's Triton"):
        step.provider_update("stock-triton", "cpu")
    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        step.provider_update("nope", "cpu")
    config = step.build_model_config(
        "tiny", step.provider_update("stock-triton", "cuda")
    )
    assert config.settings.memory.train.use_triton_triangle_kernels is True
    assert config.architecture.pairformer.c_s == 32
    stock = step.build_model_config("full", {})
    assert stock.settings.memory.train.use_triton_triangle_kernels is False
    assert stock.architecture.pairformer.no_blocks == 48
    assert stock.architecture.shared.diffusion.no_samples == 48
    assert stock.architecture.loss_module.diffusion.chunk_size == 4  # train preset
    with pytest.raises(KeyError):
        step.build_model_config("tiny", {"settings": {"memory": {"train": {"x": 1}}}})


class _FakeExtension:
    def __init__(self, update, ok, reason="", min_processes=1):
        self.enable_update = update
        self._available = (ok, reason)
        self.min_processes = min_processes

    def available(self):
        return self._available


@pytest.fixture
def fake_registry(monkeypatch):
    registry = types.ModuleType("of3_megafold.registry")
    registry.EXTENSIONS = {
        "lma": _FakeExtension(
            {"settings": {"memory": {"train": {"use_lma": True}}}}, True
        ),
        # A stock OF3 training setting: chunked MSA-module transitions.
        "chunk": _FakeExtension(
            {
                "settings": {
                    "memory": {"train": {"msa_module": {"swiglu_seq_chunk_size": 4}}}
                }
            },
            True,
        ),
        "broken": _FakeExtension({"settings": {}}, False, "needs a Hopper GPU"),
        # Needs several processes: never a provider of this one-process harness.
        "sharded": _FakeExtension(
            {"settings": {"memory": {"train": {"use_lma": False}}}},
            True,
            min_processes=2,
        ),
    }
    monkeypatch.setitem(sys.modules, "of3_megafold.registry", registry)
    import of3_megafold

    monkeypatch.setattr(of3_megafold, "registry", registry, raising=False)
    # The real activate() would patch OF3 for the rest of the session.
    monkeypatch.setattr(of3_megafold, "is_active", lambda: True)
    providers._registry_extensions.cache_clear()
    yield registry
    providers._registry_extensions.cache_clear()


def test_kit_providers_come_from_the_registry(fake_registry):
    updates = step.kit_provider_updates()
    assert set(updates) == {"kit", "lma", "chunk"}
    assert updates["kit"] == {
        "settings": {
            "memory": {
                "train": {"use_lma": True, "msa_module": {"swiglu_seq_chunk_size": 4}}
            }
        }
    }
    assert step.available_providers("cpu") == ["stock", "kit", "lma", "chunk"]
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        step.provider_update("broken", "cpu")
    config = step.build_model_config("tiny", step.provider_update("kit", "cpu"))
    assert config.settings.memory.train.use_lma is True
    assert config.settings.memory.train.msa_module.swiglu_seq_chunk_size == 4
    assert step.provider_update("kit-without-chunk", "cpu") == {
        "settings": {"memory": {"train": {"use_lma": True}}}
    }
    ok, reason = step.provider_availability("kit-without-broken", "cpu")
    assert not ok and "broken is unavailable" in reason
    ok, reason = step.provider_availability("kit-without-nothing", "cpu")
    assert not ok and "no kit extension 'nothing'" in reason
    # The registry's own dicts are never modified by merging.
    assert fake_registry.EXTENSIONS["lma"].enable_update == {
        "settings": {"memory": {"train": {"use_lma": True}}}
    }


def test_without_registry_only_stock_is_offered(monkeypatch):
    import of3_megafold

    monkeypatch.setitem(sys.modules, "of3_megafold.registry", None)
    monkeypatch.delattr(of3_megafold, "registry", raising=False)
    providers._registry_extensions.cache_clear()
    try:
        assert step.kit_provider_updates() == {}
        ok, reason = step.provider_availability("kit", "cpu")
        assert not ok and "registry" in reason
    finally:
        providers._registry_extensions.cache_clear()


def test_format_table_lists_every_row():
    rows = [
        {
            "provider": "stock",
            "mode": "step",
            "n_token": 384,
            "ms": 7540.0,
            "peak_gib": 16.5,
            "launches": 140409,
            "loss": {"loss": 3.2},
            "oom": False,
        },
        {
            "provider": "stock",
            "mode": "max_crop_probe",
            "n_token": 1024,
            "ms": None,
            "oom": True,
        },
        {"provider": "stock", "mode": "max_crop", "n_token": 768, "max_crop": 768},
        {
            "provider": "stock-cueq",
            "mode": "step",
            "n_token": 768,
            "ms": None,
            "oom": False,
            "error": "RuntimeError: not implemented",
        },
    ]
    table = step.format_table(rows).splitlines()
    assert len(table) == 5
    assert "7.54" in table[1] and "140409" in table[1]
    assert "OOM" in table[2]
    assert table[3].split()[-1] == "768"
    assert table[4].split()[3] == "error"


def test_step_command(tmp_path, no_registry):
    from click.testing import CliRunner

    out = tmp_path / "rows.json"
    args = "-p stock --config tiny --tokens 16 --n-msa 8 --n-templ 2 --repeats 1"
    result = CliRunner().invoke(
        step.step_command, [*args.split(), "--warmup", "0", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())
    assert row["provider"] == "stock" and row["n_token"] == 16
    assert "stock" in result.output.splitlines()[-1]


def test_rival_providers_run_only_when_named(no_registry, monkeypatch):
    from of3_megafold.bench import rivals

    assert "stock-cueq" not in step.available_providers("cuda")
    monkeypatch.setattr(rivals, "unavailable", lambda name: None)
    assert step.provider_availability("stock-cueq", "cuda") == (True, "")
    ok, reason = step.provider_availability("stock-cueq", "cpu")
    assert not ok and "CUDA" in reason
    config = step.build_model_config(
        "tiny", step.provider_update("stock-deepspeed", "cuda")
    )
    assert config.settings.memory.train.use_deepspeed_evo_attention is True
    config = step.build_model_config("tiny", step.provider_update("stock-cueq", "cuda"))
    assert config.settings.memory.train.use_cueq_triangle_kernels is True
    monkeypatch.setattr(rivals, "unavailable", lambda name: f"{name}: not installed")
    with pytest.raises(ValueError, match="cueq: not installed"):
        step.provider_update("stock-cueq", "cuda")


def test_a_tf32_suffix_is_its_provider_with_tf32_matmuls(no_registry):
    assert step.provider_update("stock-triton-tf32", "cuda") == step.provider_update(
        "stock-triton", "cuda"
    )
    assert step.provider_availability("stock-tf32", "cuda") == (True, "")
    ok, reason = step.provider_availability("stock-tf32", "cpu")
    assert not ok and "TF32 matmuls need a CUDA device" in reason
    ok, reason = step.provider_availability("kit-tf32", "cuda")
    assert not ok and "registry is not installed" in reason  # the kit's own reason
    ok, reason = step.provider_availability("nothing-tf32", "cuda")
    assert not ok and "unknown provider 'nothing'" in reason
    assert not any(name.endswith("-tf32") for name in step.available_providers("cuda"))


@pytest.fixture
def ieee_fp32_matmuls():
    """The harness's default matmul precision for the test (an OF3 run earlier in
    the process may have left its own)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def test_a_failing_rival_is_a_row_error_and_tf32_is_scoped(ieee_fp32_matmuls):
    seen = []

    class _Harness:
        provider = "stock-cueq-tf32"
        device = torch.device("cpu")
        seed = 0
        model = torch.nn.Linear(1, 1)

        def step(self, batch):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            raise RuntimeError("fp32 backward is not implemented\nmore")

    before = torch.get_float32_matmul_precision()
    assert before == "highest"  # the harness's default: IEEE fp32 matmuls
    fields = measure_step(_Harness(), 16, 4, 1, 0, 1, False)
    assert seen == [True] and torch.get_float32_matmul_precision() == before
    assert fields["error"].startswith("RuntimeError: fp32 backward")
    assert fields["ms"] is None and fields["oom"] is False
    assert fields["matmul_precision"] == "high"  # as it was while the steps ran

    _Harness.provider = "stock"  # OF3's own path: a failure is a failure
    with pytest.raises(RuntimeError, match="fp32 backward"):
        measure_step(_Harness(), 16, 4, 1, 0, 1, False)
    assert seen[-1] is False


def test_provider_model_config_merges_the_provider_then_the_update(no_registry):
    update = {"settings": {"memory": {"train": {"use_lma": True}}}}
    config = step.provider_model_config("stock-triton", "cuda", "tiny", update)
    assert config.settings.memory.train.use_triton_triangle_kernels is True
    assert config.settings.memory.train.use_lma is True
    assert config.architecture.shared.c_s == step.CONFIGS["tiny"]["architecture"][
        "shared"
    ]["c_s"]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        step.provider_model_config("stock-triton", "cpu", "tiny")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU only")
def test_full_step_bench_refuses_a_machine_without_cuda(tmp_path):
    from click.testing import CliRunner

    out = tmp_path / "rows.json"
    result = CliRunner().invoke(step.step_command, ["--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "--config tiny" in result.output.splitlines()[-1]
    assert not out.exists()
