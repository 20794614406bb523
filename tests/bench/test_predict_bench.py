"""``bench predict``: OF3's inference per provider (tiny model, CPU) and the walk
to the largest query."""

from __future__ import annotations

import pytest
import torch
import yaml
from click.testing import CliRunner

from of3_megafold.bench import predict as bench_predict
from of3_megafold.bench.common import read_rows
from of3_megafold.errors import KitError

FEW_ROLLOUT_STEPS = {
    "architecture": {
        "shared": {
            "diffusion": {"no_full_rollout_steps": 4, "no_full_rollout_samples": 2}
        }
    }
}


def test_the_kit_predicts_with_the_eval_keys_of_all_on():
    overlay = yaml.safe_load(bench_predict.ALL_ON_YAML.read_text())
    eval_flags = overlay["model_update"]["custom"]["settings"]["memory"]["eval"]
    update = bench_predict.predict_update("kit")
    assert update == {"settings": {"memory": {"eval": eval_flags}}}
    assert eval_flags["use_evoflash_attention"] is True
    triton = bench_predict.predict_update("stock-triton")["settings"]["memory"]
    assert triton["eval"]["use_triton_triangle_kernels"] is True
    with pytest.raises(KitError, match="unknown provider"):
        bench_predict.predict_update("fast")


def _oom(n):
    raise torch.cuda.OutOfMemoryError(
        f"CUDA out of memory at {n}. Tried to allocate 3.28 GiB. Of the allocated "
        "memory 70.3 GiB is allocated by PyTorch, and 6.2 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def test_no_output_layer_is_left_at_zero_and_the_draw_is_seeded():
    """OF3's zero-initialised output layers would make the predicted atoms depend
    on the noise alone; the predictor draws them, the same for every provider."""
    predictor = bench_predict.Predictor("stock", "cpu", "tiny", FEW_ROLLOUT_STEPS)
    model = predictor.model
    weights = dict(model.named_parameters())
    assert all(w.any() for w in weights.values() if w.dim() >= 2)
    again = bench_predict.Predictor("stock", "cpu", "tiny", FEW_ROLLOUT_STEPS)
    for name, weight in again.model.named_parameters():
        assert torch.equal(weight, weights[name]), name
    # A fresh OF3 model has zero output layers, and these are among them.
    from openfold3.projects.of3_all_atom.model import OpenFold3

    fresh = OpenFold3(predictor.config)
    drawn = bench_predict.randomize_zero_weights(fresh, bench_predict.SEED)
    assert any(name.startswith("diffusion_module.") for name in drawn)
    assert any("plddt" in name or "pae" in name for name in drawn), drawn


def test_the_drawn_layers_have_the_output_gain():
    """The zero layers are drawn at ``gain / sqrt(fan_in)``, OUTPUT_GAIN by default."""
    layer = torch.nn.Linear(256, 128, bias=False)
    torch.nn.init.zeros_(layer.weight)
    assert bench_predict.randomize_zero_weights(layer, 0, gain=0.5) == ["weight"]
    assert layer.weight.std().item() == pytest.approx(0.5 / 256**0.5, rel=0.02)
    torch.nn.init.zeros_(layer.weight)
    bench_predict.randomize_zero_weights(layer, 0)
    expected = bench_predict.OUTPUT_GAIN / 256**0.5
    assert layer.weight.std().item() == pytest.approx(expected, rel=0.02)
    # A weight that is not all zero is left as it is.
    before = layer.weight.clone()
    assert bench_predict.randomize_zero_weights(layer, 1) == []
    assert torch.equal(layer.weight, before)


def test_walk_ladder_stops_at_the_first_out_of_memory():
    tried = []

    def attempt(n):
        tried.append(n)
        return _oom(n) if n >= 3000 else 1.0

    outcomes = list(bench_predict.walk_ladder(attempt, [4000, 1000, 2000, 3000], 1e9))
    assert [(o["n_token"], o["status"]) for o in outcomes] == [
        (1000, "ok"),
        (2000, "ok"),
        (3000, "oom"),
    ]
    assert tried == [1000, 2000, 3000]  # nothing after the first failure
    # The out-of-memory row keeps torch's account, without its advice, and the
    # innermost frame of the kit's (or OF3's) code that asked for the memory (the
    # test's own frames are neither).
    oom = outcomes[-1]
    assert oom["oom_message"].startswith("CUDA out of memory at 3000. Tried to")
    assert oom["oom_message"].endswith("reserved by PyTorch but unallocated.")
    assert "expandable_segments" not in oom["oom_message"]
    assert oom["oom_raised_in"] == "predict.walk_ladder"


def test_walk_ladder_skips_a_size_predicted_to_overrun_the_budget():
    outcomes = list(
        bench_predict.walk_ladder(lambda n: 10.0, [1000, 2000], 60.0, last=(500, 10.0))
    )
    # 1000 tokens: 10 s * 2^3 = 80 s predicted > 60 s of budget.
    assert len(outcomes) == 1 and outcomes[0]["status"] == "skipped"
    assert "predicted 80 s" in outcomes[0]["reason"]


def test_walk_ladder_passes_other_errors_on():
    def attempt(n):
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError, match="not a memory problem"):
        list(bench_predict.walk_ladder(attempt, [1000], 1e9))


