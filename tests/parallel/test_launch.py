"""The kit's launcher: the world read from the runner YAML, checked before any
process starts; processes spawned on one node; a launcher's environment adopted.

CPU only: spawned ranks are tiny functions of this module (no model), so the file
runs in seconds.
"""

import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from of3_megafold import activate
from of3_megafold.cli import _overlaid as overlaid
from of3_megafold.cli import main
from of3_megafold.errors import KitConfigError, KitError
from of3_megafold.parallel import launch

REPO = Path(__file__).resolve().parents[2]
ZERO2_JSON = str(REPO / "runner_yamls" / "deepspeed_zero2.json")


def runner(devices=1, num_nodes=1, sp=1, **trainer):
    return {
        "pl_trainer_args": {"devices": devices, "num_nodes": num_nodes, **trainer},
        "model_update": {"custom": {"settings": {"sequence_parallel_size": sp}}},
    }


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*launch.LAUNCHER_ENV, "NODE_RANK", "GROUP_RANK", "CROSS_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_world_from_the_yaml():
    plan = launch.plan_world(runner(devices=4, num_nodes=2, sp=2), "cpu")
    assert (plan.world_size, plan.dp_size, plan.backend) == (8, 4, "gloo")
    assert launch.data_parallel_size(runner(devices=4, num_nodes=2, sp=2)) == 4
    assert launch.data_parallel_size({}) == 1
    assert launch.WorldPlan(1, 2, 2, "gpu").backend == "nccl"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (runner(devices=3, sp=2), "does not divide the world of 3"),
        (runner(devices=2, sp=0), "does not divide"),
        (runner(devices="auto"), "positive integers"),
        (runner(devices=2, accelerator="tpu"), "'tpu' is not supported"),
        (
            runner(devices=2, accelerator="cpu", deepspeed_config_path="none.json"),
            "none.json cannot be read",
        ),
        (
            runner(devices=2, accelerator="cpu", deepspeed_config_path=__file__),
            "is not JSON",
        ),
    ],
)
def test_a_world_that_cannot_work_is_refused(case, message):
    with pytest.raises(KitConfigError, match=message):
        launch.plan_world(case)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the no-GPU message"
)
def test_nccl_without_a_gpu_is_refused():
    with pytest.raises(KitConfigError, match="gpu .NCCL. but torch sees no CUDA"):
        launch.plan_world(runner(devices=2, accelerator="gpu"))


def test_deepspeed_with_per_sample_clipping_is_refused(monkeypatch):
    activate()  # the kit's keys in the model update
    monkeypatch.setattr(launch, "_check_backend", lambda plan: None)
    case = runner(devices=2, accelerator="gpu", deepspeed_config_path=ZERO2_JSON)
    with pytest.raises(KitConfigError, match="per_sample_clipping: false"):
        launch.plan_world(case)
    case["model_update"]["custom"]["settings"]["gradient_clipping"] = {
        "per_sample_clipping": False
    }
    assert launch.plan_world(case).deepspeed


