"""The processes of a training run, read from the runner YAML.

``of3-megafold train`` asks this module for the world a runner YAML describes
(:func:`plan_world`) before anything starts, then runs one training process per
rank (:func:`run_ranks`):

- world size = ``pl_trainer_args.num_nodes x devices``; sequence-parallel (SP)
  groups of ``model_update.custom.settings.sequence_parallel_size`` consecutive
  ranks; data parallelism over the ``world / sp`` groups;
- backend: Lightning's choice for the accelerator, NCCL on GPUs and gloo on CPU
  (``process_group_backend`` of Lightning's ``DDPStrategy`` and
  ``DeepSpeedStrategy``);
- started by a launcher (``torchrun``, ``srun``, DeepSpeed's ``deepspeed``, or
  anything that sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``): this process is
  one rank; the environment's world size must be the YAML's;
- started by hand with a world of several processes on one node: the processes
  are spawned here (``MASTER_ADDR=127.0.0.1``, a free port), each one rank as
  Lightning expects from an external launcher, and the first one to fail ends
  the run with its error.

A world that cannot work (size not a multiple of the SP size, no backend for the
accelerator, more GPUs per node than the machine has, a DeepSpeed config that
cannot be read, DeepSpeed with OF3's per-sample clipping) raises
:class:`~of3_megafold.errors.KitConfigError` from :func:`plan_world`, before any
rank starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from of3_megafold.errors import KitConfigError, KitError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")
"""Any of these in the environment means a launcher started this process."""


@dataclass(frozen=True)
class WorldPlan:
    """The processes a runner YAML asks for.

    Attributes:
        num_nodes: ``pl_trainer_args.num_nodes``.
        devices: processes per node (``pl_trainer_args.devices``).
        sp_size: ranks per sequence-parallel group.
        accelerator: ``cpu`` or ``gpu``.
        deepspeed: ``pl_trainer_args.deepspeed_config_path`` is set.
    """

    num_nodes: int
    devices: int
    sp_size: int
    accelerator: str
    deepspeed: bool = False

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def backend(self) -> str:
        return "nccl" if self.accelerator == "gpu" else "gloo"


def sequence_parallel_size(runner: dict) -> int:
    """``model_update.custom.settings.sequence_parallel_size`` of a runner dict (1
    when absent)."""
    custom = (runner.get("model_update") or {}).get("custom") or {}
    return int((custom.get("settings") or {}).get("sequence_parallel_size", 1))


def data_parallel_size(runner: dict) -> int:
    """Data-parallel replicas of a runner dict: ``num_nodes x devices / sp``."""
    trainer = runner.get("pl_trainer_args") or {}
    world = int(trainer.get("num_nodes", 1)) * int(trainer.get("devices", 1))
    return max(1, world // sequence_parallel_size(runner))


def accelerator_kind(name: str) -> str:
    """``gpu`` or ``cpu`` for a Lightning accelerator name (``auto``: ``gpu`` when
    torch sees a CUDA device)."""
    import torch

    name = str(name).lower()
    if name in ("gpu", "cuda"):
        return "gpu"
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    raise KitConfigError(
        f"pl_trainer_args.accelerator: {name!r} is not supported by the kit's "
        "launcher; use gpu, cpu or auto"
    )


def plan_world(runner: dict, accelerator: str | None = None) -> WorldPlan:
    """The world a runner dict asks for, checked before any process starts.

    Args:
        runner: the (overlaid) runner YAML as a dict; its model update must
            already have passed the kit's config checks (the diffusion-sample
            split is checked there).
        accelerator: overrides ``pl_trainer_args.accelerator`` (the demo decides
            it at run time).

    Raises:
        KitConfigError: naming the YAML entry, the cause and the fix.
    """
    import torch.distributed as dist

    trainer = runner.get("pl_trainer_args") or {}
    num_nodes = int(trainer.get("num_nodes", 1))
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int) or devices < 1 or num_nodes < 1:
        raise KitConfigError(
            f"pl_trainer_args.devices: {devices!r}, num_nodes: {num_nodes!r}; the "
            "kit's launcher needs positive integers (processes per node, nodes)"
        )
    plan = WorldPlan(
        num_nodes=num_nodes,
        devices=devices,
        sp_size=sequence_parallel_size(runner),
        accelerator=accelerator_kind(accelerator or trainer.get("accelerator", "gpu")),
        deepspeed=trainer.get("deepspeed_config_path") is not None,
    )
    if plan.sp_size < 1 or plan.world_size % plan.sp_size:
        raise KitConfigError(
            "model_update.custom.settings.sequence_parallel_size: "
            f"{plan.sp_size} does not divide the world of {plan.world_size} "
            f"processes (pl_trainer_args.num_nodes {num_nodes} x devices "
            f"{devices}); set devices x num_nodes to a multiple of it"
        )
    if plan.world_size > 1 and not dist.is_available():
        raise KitConfigError(
            f"pl_trainer_args: {plan.world_size} processes need torch.distributed, "
            "which this torch build lacks; install a torch with distributed support"
        )
    if plan.deepspeed:
        _check_deepspeed(trainer["deepspeed_config_path"], plan)
    if plan.world_size > 1:
        _check_backend(plan)
    if plan.deepspeed and _per_sample_clipping(runner):
        raise KitConfigError(
            "pl_trainer_args.deepspeed_config_path needs "
            "model_update.custom.settings.gradient_clipping.per_sample_clipping: "
            "false (OF3's per-sample clipping runs under DDP only); DeepSpeed then "
            "clips the averaged gradient at settings.gradient_clipping.clip_val"
        )
    return plan


def _check_deepspeed(config_path: Any, plan: WorldPlan) -> None:
    """DeepSpeed importable, its config a readable JSON file, and on CPU DeepSpeed's
    own accelerator the CPU (:mod:`of3_megafold.parallel.cpu_deepspeed`)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise KitConfigError(
            "pl_trainer_args.deepspeed_config_path is set, but deepspeed is not "
            "installed; pip install deepspeed, or drop deepspeed_config_path"
        )
    path = Path(config_path)
    try:
        json.loads(path.read_text())
    except OSError as err:
        raise KitConfigError(
            f"pl_trainer_args.deepspeed_config_path: {path} cannot be read "
            f"({err.strerror}); a relative path in an --overlay file is read "
            "relative to that file, in a --runner-yaml relative to the working "
            "directory"
        ) from None
    except ValueError as err:
        raise KitConfigError(
            f"pl_trainer_args.deepspeed_config_path: {path} is not JSON ({err}); "
            "give a DeepSpeed JSON config"
        ) from None
    if plan.accelerator == "cpu":
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise KitConfigError(
                "pl_trainer_args.deepspeed_config_path with accelerator cpu, but "
                f"DeepSpeed chose its {name} accelerator here; set "
                "DS_ACCELERATOR=cpu, or use accelerator gpu"
            )


