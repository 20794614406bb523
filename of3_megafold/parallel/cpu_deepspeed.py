"""Lightning's DeepSpeed strategy on CPU processes (gloo), for OF3's runner.

OF3 trains under Lightning's ``DeepSpeedStrategy`` when
``pl_trainer_args.deepspeed_config_path`` is set. DeepSpeed itself runs on CPU
(its CPU accelerator, gloo for the collectives when Intel's oneCCL bindings are
absent), but two things stop the strategy there:

- Lightning's ``DeepSpeedStrategy.setup_environment`` refuses any accelerator but
  CUDA;
- DeepSpeed's engine takes its device from ``args.device_rank``, which Lightning
  reads from the root device's index, and Lightning's CPU devices have none.

:class:`CPUDeepSpeedStrategy` lifts the first and gives each process the device
``cpu:<local rank>``. :func:`use_cpu_deepspeed` swaps it in for the strategy OF3's
runner built, keeping everything OF3 set on it (the config, its precision plugin,
``zero_force_ds_cpu_optimizer: false``, the cluster environment and timeout).

DeepSpeed's CPU communication backend also JIT-compiles a shared-memory
all-reduce when it starts (about a minute on 2 cores, and a C++ compiler), used
only by ``inference_all_reduce``, which training never calls: training's
reductions go through ``torch.distributed``. :func:`skip_cpu_inference_all_reduce`
marks that op incompatible, so the backend does not build it.
"""

from __future__ import annotations

from typing import Any

import torch
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

SHM_COMM_OP = "deepspeed_shm_comm"
"""The name DeepSpeed's ``ShareMemCommBuilder`` registers its op under."""


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` without its CUDA-only check, one ``cpu:<rank>`` device
    per process (DeepSpeed's engine needs a device index)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # Lightning's CPU accelerator hands out ``cpu`` without an index.
        if devices is not None:
            devices = [torch.device("cpu", i) for i in range(len(devices))]
        self._parallel_devices = devices


def skip_cpu_inference_all_reduce() -> None:
    """Keep DeepSpeed's CPU backend from building its inference-only all-reduce.

    ``deepspeed.ops.__compatible_ops__`` is one dict kept in the module, read by
    ``deepspeed.comm.torch.build_shm_op`` when the backend starts.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def use_cpu_deepspeed(expt_runner: Any) -> None:
    """Run OF3's DeepSpeed strategy on CPU, when the runner asks for both.

    Call after ``TrainingExperimentRunner.setup()`` and before ``run()`` (which
    builds the Trainer from the runner's cached ``strategy``). Does nothing unless
    ``pl_trainer_args.accelerator`` is ``cpu`` (or
    ``auto`` without a CUDA device) and ``deepspeed_config_path`` is
    set.

    Args:
        expt_runner: OF3's ``TrainingExperimentRunner``.
    """
    from of3_megafold.parallel.launch import accelerator_kind

    trainer_args = expt_runner.pl_trainer_args
    if trainer_args.deepspeed_config_path is None:
        return
    if accelerator_kind(trainer_args.accelerator) != "cpu":
        return
    strategy = expt_runner.strategy
    # The subclass adds no state: the object OF3 built is kept, its class
    # changed, rather than OF3's construction copied here.
    strategy.__class__ = CPUDeepSpeedStrategy
    skip_cpu_inference_all_reduce()
