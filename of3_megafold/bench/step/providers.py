"""The step benchmark's providers: which model-config update each one merges.

A provider is a nested dict merged into OF3's model config exactly like
``model_update.custom`` in a runner YAML: ``stock`` is ``{}``, ``stock-triton`` turns
on OF3's own Triton triangle-attention kernel, ``kit`` turns on every available kit
extension (read from the kit's registry), each kit extension is also a provider of
its own name, ``kit-without-<extension>`` is the kit less one extension, the
``stock-cueq``/``stock-deepspeed`` providers turn on OF3's flags for other projects'
kernels, and ``<provider>-tf32`` is any of them with TF32 matmuls for the whole step.
:func:`provider_model_config` builds OF3's training config for one.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch

from of3_megafold.bench.common import TF32_SUFFIX, split_tf32

# Provider name -> model-config update (merged like `model_update.custom`).
PROVIDERS: dict[str, dict] = {
    "stock": {},
    "stock-triton": {
        "settings": {"memory": {"train": {"use_triton_triangle_kernels": True}}}
    },
}


# OF3's flags for other projects' kernels (cuEquivariance: its triangle attention and
# triangle multiplication; DeepSpeed: its evoformer attention) -> (the rival in
# of3_megafold.bench.rivals, the update). Run only when named, never by default.
# cuEquivariance's triangle-attention backward refuses fp32 inputs unless TF32
# matmuls are allowed (its error says so), and OF3 runs some of its attention in
# fp32: ``stock-cueq-tf32`` allows them, for the whole step, as a user would have to.
RIVAL_PROVIDERS: dict[str, tuple[str, dict]] = {
    "stock-cueq": (
        "cueq",
        {"settings": {"memory": {"train": {"use_cueq_triangle_kernels": True}}}},
    ),
    "stock-deepspeed": (
        "deepspeed",
        {"settings": {"memory": {"train": {"use_deepspeed_evo_attention": True}}}},
    ),
}

# Config name -> update applied on top of OF3's default config + `train` preset.
CONFIGS: dict[str, dict] = {
    "full": {},
    # A few-thousand-parameter-per-block model that runs a step in well under a
    # second on a CPU core, yet passes through every module of the full one (two
    # MSA blocks so the pair-weighted averaging is exercised).
    "tiny": {
        "architecture": {
            "shared": {
                "c_s": 32,
                "c_z": 16,
                "diffusion": {"no_samples": 2, "no_mini_rollout_steps": 2},
            },
            "input_embedder": {
                "atom_attn_enc": {
                    "c_token": 32,
                    "c_atom": 16,
                    "c_atom_pair": 8,
                    "no_blocks": 1,
                }
            },
            "template": {"c_t": 16, "template_pair_stack": {"no_blocks": 1}},
            "msa": {
                "msa_module_embedder": {"c_m": 16},
                "msa_module": {"no_blocks": 2, "c_hidden_mul": 16, "c_hidden_opm": 8},
            },
            "pairformer": {"no_blocks": 1, "c_hidden_mul": 16},
            "diffusion_module": {
                "diffusion_module": {"c_token": 32},
                "diffusion_transformer": {"no_blocks": 1},
                "atom_attn_enc": {"no_blocks": 1},
                "atom_attn_dec": {"no_blocks": 1},
            },
            "heads": {
                "pairformer_embedding": {
                    "pairformer": {"no_blocks": 1, "c_hidden_mul": 16}
                }
            },
        }
    },
}


@functools.cache
def _registry_extensions() -> dict[str, tuple[dict, bool, str]]:
    """The kit's extensions as ``{name: (enable_update, available, reason)}``.

    The only place this module touches the kit's registry
    (``of3_megafold.registry.EXTENSIONS``: name -> extension with ``enable_update``
    and ``available() -> (bool, reason)``). It is imported lazily; without it the
    result is empty and only the stock providers exist. The kit is activated first
    (unless it already is: activating again would reset a ``force``) so that the
    extensions are registered and their keys exist in OF3's model config before an
    update naming them is merged. Cached: asked once per process.
    """
    try:
        from of3_megafold import registry
    except ModuleNotFoundError as error:
        if error.name != "of3_megafold.registry":
            raise
        return {}
    from of3_megafold import activate, is_active

    if not is_active():
        activate()
    extensions = {}
    for name, extension in registry.EXTENSIONS.items():
        if extension.min_processes > 1:  # this harness times one process
            continue
        ok, reason = extension.available()
        extensions[name] = (_plain(extension.enable_update), ok, reason)
    return extensions


KIT_WITHOUT = "kit-without-"
"""Provider prefix: ``kit-without-<extension>`` is ``kit`` less that extension (what
the extension buys inside the kit, in the same run)."""


def kit_provider_updates(without: str | None = None) -> dict[str, dict]:
    """Providers the kit adds: each available extension by name, and ``kit`` with
    all available extensions on (all but ``without`` if given). Empty without the
    registry."""
    available = {
        name: update for name, (update, ok, _) in _registry_extensions().items() if ok
    }
    if not available:
        return {}
    everything: dict = {}
    for name, update in available.items():
        if name != without:
            everything = deep_merge(everything, update)
    return {"kit": everything, **_plain(available)}


def provider_availability(name: str, device: torch.device | str) -> tuple[bool, str]:
    """Whether provider ``name`` can run on ``device``, and why not."""
    device = torch.device(device)
    base, tf32 = split_tf32(name)
    if tf32:
        if device.type != "cuda":
            return False, f"{name}: TF32 matmuls need a CUDA device"
        return provider_availability(base, device)
    if name == "stock":
        return True, ""
    if name == "stock-triton":
        if device.type != "cuda":
            return False, "OF3's Triton triangle kernel needs a CUDA device"
        return True, ""
    if name in RIVAL_PROVIDERS:
        from of3_megafold.bench import rivals

        reason = rivals.unavailable(RIVAL_PROVIDERS[name][0])
        if reason is None and device.type != "cuda":
            reason = f"{name} needs a CUDA device"
        return reason is None, reason or ""
    extensions = _registry_extensions()
    if name == "kit":
        if any(ok for _, ok, _ in extensions.values()):
            return True, ""
        if not extensions:
            return False, "the kit's extension registry is not installed"
        reasons = "; ".join(f"{n}: {r}" for n, (_, _, r) in extensions.items())
        return False, f"no kit extension is available ({reasons})"
    if name in extensions:
        _, ok, reason = extensions[name]
        return ok, reason
    if name.startswith(KIT_WITHOUT):
        left_out = name.removeprefix(KIT_WITHOUT)
        if left_out not in extensions:
            return False, f"{name}: no kit extension {left_out!r}"
        if not extensions[left_out][1]:
            return False, f"{name}: {left_out} is unavailable here, so kit is the same"
        return True, ""
    known = ", ".join(sorted({*PROVIDERS, *RIVAL_PROVIDERS, "kit", *extensions,
                              f"{KIT_WITHOUT}<extension>", f"<provider>{TF32_SUFFIX}"}))
    return False, f"unknown provider {name!r}; known providers: {known}"


def available_providers(device: torch.device | str) -> list[str]:
    """Default provider list on ``device``: stock, stock-triton on CUDA, and the
    kit (all extensions, then each alone) when the registry offers it."""
    names = [*PROVIDERS, *kit_provider_updates()]
    return [name for name in names if provider_availability(name, device)[0]]


def provider_update(name: str, device: torch.device | str) -> dict:
    """The model-config update of provider ``name``.

    Raises:
        ValueError: ``name`` is unknown or cannot run on ``device``; the message
            says why (an explicit request never falls back silently).
    """
    ok, reason = provider_availability(name, device)
    if not ok:
        raise ValueError(f"provider {name!r} is unavailable: {reason}")
    name = split_tf32(name)[0]  # the precision is the step's, not the config's
    if name in PROVIDERS:
        return copy.deepcopy(PROVIDERS[name])
    if name in RIVAL_PROVIDERS:
        return copy.deepcopy(RIVAL_PROVIDERS[name][1])
    if name.startswith(KIT_WITHOUT):
        return kit_provider_updates(without=name.removeprefix(KIT_WITHOUT))["kit"]
    return kit_provider_updates()[name]


def _plain(value: Any) -> Any:
    """``value`` with every nested mapping turned into a fresh plain dict."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return copy.deepcopy(value)


