"""``of3-megafold train`` on several CPU processes, from the runner YAML alone.

Each case runs the CLI as a user does (a subprocess, no launcher: the CLI spawns
the ranks itself, gloo), three steps of the demo on its embedded data, and
compares the ``losses.csv`` rank 0 writes, step by step, and the weights of the
last checkpoint with a run of the same demo on fewer processes:

- ``runner_yamls/sp_cpu2.yml`` (one SP group of 2) against one process;
- ``runner_yamls/sp_cpu4_dp2.yml`` (2 data-parallel replicas x SP 2) against the
  same demo on 2 data-parallel processes;
- ``runner_yamls/sp_cpu2_zero2.yml`` (SP 2 under Lightning's DeepSpeed strategy,
  ZeRO stage 2, on DeepSpeed's CPU accelerator) against one process, both with
  ``per_sample_clipping: false`` (DeepSpeed clips the averaged gradient, Lightning
  the one process's, each at ``clip_val``); the weights are read back from
  DeepSpeed's checkpoint folder with its ``zero_to_fp32`` utilities.

The two runs of a case run side by side: on 2 cores about 45 s for SP 2, 80 s
for DP 2 x SP 2 (six processes) and 90 s for SP 2 under ZeRO-2 (DeepSpeed's
engine and its checkpoint folder on top), the last two marked slow; mostly each
process's start-up.

Both runs draw the same initial weights (the demo seeds them from
``experiment_settings.seed``), the same samples (the data-parallel rank is the SP
group's) and, with the diffusion samples not split, the same random draws (the
group uses its first rank's generators), so the losses and weights agree to fp32
rounding of the sharded sums. ``clip_val`` is set below the demo's gradient norm
(about 1), so OF3's per-sample clipping clips every step, on the group's gradient.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
LOSS_RTOL = 1e-4  # per step and loss component
# Weights after the three steps, relative to each tensor's largest entry. OF3's
# Adam divides each gradient entry by its own magnitude, so fp32 rounding of
# entries near zero moves weights by more than the rounding itself (DP 2 x SP 2
# against DP 2: about 1.3e-5).
PARAM_TOL = 1e-4
CLIP = {
    "model_update": {
        "custom": {"settings": {"gradient_clipping": {"clip_val": 0.1}}}
    }
}
# OF3 hands clip_val to Lightning's gradient_clip_val ("norm") once per-sample
# clipping is off; under DeepSpeed Lightning writes it into the DeepSpeed config.
CLIP_NOT_PER_SAMPLE = {
    "model_update": {
        "custom": {
            "settings": {
                "gradient_clipping": {"clip_val": 0.1, "per_sample_clipping": False}
            }
        }
    }
}


def start_training(out: Path, cache: Path, *overlays: Path) -> subprocess.Popen:
    """``of3-megafold train --steps 3`` writing to ``out``, as a subprocess."""
    env = {
        **os.environ,
        "OF3_MEGAFOLD_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(name, None)
    args = [sys.executable, "-m", "of3_megafold.cli", "train", "--steps", str(STEPS)]
    for overlay in overlays:
        args += ["--overlay", str(overlay)]
    return subprocess.Popen(
        [*args, "--output-dir", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(run: subprocess.Popen, out: Path) -> tuple[list[dict], dict]:
    """Wait for a run; its losses and the weights of its last checkpoint."""
    _, stderr = run.communicate()
    assert run.returncode == 0, stderr[-4000:]
    with open(out / "losses.csv") as handle:
        rows = list(csv.DictReader(handle))
    return rows, checkpoint_weights(out / "checkpoints" / "last.ckpt")


def checkpoint_weights(path: Path) -> dict:
    """The module's state dict in a Lightning checkpoint: a file, or under
    DeepSpeed a folder of ZeRO partitions, assembled in fp32."""
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        return get_fp32_state_dict_from_zero_checkpoint(str(path))
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def train_both(tmp_path, cache, reference: tuple, candidate: tuple):
    """The reference and the candidate run side by side (``overlays`` each)."""
    runs = [
        (start_training(tmp_path / name, cache, *overlays), tmp_path / name)
        for name, overlays in (("reference", reference), ("candidate", candidate))
    ]
    return [finished(run, out) for run, out in runs]


def assert_same_training(got, want, what: str) -> None:
    (rows, params), (ref_rows, ref_params) = got, want
    assert len(rows) == len(ref_rows) == STEPS, what
    for row, ref in zip(rows, ref_rows, strict=True):
        assert row["pdb_id"] == ref["pdb_id"], f"{what}: samples differ"
        losses = {k: v for k, v in ref.items() if k.endswith("loss") and v}
        assert {k for k in row if k.endswith("loss") and row[k]} == set(losses)
        for name, value in losses.items():
            expected, actual = float(value), float(row[name])
            assert abs(actual - expected) <= LOSS_RTOL * abs(expected), (
                f"{what}, step {row['step']}: {name} {actual} vs {expected}"
            )
    assert params.keys() == ref_params.keys(), f"{what}: weights differ in names"
    for name, ref in ref_params.items():
        if not ref.dtype.is_floating_point:
            continue
        err = (params[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err <= PARAM_TOL, f"{what}: {name} relative error {err:.2e}"


@pytest.fixture(scope="module")
def clip_overlay(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("overlay") / "clip.yml"
    path.write_text(yaml.safe_dump(CLIP))
    return path


def test_sp2_demo_trains_as_one_process(demo_dataset, clip_overlay, tmp_path):
    one, sp2 = train_both(
        tmp_path,
        demo_dataset.parent,
        (clip_overlay,),
        (clip_overlay, REPO / "runner_yamls" / "sp_cpu2.yml"),
    )
    assert_same_training(sp2, one, "SP 2 against one process")


@pytest.mark.slow
def test_dp2_sp2_demo_trains_as_dp2(demo_dataset, clip_overlay, tmp_path):
    dp2_overlay = tmp_path / "dp2.yml"
    dp2_overlay.write_text(yaml.safe_dump({"pl_trainer_args": {"devices": 2}}))
    dp2, dp2_sp2 = train_both(
        tmp_path,
        demo_dataset.parent,
        (clip_overlay, dp2_overlay),
        (clip_overlay, REPO / "runner_yamls" / "sp_cpu4_dp2.yml"),
    )
    assert_same_training(dp2_sp2, dp2, "DP 2 x SP 2 against DP 2")


@pytest.mark.slow
def test_sp2_zero2_demo_trains_as_one_process(demo_dataset, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    clip = tmp_path / "clip.yml"
    clip.write_text(yaml.safe_dump(CLIP_NOT_PER_SAMPLE))
    one, zero2 = train_both(
        tmp_path,
        demo_dataset.parent,
        (clip,),
        (clip, REPO / "runner_yamls" / "sp_cpu2_zero2.yml"),
    )
    assert_same_training(zero2, one, "SP 2 under DeepSpeed ZeRO-2 against one process")
