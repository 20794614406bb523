"""``of3-megafold bench step``: one full OpenFold3 training step, provider by provider.

A step is what OF3's Lightning module runs per batch (``OpenFold3AllAtom.
_training_step_manual_clip`` in ``projects/of3_all_atom/runner.py``)::

    batch, outputs = model(batch)                      # OpenFold3, training mode
    loss, breakdown = loss_fn(batch, outputs, _return_breakdown=True)
    loss.backward()

under ``torch.autocast("cuda", torch.bfloat16)`` with fp32 weights (Lightning's
``bf16-mixed``) on CUDA, plain fp32 on CPU. Gradient clipping, the optimiser and the
EMA update are left out: they cost the same for every provider. So is their memory
(Adam moments, EMA weights, OF3's per-sample gradient accumulator: about 5.5 GiB for
the full model), which a real training run needs on top of ``peak_gib``.

The model is OF3's default model with the ``train`` preset (as ``OF3ProjectEntry``
builds it for ``run_openfold train``; 368 M parameters, 48 diffusion samples,
activation checkpointing), or the ``tiny`` config for CPU smoke tests. The batch is
``openfold3.tests.utils.data_utils.random_of3_features`` with the token-level
ground-truth keys filled in: without them OF3's permutation alignment fails, its
last-resort fallback zeroes every loss weight and the step learns nothing.
:class:`LossesDisabledError` is raised if that happens anyway.

A *provider* is a model-config update, a nested dict merged into OF3's model config
exactly like ``model_update.custom`` in a runner YAML: ``stock`` is ``{}``,
``stock-triton`` turns on OF3's own Triton triangle-attention kernel, ``kit`` turns
on every available kit extension, each kit extension is also a provider of its
own name, and ``kit-without-<extension>`` is the kit less one extension.
``stock-cueq`` and ``stock-deepspeed`` turn on OF3's flags for cuEquivariance's and
DeepSpeed's kernels; they run only when named, and a failure of theirs is a row's
``error``. Any provider with ``-tf32`` appended runs its step with TF32 matmuls (as
OF3's ``--use_tf32``; ``stock-cueq-tf32``: its fp32 backward needs them). All providers
run in one process on the same weights (same seed) and the same batch, so their
times and losses can be compared directly.

Determinism: before every step the Python, NumPy and torch generators are reseeded
and OF3's ``model.synced_generator`` (which draws the number of recycles in
training) is reset to ``np.random.default_rng(sync_seed)``, so every step makes
OF3's first training draw: 3 recycles with the default ``sync_seed`` 0. Pass
``num_recycles`` to fix another count.

The package: :mod:`.providers` (which config update each provider merges;
:func:`provider_model_config` builds a provider's model config, the one way every
harness configures the kit or stock OF3), :mod:`.harness` (the model, the batch, one
timed step), :mod:`.measure` (a provider at one size: row fields, rows, the table),
:mod:`.max_crop` (the largest-crop search) and :mod:`.command` (the run over
providers and sizes, and the click command).
"""

from of3_megafold.bench.step.command import (
    DEFAULT_JSON_NAME,
    run_step_bench,
    step_command,
)
from of3_megafold.bench.step.harness import (
    GROUND_TRUTH_TOKEN_KEYS,
    SEED,
    FixedRecycles,
    LossesDisabledError,
    StepResult,
    TrainingStepHarness,
    random_training_batch,
    watch_alignment,
)
from of3_megafold.bench.step.max_crop import MAX_CROP_LADDER, ProbeProcessDied
from of3_megafold.bench.step.measure import format_table
from of3_megafold.bench.step.providers import (
    CONFIGS,
    KIT_WITHOUT,
    PROVIDERS,
    RIVAL_PROVIDERS,
    available_providers,
    build_model_config,
    deep_merge,
    kit_provider_updates,
    provider_availability,
    provider_model_config,
    provider_update,
)

__all__ = [
    "CONFIGS",
    "DEFAULT_JSON_NAME",
    "GROUND_TRUTH_TOKEN_KEYS",
    "KIT_WITHOUT",
    "MAX_CROP_LADDER",
    "PROVIDERS",
    "RIVAL_PROVIDERS",
    "SEED",
    "FixedRecycles",
    "LossesDisabledError",
    "ProbeProcessDied",
    "StepResult",
    "TrainingStepHarness",
    "available_providers",
    "build_model_config",
    "deep_merge",
    "format_table",
    "kit_provider_updates",
    "provider_availability",
    "provider_model_config",
    "provider_update",
    "random_training_batch",
    "run_step_bench",
    "step_command",
    "watch_alignment",
]