def _per_sample_clipping(runner: dict) -> bool:
    """OF3's ``settings.gradient_clipping.per_sample_clipping`` for this runner."""
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    update = ModelUpdate.model_validate(runner.get("model_update") or {})
    config = OF3ProjectEntry().get_model_config_with_update(update)
    return bool(config.settings.gradient_clipping.per_sample_clipping)


def _check_backend(plan: WorldPlan) -> None:
    import torch
    import torch.distributed as dist

    if plan.backend == "gloo" and not dist.is_gloo_available():
        raise KitConfigError(
            "pl_trainer_args.accelerator: cpu needs the gloo backend, which this "
            "torch build lacks; install a torch build with gloo"
        )
    if plan.backend == "nccl":
        if not torch.cuda.is_available():
            raise KitConfigError(
                "pl_trainer_args.accelerator: gpu (NCCL) but torch sees no CUDA "
                "device here; set accelerator: cpu (gloo) or run on a GPU node"
            )
        if not dist.is_nccl_available():
            raise KitConfigError(
                "pl_trainer_args.accelerator: gpu needs the NCCL backend, which "
                "this torch build lacks; install a CUDA build of torch"
            )
        if not launched_externally() and torch.cuda.device_count() < plan.devices:
            raise KitConfigError(
                f"pl_trainer_args.devices: {plan.devices} GPUs per node, but this "
                f"node has {torch.cuda.device_count()}; lower devices"
            )


def launched_externally() -> bool:
    """Whether a launcher (torchrun, srun, deepspeed, ...) started this process."""
    return any(name in os.environ for name in LAUNCHER_ENV)


def adopt_launcher_env(plan: WorldPlan) -> None:
    """Check the launcher's world against the YAML's; fill what Lightning reads.

    DeepSpeed's launcher names the node ``CROSS_RANK``; Lightning reads
    ``NODE_RANK`` (else ``GROUP_RANK``), so it is copied there.

    Raises:
        KitConfigError: the launcher started a different number of processes.
    """
    if "SLURM_PROCID" in os.environ and "WORLD_SIZE" not in os.environ:
        world = os.environ.get("SLURM_NTASKS")
    else:
        world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != plan.world_size:
        raise KitConfigError(
            f"the launcher started {world} processes, but pl_trainer_args asks for "
            f"{plan.world_size} (num_nodes {plan.num_nodes} x devices "
            f"{plan.devices}); make them agree"
        )
    node_rank_known = "NODE_RANK" in os.environ or "GROUP_RANK" in os.environ
    if not node_rank_known and "CROSS_RANK" in os.environ:
        os.environ["NODE_RANK"] = os.environ["CROSS_RANK"]