def test_launcher_environment_is_checked_and_completed(monkeypatch, no_launcher):
    plan = launch.plan_world(runner(devices=2, num_nodes=2, sp=2), "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KitConfigError, match="started 2 processes, but"):
        launch.adopt_launcher_env(plan)
    # DeepSpeed's launcher names the node CROSS_RANK; Lightning reads NODE_RANK.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CROSS_RANK", "1")
    launch.adopt_launcher_env(plan)
    assert os.environ["NODE_RANK"] == "1"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    launch.adopt_launcher_env(plan)
    assert launch.global_rank() == 3


def write_rank(out: str, fail_rank: int | None = None) -> None:
    """A rank's body: record the environment it was given; fail on ``fail_rank``."""
    rank = launch.global_rank()
    if rank == fail_rank:
        raise ValueError(f"rank {rank} was told to fail")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    Path(out, f"rank{rank}.yml").write_text(
        yaml.safe_dump({k: os.environ[k] for k in keys})
    )


def test_ranks_are_spawned_on_one_node(tmp_path, no_launcher):
    plan = launch.plan_world(runner(devices=3), "cpu")
    launch.run_ranks(plan, f"{__name__}:write_rank", {"out": str(tmp_path)})
    envs = [yaml.safe_load((tmp_path / f"rank{r}.yml").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_a_failing_rank_fails_the_run(tmp_path, no_launcher):
    plan = launch.plan_world(runner(devices=2), "cpu")
    kwargs = {"out": str(tmp_path), "fail_rank": 1}
    with pytest.raises(KitError, match="rank 1 failed: ValueError: rank 1 was told"):
        launch.run_ranks(plan, f"{__name__}:write_rank", kwargs)


def test_several_nodes_need_a_launcher(no_launcher):
    plan = launch.plan_world(runner(devices=1, num_nodes=2), "cpu")
    with pytest.raises(KitConfigError, match="num_nodes: 2 needs a launcher"):
        launch.run_ranks(plan, f"{__name__}:write_rank", {"out": "."})


def test_under_a_launcher_this_process_is_one_rank(tmp_path, monkeypatch, no_launcher):
    plan = launch.plan_world(runner(devices=2), "cpu")
    for name, value in dict(
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(name, value)
    launch.run_ranks(plan, f"{__name__}:write_rank", {"out": str(tmp_path)})
    assert [p.name for p in tmp_path.iterdir()] == ["rank1.yml"]


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        (runner(devices=3, sp=2), "does not divide the world of 3"),
        (
            {
                **runner(devices=2, sp=2),
                "model_update": {
                    "custom": {
                        "settings": {"sequence_parallel_size": 2},
                        "architecture": {"shared": {"diffusion": {"no_samples": 3}}},
                    }
                },
            },
            "3 diffusion samples do not split evenly over 2 ranks",
        ),
        (
            runner(devices=2, sp=2, deepspeed_config_path=ZERO2_JSON),
            "needs model_update.custom.settings.gradient_clipping."
            "per_sample_clipping: false",
        ),
    ],
    ids=["world", "samples", "deepspeed-per-sample"],
)
def test_the_cli_refuses_before_any_rank_starts(tmp_path, overlay, message):
    path = tmp_path / "overlay.yml"
    path.write_text(yaml.safe_dump(overlay))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["train", "--overlay", str(path), "--output-dir", str(out)]
    )
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if "Error:" in line]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not out.exists(), "something was written"


def test_the_cpu_overlays_are_valid_worlds():
    for name, world in (("sp_cpu2.yml", (2, 1)), ("sp_cpu4_dp2.yml", (4, 2))):
        overlay = yaml.safe_load((REPO / "runner_yamls" / name).read_text())
        plan = launch.plan_world(overlay, "cpu")
        assert (plan.world_size, plan.dp_size) == world, name


def test_an_overlay_reads_its_deepspeed_config_next_to_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the overlay's folder
    activate()  # the kit's keys in the model update
    plan = launch.plan_world(
        overlaid({}, (REPO / "runner_yamls" / "sp_cpu2_zero2.yml",)), "cpu"
    )
    assert (plan.world_size, plan.dp_size, plan.deepspeed) == (2, 1, True)


def test_a_missing_deepspeed_config_is_refused_before_any_rank_starts(tmp_path):
    path = tmp_path / "overlays" / "overlay.yml"
    path.parent.mkdir()
    settings = {"gradient_clipping": {"per_sample_clipping": False}}
    path.write_text(
        yaml.safe_dump(
            {
                "pl_trainer_args": {"devices": 2, "deepspeed_config_path": "ds.json"},
                "model_update": {"custom": {"settings": settings}},
            }
        )
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["train", "--overlay", str(path), "--output-dir", str(out)]
    )
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if "Error:" in line]
    assert len(errors) == 1, result.output
    assert f"{path.parent / 'ds.json'} cannot be read" in errors[0], result.output
    assert not out.exists(), "something was written"
