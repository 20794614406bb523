"""`of3-megafold predict`: the demo's model end to end on CPU, failed queries, the
overlay, the GPU-only eval defaults on a CPU, and SIGTERM."""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from of3_megafold.cli import main
from of3_megafold.demo.predict import (
    DEFAULT_QUERY_ENTRY,
    LAST_CHECKPOINT_NAME,
    RUNNER_COPY_NAME,
    demo_checkpoint,
    demo_predict_runner,
    entry_query,
)
from of3_megafold.errors import KitConfigError
from of3_megafold.inference import (
    GPU_ONLY_EVAL_FLAGS,
    switch_off_gpu_only_eval_defaults,
)

ROOT = Path(__file__).resolve().parents[2]

SHORT_PROTEIN = "MQIFVKTLTGKTITLEVEPS"


@pytest.fixture(scope="module")
def demo_run(demo_dataset, tmp_path_factory) -> Path:
    """One real demo training step into a tmp dir: its checkpoint and runner.yml."""
    from of3_megafold import activate
    from of3_megafold.demo.train import run_demo_training

    activate()  # before the function-scoped kit_active fixture: demo.yml's keys
    run_dir = tmp_path_factory.mktemp("demo-run")
    run_demo_training(
        None,
        run_dir,
        steps=1,
        accelerator="cpu",
        dataset_dir=demo_dataset,
        progress=False,
    )
    return run_dir


@pytest.fixture
def demo_cache(demo_dataset, monkeypatch):
    """The CLI finds the tmp demo set the way users' runs find theirs."""
    from of3_megafold.demo.build import CACHE_ENV_VAR

    monkeypatch.setenv(CACHE_ENV_VAR, str(demo_dataset.parent))
    return demo_dataset


def _predict(*args: str):
    return CliRunner().invoke(main, ["predict", *args], catch_exceptions=False)


def test_demo_predict_writes_mmcif_and_confidences(demo_run, demo_cache, caplog):
    import biotite.structure.io.pdbx as pdbx

    caplog.set_level(logging.WARNING, logger="of3_megafold.inference")
    out = demo_run / "predict"
    result = _predict("--demo-dir", str(demo_run), "--num-diffusion-samples", "1")

    assert result.exit_code == 0, result.output
    assert "Demo prediction: 1 of 1 queries predicted" in result.output
    assert str(out) in result.output
    seed_dir = out / DEFAULT_QUERY_ENTRY / "seed_42"
    prefix = f"{DEFAULT_QUERY_ENTRY}_seed_42_sample_1"
    cif = seed_dir / f"{prefix}_model.cif"
    assert str(cif) in result.output

    sequence = entry_query(demo_cache)["queries"][DEFAULT_QUERY_ENTRY]["chains"][0][
        "sequence"
    ]
    atoms = pdbx.get_structure(pdbx.CIFFile.read(cif), model=1)
    ca = atoms[atoms.atom_name == "CA"]
    assert len(ca) == len(sequence) == 76
    assert torch.isfinite(torch.as_tensor(atoms.coord)).all()
    assert atoms.coord.std() > 1.0  # placed atoms, not a collapsed point

    confidences = json.loads((seed_dir / f"{prefix}_confidences.json").read_text())
    assert len(confidences["plddt"]) == len(atoms)
    aggregated = json.loads(
        (seed_dir / f"{prefix}_confidences_aggregated.json").read_text()
    )
    assert math.isfinite(aggregated["avg_plddt"])

    # The resolved inference YAML: the checkpoint and the trained model's settings.
    runner = yaml.safe_load((out / RUNNER_COPY_NAME).read_text())
    trained = yaml.safe_load((demo_run / "runner.yml").read_text())
    assert runner["inference_ckpt_path"] == str(
        demo_run / "checkpoints" / LAST_CHECKPOINT_NAME
    )
    assert runner["model_update"]["presets"] == ["predict"]
    assert runner["model_update"]["custom"] == trained["model_update"]["custom"]
    assert runner["experiment_settings"]["use_msa_server"] is False
    assert runner["experiment_settings"]["use_templates"] is False

    switched = [r for r in caplog.records if "GPU-only eval" in r.getMessage()]
    if torch.cuda.is_available():
        assert switched == []
    else:
        assert len(switched) == 1
        assert "use_triton_triangle_kernels" in switched[0].getMessage()


def test_without_a_demo_training_it_says_to_train_first(tmp_path):
    demo_dir = tmp_path / "no-demo"
    result = _predict("--demo-dir", str(demo_dir))

    assert result.exit_code == 1
    assert "Error:" in result.output and "of3-megafold train" in result.output
    assert not demo_dir.exists()