def deep_merge(base: Mapping, update: Mapping) -> dict:
    """``base`` with ``update`` merged in recursively, as plain dicts (neither
    argument is modified)."""
    merged = _plain(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = _plain(value)
    return merged


def build_model_config(config: str, update: Mapping | None = None):
    """OF3's model config with the ``train`` preset, then ``CONFIGS[config]``, then
    ``update``, built as ``OF3ProjectEntry.get_model_config_with_update`` builds
    the config of a training run (locked: unknown keys raise ``KeyError``)."""
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    custom = deep_merge(CONFIGS[config], update or {})
    return OF3ProjectEntry().get_model_config_with_update(
        ModelUpdate(presets=["train"], custom=custom)
    )


def provider_model_config(
    provider: str,
    device: torch.device | str,
    config: str = "full",
    update: Mapping | None = None,
):
    """OF3's training model config for ``provider`` on ``device``: ``config``'s
    update (:data:`CONFIGS`), then the provider's (:func:`provider_update`), then
    ``update`` (more model-config keys, e.g.
    ``{"settings": {"sequence_parallel_size": 2}}``).

    This is how every harness configures "the kit", "stock OF3" or "OF3 with its
    Triton kernel": one function, so that a benchmark comparing them builds each
    model the same way.

    Raises:
        ValueError: the provider is unknown or cannot run on ``device``.
    """
    return build_model_config(
        config, deep_merge(provider_update(provider, device), update or {})
    )