def global_rank() -> int:
    """This process's rank from a launcher's environment (0 without one)."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _call(target: str, kwargs: dict[str, Any]) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


def _rank_main(local_rank: int, plan: WorldPlan, port: int, target: str, kwargs):
    # Set before the target's modules are imported: Lightning reads the rank
    # from the environment at import.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(plan.world_size),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(plan.devices),
        NODE_RANK="0",
    )
    _call(target, kwargs)


def run_ranks(plan: WorldPlan, target: str, kwargs: dict[str, Any]) -> None:
    """Run ``target(**kwargs)`` once per rank of ``plan`` on this node.

    Args:
        plan: from :func:`plan_world`.
        target: ``"module:function"``, imported in each rank's process.
        kwargs: its arguments (picklable).

    One process (or a launcher's process): called here. Several processes on one
    node without a launcher: spawned (``torch.multiprocessing``, ``spawn``) and
    waited for; when one fails, the others are stopped and its error is raised.

    Raises:
        KitConfigError: several nodes without a launcher.
        KitError: a spawned rank failed (its traceback is printed first).
    """
    if plan.world_size == 1:
        _call(target, kwargs)
        return
    if launched_externally():
        adopt_launcher_env(plan)
        _call(target, kwargs)
        return
    if plan.num_nodes > 1:
        raise KitConfigError(
            f"pl_trainer_args.num_nodes: {plan.num_nodes} needs a launcher on every "
            "node (torchrun, srun or deepspeed; see "
            "docs/extensions/sequence_parallel.md#launch); without one the kit "
            "starts the processes of one node only"
        )
    import torch.multiprocessing as mp

    port = _free_port()
    context = mp.start_processes(
        _rank_main,
        args=(plan, port, target, kwargs),
        nprocs=plan.devices,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as err:
        print(str(err), file=sys.stderr)
        last = str(err).strip().splitlines()[-1]
        raise KitError(f"rank {err.error_index} failed: {last}") from None
    except mp.ProcessExitedException as err:
        traceback.print_exc()
        raise KitError(
            f"rank {err.error_index} exited with status {err.exit_code}"
        ) from None


def train_runner(runner: dict, use_tf32: bool = False) -> None:
    """One rank of ``of3-megafold train --runner-yaml``: OF3's own training path
    (``run_openfold train``) on a runner dict the parent process has checked."""
    from openfold3.entry_points.experiment_runner import TrainingExperimentRunner
    from openfold3.entry_points.validator import TrainingExperimentConfig
    from openfold3.run_openfold import _configure_torch_backend, _enable_tf32

    from of3_megafold import activate
    from of3_megafold.parallel.cpu_deepspeed import use_cpu_deepspeed
    from of3_megafold.parallel.rng import seed_model_init

    activate()
    if use_tf32:
        _enable_tf32()
    _configure_torch_backend()
    config = TrainingExperimentConfig.model_validate(runner)
    expt_runner = TrainingExperimentRunner(config)
    seed_model_init(config.experiment_settings.seed)
    expt_runner.setup()
    use_cpu_deepspeed(expt_runner)
    expt_runner.run()


def run_training(plan: WorldPlan, runner: dict, use_tf32: bool) -> None:
    """``of3-megafold train --runner-yaml``: :func:`train_runner` on every rank."""
    run_ranks(
        plan, f"{__name__}:train_runner", {"runner": runner, "use_tf32": use_tf32}
    )


def run_demo(plan: WorldPlan, runner_yaml, output_dir, **kwargs: Any) -> None:
    """``of3-megafold train`` without ``--runner-yaml``: the demo on every rank.

    Args:
        plan: the world of the overlaid demo YAML (:func:`plan_world` with
            ``accelerator="auto"``, as the demo resolves it).
        runner_yaml, output_dir, kwargs: for
            :func:`of3_megafold.demo.train.run_demo_training`; ``dataset_dir``
            among them, built once by the caller rather than by every rank.
    """
    kwargs.update(runner_yaml=runner_yaml, output_dir=output_dir)
    run_ranks(plan, f"{__name__}:_demo_rank", kwargs)


def _demo_rank(**kwargs: Any) -> None:
    from of3_megafold import activate
    from of3_megafold.demo.train import run_demo_training

    activate()
    run_demo_training(**kwargs, progress=global_rank() == 0)