def test_two_runs_of_one_provider_predict_the_same(tmp_path):
    """Same weights, same query, reseeded noise: the second provider's outputs are
    compared with the first's, here identical."""
    out = tmp_path / bench_predict.JSON_NAME
    rows = bench_predict.run_predict_bench(
        ["stock", "stock"],
        [16],
        out,
        device="cpu",
        config="tiny",
        update=FEW_ROLLOUT_STEPS,
    )
    assert [row["status"] for row in rows] == ["ok", "ok"]
    assert "si_rel_diff" not in rows[0]
    assert rows[1]["si_rel_diff"] == 0.0 and rows[1]["positions_rms_a"] == 0.0
    assert all(row["ms"] > 0 and row["peak_gib"] is None for row in rows)
    assert read_rows(out) == rows


def test_the_ladder_predicts_with_fewer_rollout_steps_recycles_and_blocks(
    tmp_path, monkeypatch
):
    """Ladder rows roll out ``ladder_rollout_steps`` steps, run ``ladder_recycles``
    recycles and the first ``ladder_pairformer_blocks`` blocks (recorded as they
    run); the fixed sizes keep the config's counts, and the model has them back,
    every block in place, after the walk."""
    out = tmp_path / bench_predict.JSON_NAME
    predictors = []
    blocks_run = []

    class Recorded(bench_predict.Predictor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            predictors.append(self)
            self.blocks_run = []
            self.every_block = list(self.model.pairformer_stack.blocks)
            for index, block in enumerate(self.every_block):
                block.register_forward_hook(
                    lambda *_, index=index: blocks_run.append(index)
                )

        def predict(self, batch):
            blocks_run.clear()
            prediction = super().predict(batch)
            self.blocks_run.append(set(blocks_run))
            return prediction

        def close(self):
            stack = self.model.pairformer_stack
            self.after = (self.rollout_steps, self.recycles, list(stack.blocks))
            super().close()

    monkeypatch.setattr(bench_predict, "Predictor", Recorded)
    rows = bench_predict.run_predict_bench(
        ["stock"],
        [16],
        out,
        ladder=[24, 32],
        ladder_rollout_steps=2,
        ladder_recycles=0,
        ladder_pairformer_blocks=1,
        device="cpu",
        config="tiny",
        update={
            "architecture": {
                **FEW_ROLLOUT_STEPS["architecture"],
                "pairformer": {"no_blocks": 2},
            }
        },
    )
    recycles, blocks = rows[0]["recycles"], rows[0]["pairformer_blocks"]
    assert recycles > 0 and blocks == 2
    assert [
        (
            r["n_token"],
            r.get("ladder", False),
            r["rollout_steps"],
            r["recycles"],
            r["pairformer_blocks"],
        )
        for r in rows
    ] == [
        (16, False, 4, recycles, blocks),
        (24, True, 2, 0, 1),
        (32, True, 2, 0, 1),
    ]
    assert all(row["status"] == "ok" for row in rows)
    assert "largest: 32" in bench_predict.format_summary(rows)
    predictor = predictors[0]
    # warm-up and timed call at 16 tokens, then one call per rung
    assert predictor.blocks_run == [{0, 1}, {0, 1}, {0}, {0}]
    assert predictor.after == (4, recycles, predictor.every_block)


def test_an_out_of_memory_rung_is_a_row_with_its_account_and_settings(
    tmp_path, monkeypatch
):
    """The rung that runs out of memory is written like the others (its rollout
    steps, recycles and blocks) with torch's account of the failure, and ends the
    walk."""

    class OutOfMemoryAt32(bench_predict.Predictor):
        def predict(self, batch):
            if batch["token_mask"].shape[-1] == 32:
                _oom(32)
            return super().predict(batch)

    monkeypatch.setattr(bench_predict, "Predictor", OutOfMemoryAt32)
    out = tmp_path / bench_predict.JSON_NAME
    rows = bench_predict.run_predict_bench(
        ["stock"],
        [],
        out,
        ladder=[24, 32, 40],
        ladder_rollout_steps=2,
        ladder_pairformer_blocks=1,
        device="cpu",
        config="tiny",
        update=FEW_ROLLOUT_STEPS,
    )
    assert read_rows(out) == rows
    assert [(r["n_token"], r["status"]) for r in rows] == [(24, "ok"), (32, "oom")]
    oom = rows[-1]
    settings = oom["rollout_steps"], oom["recycles"], oom["pairformer_blocks"]
    assert settings == (2, 0, 1)
    assert oom["ladder"] is True
    assert oom["oom_message"].startswith("CUDA out of memory at 32.")
    # the innermost frame of the kit's code (the test's own frames are not)
    assert oom["oom_raised_in"] == "predict.timed"
    assert "32: oom (in predict.timed)" in bench_predict.format_summary(rows)


def test_ladder_pairformer_blocks_beyond_the_stack_are_refused_first(tmp_path):
    """More blocks than the stack has: one error before any prediction."""
    out = tmp_path / bench_predict.JSON_NAME
    with pytest.raises(KitError, match="ladder-pairformer-blocks 99"):
        bench_predict.run_predict_bench(
            ["stock"],
            [16],
            out,
            ladder=[24],
            ladder_pairformer_blocks=99,
            device="cpu",
            config="tiny",
            update=FEW_ROLLOUT_STEPS,
        )
    assert not out.exists()


def test_quick_command_writes_rows_and_a_summary(tmp_path):
    (tmp_path / bench_predict.JSON_NAME).write_text("[]")
    result = CliRunner().invoke(
        bench_predict.predict_command,
        ["--quick", "--out-dir", str(tmp_path)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / bench_predict.JSON_NAME)
    assert [(row["provider"], row["n_token"]) for row in rows] == [
        ("stock", 16),
        ("stock", 24),
    ]
    for field in ("gpu", "commit", "date", "torch", "openfold3"):
        assert field in rows[0]
    assert rows[0]["weights"] == "random-outputs"
    assert rows[0]["output_gain"] == bench_predict.OUTPUT_GAIN
    assert "provider" in result.output and "stock" in result.output


def test_an_unreadable_json_is_refused(tmp_path):
    (tmp_path / bench_predict.JSON_NAME).write_text('[{"provider": "kit"')
    result = CliRunner().invoke(
        bench_predict.predict_command, ["--quick", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code != 0
    assert "cannot be read as a list of benchmark rows" in result.output
