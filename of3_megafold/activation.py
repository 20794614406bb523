"""``activate`` / ``deactivate``: register the kit's keys and patches into OpenFold3.

``activate()`` (idempotent)

1. imports every extension declaration (:mod:`of3_megafold.extensions`);
2. adds each extension's keys, with their "stock" defaults, to OF3's module-level
   base model config, which is still unlocked; ``OF3ProjectEntry`` deep-copies and
   locks it per runner, so keys that are neither OF3's nor the kit's still raise
   OF3's ``KeyError ... config is locked``;
3. hooks ``OF3ProjectEntry.validate_model_config`` so a merged config is checked
   (key choices, extension rules, availability of requested extensions) before any
   model is built, and ``OpenFold3.__init__`` so every submodule can read its
   model's memory settings (:func:`of3_megafold.registry.module_flag`);
4. installs every extension's patches; each is inert until asked for.

``activate(force=("evoflash_attention", "smooth_lddt:ball_query"))`` also turns the
named extensions on wherever OF3 builds or calls the modules they replace, whatever
the config says (the pytest plugin uses this). ``deactivate()`` restores stock OF3.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from of3_megafold import registry
from of3_megafold.errors import KitConfigError

logger = logging.getLogger(__name__)

_MODEL_CONFIG = "openfold3.projects.of3_all_atom.config.model_config"


@dataclass
class _Installed:
    """What ``activate`` changed, so ``deactivate`` can undo it exactly."""

    patches: list[tuple[Any, str, Any, bool]] = field(default_factory=list)
    keys: list[tuple[Any, str]] = field(default_factory=list)
    active: bool = False


_STATE = _Installed()


def is_active() -> bool:
    return _STATE.active


def _resolve(target: str) -> tuple[Any, str]:
    module_name, _, qualname = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, attr


def _missing_dependency(err: ModuleNotFoundError) -> bool:
    """An OF3 module failed to import because one of *its* packages is missing here
    (a model-only install without the data pipeline's packages), not because the
    kit named an OpenFold3 module that does not exist."""
    return (err.name or "openfold3").split(".")[0] != "openfold3"


def _data_pipeline_unimportable(err: ImportError) -> bool:
    """OF3's data pipeline does not import here: a package it needs is missing, or a
    module of it is left half-imported by an earlier such failure (Python then
    reports a circular import inside openfold3). The kit naming a module that does
    not exist is a bug and not covered."""
    if isinstance(err, ModuleNotFoundError):
        return _missing_dependency(err)
    return (err.name or "").split(".")[0] == "openfold3"


def _install_patch(patch: registry.Patch) -> None:
    try:
        owner, attr = _resolve(patch.target)
    except ModuleNotFoundError as err:
        if not _missing_dependency(err):
            raise
        # Nothing here can call a module that does not import: nothing to patch.
        logger.info("not patching %s: %s", patch.target, err)
        return
    own = attr in vars(owner)
    original = getattr(owner, attr)
    replacement = patch.make(original)
    if isinstance(replacement, types.FunctionType):
        # OF3's docstring unless the replacement has its own; the original reachable
        # as ``__wrapped__`` (inspect.signature, tests calling OF3's path directly)
        if replacement.__doc__ is None:
            replacement.__doc__ = original.__doc__
        replacement.__wrapped__ = original
    setattr(owner, attr, replacement)
    _STATE.patches.append((owner, attr, original, own))


def _register_keys(extension: registry.Extension, base_config: Any) -> None:
    for key in extension.keys:
        parent = base_config
        for part in key.path[:-1]:
            parent = parent[part]
        name = key.path[-1]
        if name in parent:
            raise KitConfigError(
                f"extension {extension.name!r} declares {key.dotted}, which "
                "OpenFold3's config already has"
            )
        parent[name] = key.default
        _STATE.keys.append((parent, name))


def check_model_config(config: Any) -> None:
    """Check a merged OF3 model config against every extension.

    Raises:
        KitConfigError: a kit key has a value outside its choices, or breaks an
            extension's rule.
        ExtensionUnavailableError: the config asks for an extension that cannot run
            here; the message names the missing piece and the fix.
    """
    for extension in registry.EXTENSIONS.values():
        extension.check_config(config)
        if extension.requested(config):
            extension.require_available()


def _validate_hook(original):
    def validate_model_config(self, model_config):
        result = original(self, model_config)
        check_model_config(model_config)
        return result

    return validate_model_config


def _model_init_hook(original):
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        memory = self.settings.memory
        for module in self.modules():
            object.__setattr__(module, registry.MEMORY_ATTR, memory)

    return __init__


_CORE_PATCHES = (
    registry.Patch(
        "openfold3.projects.of3_all_atom.project_entry:"
        "OF3ProjectEntry.validate_model_config",
        _validate_hook,
    ),
    registry.Patch(
        "openfold3.projects.of3_all_atom.model:OpenFold3.__init__", _model_init_hook
    ),
)


def _available_names() -> list[str]:
    """``all`` in ``force``: every extension that can run here. Those that cannot
    (CUDA graphs on a machine without a GPU) are named in the log, not forced."""
    names = []
    for name, extension in registry.EXTENSIONS.items():
        ok, reason = extension.available()
        if ok:
            names.append(name)
        else:
            logger.info("force=all leaves out %s: %s", name, reason)
    return names


def _parse_force(force: Iterable[str] | str) -> dict[str, str]:
    if isinstance(force, str):
        force = [f for f in force.split(",") if f.strip()]
    chosen: dict[str, str] = {}
    for entry in force:
        name, _, variant = entry.strip().partition(":")
        names = _available_names() if name == "all" else [name]
        for each in names:
            extension = registry.get(each)
            if variant and variant not in extension.variants:
                allowed = ", ".join(extension.variants) or "none"
                raise KitConfigError(
                    f"extension {each!r} has no variant {variant!r}; "
                    f"variants: {allowed}"
                )
            default = extension.variants[0] if extension.variants else ""
            chosen[each] = variant or default
    return chosen


def activate(force: Iterable[str] | str = ()) -> None:
    """Register the kit's keys and patches into OpenFold3 (idempotent).

    Args:
        force: extension names (``"name"`` or ``"name:variant"``, or ``"all"``) to
            turn on wherever OF3 builds or calls what they replace, whatever the
            config says. Each named one must be available here; ``"all"`` forces
            every extension that is (the others are named in the log). Replaces
            any earlier force.

    Raises:
        ExtensionUnavailableError: a forced extension cannot run here.
        KitConfigError: an unknown extension or variant was named.
    """
    import of3_megafold.extensions  # noqa: F401  (registers every extension)

    chosen = _parse_force(force)
    for name in chosen:
        registry.get(name).require_available()

    if not _STATE.active:
        base_config = importlib.import_module(_MODEL_CONFIG).model_config
        try:
            for extension in registry.EXTENSIONS.values():
                _register_keys(extension, base_config)
            for patch in _CORE_PATCHES:
                _install_patch(patch)
            for extension in registry.EXTENSIONS.values():
                for patch in extension.patches:
                    _install_patch(patch)
        except BaseException:
            _undo()
            raise
        _STATE.active = True
        logger.debug("of3-megafold active: %s", ", ".join(registry.EXTENSIONS))
        # EvoPipe's dataset class, selectable by name in a runner YAML (OF3's
        # dataset registries only grow; nothing uses it unless a YAML names it).
        # Model-only installs (a benchmark machine without OF3's data-pipeline
        # dependencies) still activate the model extensions.
        from of3_megafold.data.dataset import register as register_datasets

        try:
            register_datasets()
        except ImportError as err:
            if not _data_pipeline_unimportable(err):
                raise
            logger.info(
                "EvoPipe dataset not registered: OF3's data pipeline does not "
                "import here (%s)",
                err,
            )

    registry.FORCED.variants = chosen


def _undo() -> None:
    for owner, attr, original, own in reversed(_STATE.patches):
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
    for parent, name in reversed(_STATE.keys):
        del parent[name]
    _STATE.patches.clear()
    _STATE.keys.clear()


def deactivate() -> None:
    """Restore stock OpenFold3: remove patches and keys, clear forced extensions.

    Configs and models built while the kit was active keep what they were built
    with.
    """
    _undo()
    registry.FORCED.variants = {}
    _STATE.active = False