def test_a_failed_query_fails_the_run_and_is_named(demo_run, demo_cache, tmp_path):
    """The general path (--runner-yaml) with an overlay; one query of two fails in
    OF3's data pipeline (a SMILES RDKit cannot parse)."""
    checkpoint, trained_yaml = demo_checkpoint(demo_run)
    runner = demo_predict_runner(
        trained_yaml, demo_cache, tmp_path / "unused", accelerator="cpu"
    )
    runner["inference_ckpt_path"] = str(checkpoint)
    runner_yaml = tmp_path / "runner.yml"
    runner_yaml.write_text(yaml.safe_dump(runner))
    query_json = tmp_path / "queries.json"
    query_json.write_text(
        json.dumps(
            {
                "queries": {
                    "good": {
                        "chains": [
                            {
                                "molecule_type": "protein",
                                "chain_ids": ["A"],
                                "sequence": SHORT_PROTEIN,
                            }
                        ]
                    },
                    "bad_ligand": {
                        "chains": [
                            {
                                "molecule_type": "ligand",
                                "chain_ids": ["A"],
                                "smiles": "C1CC(N)((",
                            }
                        ]
                    },
                }
            }
        )
    )
    overlay = tmp_path / "overlay.yml"
    overlay.write_text(
        yaml.safe_dump({"output_writer_settings": {"structure_format": "pdb"}})
    )
    out = tmp_path / "out"

    result = _predict(
        "--runner-yaml",
        str(runner_yaml),
        "--overlay",
        str(overlay),
        "--query-json",
        str(query_json),
        "--output-dir",
        str(out),
        "--num-diffusion-samples",
        "1",
    )

    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: 1 of 2 queries failed: bad_ligand (")
    assert "good" not in error
    # The good query was written, in the overlay's format.
    assert (out / "good" / "seed_42" / "good_seed_42_sample_1_model.pdb").is_file()
    assert not list((out / "good").glob("seed_42/*.cif"))


def test_a_bad_overlay_value_is_one_error_before_anything_is_written(
    demo_run, demo_cache, tmp_path
):
    overlay = tmp_path / "overlay.yml"
    overlay.write_text(
        yaml.safe_dump(
            {
                "model_update": {
                    "custom": {
                        "architecture": {
                            "loss_module": {
                                "diffusion": {"smooth_lddt_backend": "bal_query"}
                            }
                        }
                    }
                }
            }
        )
    )
    out = tmp_path / "out"
    result = _predict(
        "--demo-dir", str(demo_run), "--overlay", str(overlay), "--output-dir", str(out)
    )

    assert result.exit_code == 1
    assert "smooth_lddt_backend" in result.output
    assert not out.exists()


def _runner_with_eval(eval_settings: dict | None) -> dict:
    runner = {"model_update": {"presets": ["predict"], "custom": {}}}
    if eval_settings is not None:
        runner["model_update"]["custom"] = {
            "settings": {"memory": {"eval": eval_settings}}
        }
    return runner


def test_gpu_only_eval_defaults_are_switched_off_with_one_line(caplog):
    caplog.set_level(logging.WARNING, logger="of3_megafold.inference")
    runner = _runner_with_eval(None)

    assert switch_off_gpu_only_eval_defaults(runner) == ["use_triton_triangle_kernels"]
    eval_settings = runner["model_update"]["custom"]["settings"]["memory"]["eval"]
    assert eval_settings == {"use_triton_triangle_kernels": False}
    assert len(caplog.records) == 1

    # Once off, nothing more to switch or to log.
    caplog.clear()
    assert switch_off_gpu_only_eval_defaults(runner) == []
    assert caplog.records == []


@pytest.mark.parametrize("flag", GPU_ONLY_EVAL_FLAGS)
def test_a_gpu_only_kernel_asked_for_on_a_cpu_run_is_refused(flag):
    with pytest.raises(KitConfigError, match=f"eval.{flag}: true needs a CUDA GPU"):
        switch_off_gpu_only_eval_defaults(_runner_with_eval({flag: True}))


def test_sigterm_stops_a_prediction_promptly(demo_run, demo_cache, tmp_path):
    """Lightning's own SIGTERM handler only logs and runs on; the command stops."""
    if torch.cuda.is_available():
        pytest.skip("times a CPU prediction long enough to be interrupted")
    stderr_path = tmp_path / "stderr.txt"
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "of3_megafold.cli",
                "predict",
                "--demo-dir",
                str(demo_run),
                "--output-dir",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            # Lightning's seed_everything, called in OF3's predict_step: the
            # Trainer and its SIGTERM handler are up, the forward pass starts.
            while "Seed set to" not in stderr_path.read_text():
                assert process.poll() is None, stderr_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "prediction never started"
                time.sleep(0.2)
            time.sleep(1.0)  # five diffusion samples: tens of seconds on a CPU
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            returncode = process.wait(timeout=30)
            waited = time.monotonic() - sent
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    log = stderr_path.read_text()
    assert returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "Error: SIGTERM received: prediction stopped" in log
    assert waited < 10, f"took {waited:.1f} s to stop"
    assert not (out / "summary.txt").exists()  # it did not run to the end


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_raise_an_interrupt_and_the_handlers_are_restored(signum):
    from of3_megafold.inference import stop_on_signals

    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt), stop_on_signals() as received:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises as soon as Python runs again
    assert received == {"signum": signum}
    assert signal.getsignal(signum) is before


def test_sequences_make_one_query_of_protein_chains(tmp_path):
    from of3_megafold.inference import load_query_set, sequence_query

    query_set = load_query_set(sequence_query(("MKV", "GSS")))
    chains = query_set.queries["query"].chains
    assert [c.chain_ids for c in chains] == [["A"], ["B"]]
    assert [c.sequence for c in chains] == ["MKV", "GSS"]

    broken = tmp_path / "q.json"
    broken.write_text(json.dumps({"queries": {"q": {"chains": [{"chain_ids": "A"}]}}}))
    with pytest.raises(KitConfigError, match="q.json: not a valid OF3 query set"):
        load_query_set(broken)
