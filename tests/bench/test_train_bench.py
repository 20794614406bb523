"""``bench train``: OF3's training loop timed per optimizer step (tiny model, CPU)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from of3_megafold.bench import train as bench_train
from of3_megafold.bench import train_report
from of3_megafold.bench.common import read_rows
from of3_megafold.errors import KitError

PHASE_FIELDS = [f"{phase}_ms" for phase in train_report.PHASES]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, demo_dataset):
    """Three steps of the demo's tiny model through ``bench train --quick``, into a
    file that already holds another run's row (which must survive)."""
    from of3_megafold import activate

    activate()
    out_dir = tmp_path_factory.mktemp("bench-train")
    earlier = _row("kit", 48, 1, run="kit-48-earlier", loss=1.0)
    (out_dir / bench_train.JSON_NAME).write_text(json.dumps([earlier]))
    result = CliRunner().invoke(
        bench_train.train_command,
        ["--quick", "--out-dir", str(out_dir), "--dataset-dir", str(demo_dataset)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out_dir, result.output, earlier


def test_quick_run_writes_one_row_per_step(quick_run):
    out_dir, output, earlier = quick_run
    rows = read_rows(out_dir / bench_train.JSON_NAME)
    assert rows[0] == earlier, "an earlier run's rows are kept"
    new = rows[1:]
    assert [row["step"] for row in new] == [1, 2, 3]
    assert len({row["run"] for row in new}) == 1
    for row in new:
        assert row["provider"] == "stock" and row["n_token"] == 48
        for field in ("gpu", "commit", "date", "torch", "openfold3"):
            assert field in row
        # Every phase was marked, and the phases fit in the step's wall time.
        assert all(row[field] is not None and row[field] >= 0 for field in PHASE_FIELDS)
        inside = row["data_wait_ms"] + sum(row[field] for field in PHASE_FIELDS)
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert inside <= row["wall_ms"] * 1.01 + 1.0
        # The loss is OF3's logged total, and the gradient norm a real one.
        assert row["loss"] == row["losses"]["loss"]
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row["peak_gib"] is None  # no allocator statistics on the CPU
        pdb_id, _, chain = row["sample"].partition("/")
        assert pdb_id and chain, row["sample"]
    assert (out_dir / bench_train.PLOT_NAME).stat().st_size > 0
    assert "stock" in output and "kit" in output


def test_unreadable_json_is_refused_and_left_alone(tmp_path):
    out = tmp_path / bench_train.JSON_NAME
    out.write_text('[{"provider": "kit", "step": 1')  # cut off mid-write
    with pytest.raises(KitError, match="cannot be read as a list of benchmark rows"):
        bench_train.run_train_bench("stock", 48, 1, out, accelerator="cpu")
    assert out.read_text() == '[{"provider": "kit", "step": 1'


def test_bench_runner_merges_the_provider_and_the_crop(tmp_path):
    runner = bench_train.bench_runner(
        bench_train.DEFAULT_RUNNER_YAML, "stock", 768, "cpu", num_workers=2
    )
    crops = [
        dataset["config"]["crop"]["token_crop"]["token_budget"]
        for dataset in runner["dataset_configs"]["train"].values()
    ]
    assert crops == [768]
    assert runner["data_module_args"]["num_workers"] == 2
    assert runner["model_update"]["presets"] == ["train"]
    assert runner["checkpoint_config"]["every_n_epochs"] == 0
    with pytest.raises(KitError, match="unknown provider"):
        bench_train.bench_runner(bench_train.DEFAULT_RUNNER_YAML, "fast", 384, "cpu")
    with pytest.raises(KitError, match="unavailable"):  # OF3's Triton kernel: CUDA
        bench_train.bench_runner(
            bench_train.DEFAULT_RUNNER_YAML, "stock-triton", 384, "cpu"
        )
    tf32 = bench_train.bench_runner(  # TF32 is the run's precision, not a key
        bench_train.DEFAULT_RUNNER_YAML, "stock-triton-tf32", 768, "cuda"
    )
    assert tf32 == bench_train.bench_runner(
        bench_train.DEFAULT_RUNNER_YAML, "stock-triton", 768, "cuda"
    )
    with pytest.raises(KitError, match="TF32 matmuls need a CUDA device"):
        bench_train.bench_runner(
            bench_train.DEFAULT_RUNNER_YAML, "kit-tf32", 384, "cpu"
        )


# -- summaries on synthetic rows ---------------------------------------------------


def _row(provider, n_token, step, *, run=None, label=None, date="2026-01-01", **fields):
    row = {
        "provider": provider,
        "label": label,
        "n_token": n_token,
        "step": step,
        "run": run or f"{provider}-{label}-{n_token}-{date}",
        "date": date,
        "gpu": "test GPU",
        "wall_ms": 1000.0,
        "data_wait_ms": 0.0,
        "forward_ms": 300.0,
        "backward_ms": 500.0,
        "clip_ms": 20.0,
        "optimizer_ms": 50.0,
        "ema_ms": 30.0,
        "peak_gib": 10.0,
        "loss": 2.0,
        "grad_norm": 1.0,
    }
    row.update(fields)
    return row


def test_moving_average_is_a_trailing_mean():
    assert train_report.moving_average([1, 2, 3, 4], window=2) == [1, 1.5, 2.5, 3.5]
    assert train_report.moving_average([4.0], window=10) == [4.0]


def test_max_relative_gap_compares_smoothed_curves_after_the_warm_up():
    steps = range(1, 21)
    reference = [_row("stock-triton", 384, s, loss=2.0) for s in steps]
    # A 50% outlier at step 3 is excluded (step <= 10); one at step 15 is smoothed
    # over 10 steps to 5%.
    kit = [
        _row("kit", 384, s, loss=3.0 if s == 3 else 3.0 if s == 15 else 2.0)
        for s in steps
    ]
    gap = train_report.max_relative_gap(kit, reference, "loss")
    assert gap == pytest.approx(0.05)
    assert train_report.max_relative_gap(kit[:5], reference[10:], "loss") is None


def test_steady_summary_counts_from_the_steady_step():
    rows = [_row("kit", 384, 1, wall_ms=60_000.0, data_wait_ms=50_000.0)]
    rows += [_row("kit", 384, s, wall_ms=1000.0 + s) for s in range(2, 12)]
    summary = train_report.steady_summary(rows)
    assert summary["steps"] == 12 - train_report.STEADY_FROM
    assert summary["median_ms"] == pytest.approx(1008.5)
    shares = summary["shares"]
    assert shares["data_wait"] == 0.0
    assert shares["forward_backward"] == pytest.approx(
        800 * 6 / sum(1000.0 + s for s in range(6, 12))
    )
    assert sum(shares.values()) == pytest.approx(1.0)


def test_latest_runs_and_summary_table(tmp_path):
    old = [_row("stock-triton", 384, s, date="2026-01-01", loss=9.0) for s in (1, 2)]
    new = [_row("stock-triton", 384, s, date="2026-02-01") for s in range(1, 13)]
    kit = [_row("kit", 384, s, loss=2.02, wall_ms=500.0) for s in range(1, 13)]
    # Steps stock did not run: in the kit's median, not in its speed-up.
    kit += [_row("kit", 384, s, loss=2.02, wall_ms=100.0) for s in range(13, 21)]
    repeat = [_row("stock-triton", 384, s, label="repeat") for s in range(1, 13)]
    rows = old + new + kit + repeat
    runs = train_report.latest_runs(rows)
    assert runs[("stock-triton", None, 384)][0]["date"] == "2026-02-01"
    for row in kit + new:
        row["input_digest"] = f"digest-{row['step']}"
    kit[3]["input_digest"] = "another"
    table = train_report.format_summary(rows)
    kit_line = next(line for line in table.splitlines() if line.startswith("kit"))
    name, tokens, steps, median, faster = kit_line.split()[:5]
    assert (steps, median, faster) == ("20", "0.10", "2.00x")  # 6-20; shared 6-12
    assert "1.0%" in kit_line  # the loss gap
    assert kit_line.split()[-1] == "11/12"  # steps with the same inputs
    assert train_report.speedup(kit, old) is None  # no steady step shared
    path = train_report.plot_runs(rows, tmp_path / "plot.png")
    assert path.stat().st_size > 0


def test_a_shorter_repeat_in_the_same_process_trains_on_the_same_samples(
    tmp_path, demo_dataset
):
    """``bench train`` runs providers in turn in one process: a second run with the
    same seeds must see the same samples, in the same order, and (same provider,
    same weights) the same losses, so that runs compare step by step; a shorter
    run (a repeat over fewer steps) sees the first part of the same sequence."""
    from of3_megafold import activate
    from of3_megafold.demo.train import DEFAULT_RUNNER_YAML

    activate()
    out = tmp_path / bench_train.JSON_NAME
    runs = [
        bench_train.run_train_bench(
            "stock",
            48,
            steps,
            out,
            runner_yaml=DEFAULT_RUNNER_YAML,
            label=label,
            dataset_dir=demo_dataset,
            accelerator="cpu",
        )
        for label, steps in (("", 3), ("repeat", 2))
    ]
    fields = ("sample", "input_digest", "rng_digest", "loss")
    first, repeat = ([tuple(row[f] for f in fields) for row in rows] for rows in runs)
    assert len(first) == 3 and len({row[1] for row in first}) == 3
    assert repeat == first[:2]


def test_a_run_cut_short_continues_from_its_checkpoint(tmp_path, demo_dataset):
    """A run stopped by its time budget leaves a checkpoint in ``resume_dir``; the
    next call continues it. The two parts' steps equal an uninterrupted run's
    (samples, input and random-state digests, losses, gradient norms) and share
    one run id; the finished run leaves no checkpoint behind."""
    from of3_megafold import activate
    from of3_megafold.demo.train import DEFAULT_RUNNER_YAML

    activate()
    out = tmp_path / bench_train.JSON_NAME
    resume_dir = tmp_path / "resume"

    def run(label, steps=3, **options):
        return bench_train.run_train_bench(
            "stock",
            48,
            steps,
            out,
            runner_yaml=DEFAULT_RUNNER_YAML,
            label=label,
            dataset_dir=demo_dataset,
            accelerator="cpu",
            **options,
        )

    whole = run("whole")
    first = run("parts", max_seconds=0, resume_dir=resume_dir)
    assert [row["step"] for row in first] == [1]
    checkpoint = resume_dir / "stock-parts-48.ckpt"
    state = bench_train.read_resume_state(checkpoint)
    assert state == {"run": first[0]["run"], "step": 1, "steps": 3}
    with pytest.raises(KitError, match="--steps 3"):
        run("parts", steps=2, resume_dir=resume_dir)
    rest = run("parts", resume_dir=resume_dir)
    assert [row["step"] for row in rest] == [2, 3]
    assert {row["run"] for row in first + rest} == {first[0]["run"]}
    fields = ("sample", "input_digest", "rng_digest", "loss", "grad_norm")
    assert [tuple(row[f] for f in fields) for row in first + rest] == [
        tuple(row[f] for f in fields) for row in whole
    ]
    assert list(resume_dir.iterdir()) == []


def test_a_resume_record_that_cannot_be_read_is_named(tmp_path):
    checkpoint = tmp_path / "kit-384.ckpt"
    assert bench_train.read_resume_state(checkpoint) is None
    checkpoint.write_bytes(b"weights")
    with pytest.raises(KitError, match="kit-384.json"):
        bench_train.read_resume_state(checkpoint)


def test_the_kit_s_foreach_clipping_records_the_unclipped_norm(tmp_path, demo_dataset):
    """With ``use_foreach_loop`` the kit clips with its own norm; the rows still
    hold the unclipped norm OF3's clipping computes, and the same losses. The
    clipping limit is lowered to 1 so that every step is clipped."""
    import yaml

    from of3_megafold import activate
    from of3_megafold.demo.train import DEFAULT_RUNNER_YAML

    activate()
    runner = yaml.safe_load(DEFAULT_RUNNER_YAML.read_text())
    custom = runner.setdefault("model_update", {}).setdefault("custom", {})
    custom["settings"] = {"gradient_clipping": {"clip_val": 1.0}}
    clipped_yaml = tmp_path / "clipped.yml"
    clipped_yaml.write_text(yaml.safe_dump(runner))
    custom["settings"]["memory"] = {"train": {"use_foreach_loop": True}}
    foreach_yaml = tmp_path / "foreach.yml"
    foreach_yaml.write_text(yaml.safe_dump(runner))
    out = tmp_path / bench_train.JSON_NAME
    stock, foreach = (
        bench_train.run_train_bench(
            "stock",
            48,
            3,
            out,
            runner_yaml=path,
            label=label,
            dataset_dir=demo_dataset,
            accelerator="cpu",
        )
        for path, label in ((clipped_yaml, ""), (foreach_yaml, "foreach"))
    )
    assert min(row["grad_norm"] for row in stock) > 1.0  # every step was clipped
    for a, b in zip(stock, foreach, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_batch_digest_follows_every_tensor_and_nothing_else():
    import torch

    batch = {
        "a": torch.arange(6.0).reshape(2, 3),
        "nested": {"b": torch.tensor([1, 2, 3]), "list": [torch.ones(2)]},
        "pdb_id": ["1abc"],
    }
    digest = bench_train.batch_digest(batch)
    assert len(digest) == 12
    copy = {
        "pdb_id": ["1abc"],
        "nested": {"list": [torch.ones(2)], "b": torch.tensor([1, 2, 3])},
        "a": torch.arange(6.0).reshape(2, 3),
    }
    assert bench_train.batch_digest(copy) == digest  # key order does not matter
    changed = [
        (
            "a",
            torch.arange(6.0)
            .reshape(2, 3)
            .index_put_((torch.tensor(1),), torch.tensor(9.0)),
        ),
        ("a", torch.arange(6.0).reshape(3, 2)),  # same values, another shape
        ("pdb_id", ["1abd"]),
    ]
    for key, value in changed:
        assert bench_train.batch_digest({**batch, key: value}) != digest, key
    inner = {**batch, "nested": {**batch["nested"], "list": [torch.ones(2) * 2]}}
    assert bench_train.batch_digest(inner) != digest


def test_step_seeds_make_each_step_draw_the_same_numbers():
    """A provider that draws more random numbers in one step (another kernel order)
    meets the same draws at the next step, and the digest tells the two apart."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import torch

    seeds = bench_train.StepSeeds(42)

    def step(global_step, extra_draws):
        seeds.on_train_batch_start(
            SimpleNamespace(global_step=global_step), None, None, 0
        )
        draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
        torch.rand(extra_draws)
        return draws, bench_train.rng_digest()

    (a1, end_a), (a2, _) = step(0, 0), step(1, 0)
    (b1, end_b), (b2, _) = step(0, 5), step(1, 0)
    assert a1 == b1 and a2 == b2
    assert a1 != a2  # each step its own seed
    assert end_a != end_b


def test_full_model_run_refuses_a_machine_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU only")
    result = CliRunner().invoke(bench_train.train_command, ["--out-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--quick" in result.output.splitlines()[-1]
    assert not any(tmp_path.iterdir())
