"""Extension records: the runner-YAML keys each extension adds, its guards, its patches.

An :class:`Extension` declares

- ``keys``: :class:`ConfigKey` entries registered into OF3's (unlocked) base model
  config by :func:`of3_megafold.activate`, each with a default meaning "stock OF3",
  so ``model_update.custom`` can set them exactly like OF3's own keys;
- ``installed()``: its packages can be found (``importlib.util.find_spec``, no import);
- ``available()``: it can run here now (device, Triton backend or interpreter);
- ``patches``: what it changes in OF3. Patches are installed by ``activate`` and are
  inert until a module's config (or ``activate(force=...)``) asks for the extension,
  so activating the kit with every key at its default leaves OF3's behaviour unchanged.

This module imports neither OpenFold3 nor Triton; extensions declare themselves in
``of3_megafold.extensions`` and are looked up by name here.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from of3_megafold.errors import ExtensionUnavailableError, KitConfigError

logger = logging.getLogger(__name__)

Check = tuple[bool, str]

_KILL_SWITCH = "OF3_MEGAFOLD_DISABLE"
"""Comma-separated extension names (or ``all``) that are never available."""


@dataclass(frozen=True)
class ConfigKey:
    """One runner-YAML key, addressed from the root of OF3's model config.

    Attributes:
        path: e.g. ``("settings", "memory", "train", "use_evoflash_attention")``;
            the YAML form is ``model_update.custom.<path>``.
        default: the value that means "stock OF3 behaviour". ``None`` accepts any
            type later (ml_collections rule); otherwise OF3's config type-checks.
        help: one line for ``of3-megafold info``, the README and the docs.
        choices: allowed values, checked when a runner builds its config.
    """

    path: tuple[str, ...]
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def yaml_path(self) -> str:
        return "model_update.custom." + self.dotted

    def read(self, config: Any) -> Any:
        """The key's value in a (merged) OF3 model config."""
        node = config
        for part in self.path:
            node = node[part]
        return node


@dataclass(frozen=True)
class Patch:
    """Replace ``module:qualname`` with ``make(original)`` while the kit is active.

    ``target`` is ``"package.module:Class.attribute"`` or ``"package.module:name"``.
    """

    target: str
    make: Callable[[Any], Any]


def _python_packages_check(packages: tuple[str, ...]) -> Check:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        return False, (
            f"missing Python package(s): {', '.join(missing)}; "
            f"install them (pip install {' '.join(missing)})"
        )
    return True, "packages found"


def _always_ok() -> Check:
    return True, "runs everywhere"


@dataclass
class Extension:
    """An optional part of the kit, switched on by its runner-YAML keys.

    Attributes:
        name: used in ``info``, ``activate(force=...)``, the pytest plugin and docs.
        summary: one line saying what it buys.
        keys: its runner-YAML keys.
        requires: Python packages it needs (``installed()``).
        device_check: whether it can run on this machine now (``available()``).
        requested: does a merged OF3 model config ask for it?
        enable_update: a ``model_update.custom`` fragment that turns it on (used by
            the benchmarks and shown in the docs).
        patches: changes to OF3, inert until a config or ``force`` asks for them.
        validate: extra checks of a merged config beyond key choices (for example
            mutual exclusion with OF3's own kernel flags); raises KitConfigError.
        variants: values accepted after ``name:`` in ``force`` (first = default).
        docs: the extension's page under ``docs/`` (shown by ``of3-megafold info``).
        min_processes: processes that ``enable_update`` needs to run (2 for
            sequence parallelism); single-process benchmarks leave out the others.
    """

    name: str
    summary: str
    keys: tuple[ConfigKey, ...]
    requested: Callable[[Any], bool]
    enable_update: Mapping[str, Any]
    requires: tuple[str, ...] = ()
    device_check: Callable[[], Check] = _always_ok
    patches: tuple[Patch, ...] = ()
    validate: Callable[[Any], None] | None = None
    variants: tuple[str, ...] = ()
    docs: str = ""
    min_processes: int = 1

    def installed(self) -> Check:
        return _python_packages_check(self.requires)

    def available(self) -> Check:
        ok, reason = self.installed()
        if not ok:
            return ok, reason
        disabled = {
            s.strip() for s in os.environ.get(_KILL_SWITCH, "").split(",") if s.strip()
        }
        if self.name in disabled or "all" in disabled:
            return False, f"disabled by {_KILL_SWITCH}; unset it to enable"
        return self.device_check()

    def require_available(self) -> None:
        """Raise ExtensionUnavailableError naming the missing piece and the fix."""
        ok, reason = self.available()
        if not ok:
            raise ExtensionUnavailableError(
                f"extension '{self.name}' was requested but is not available here: "
                f"{reason}"
            )

    def check_config(self, config: Any) -> None:
        """Check key choices and extension-specific rules on a merged config."""
        for key in self.keys:
            value = key.read(config)
            if key.choices is not None and value not in key.choices:
                allowed = ", ".join(repr(c) for c in key.choices)
                raise KitConfigError(
                    f"{key.yaml_path}: {value!r} is not allowed; "
                    f"allowed values: {allowed}"
                )
        if self.validate is not None:
            self.validate(config)


EXTENSIONS: dict[str, Extension] = {}
"""Every registered extension by name, in registration order."""


def register(extension: Extension) -> Extension:
    """Add an extension to :data:`EXTENSIONS` (names are unique)."""
    if extension.name in EXTENSIONS:
        raise ValueError(f"extension {extension.name!r} is already registered")
    EXTENSIONS[extension.name] = extension
    return extension


def unregister(name: str) -> None:
    """Remove an extension (tests register throwaway extensions)."""
    EXTENSIONS.pop(name, None)


def get(name: str) -> Extension:
    """Look up an extension, with the known names in the error."""
    try:
        return EXTENSIONS[name]
    except KeyError:
        known = ", ".join(EXTENSIONS) or "none"
        raise KitConfigError(
            f"unknown extension {name!r}; known extensions: {known}"
        ) from None


@dataclass
class _ForceState:
    """Extensions forced on by ``activate(force=...)``: name -> chosen variant."""

    variants: dict[str, str] = field(default_factory=dict)


FORCED = _ForceState()


def forced_variant(name: str) -> str | None:
    """The variant an extension is forced to (``""`` if it has none), else None."""
    return FORCED.variants.get(name)


MEMORY_ATTR = "_megafold_memory"
"""Attribute the kit sets on every submodule of an ``OpenFold3`` model: a reference
to the model's ``config.settings.memory`` (train and eval sections)."""


def module_flag(module: Any, key: str) -> bool:
    """Whether ``settings.memory.<mode>.<key>`` is on for this module's model.

    ``mode`` follows ``module.training`` (the same rule as OF3's
    ``_get_mode_mem_settings``). Modules built outside an ``OpenFold3`` model carry
    no settings and read as off.
    """
    memory = getattr(module, MEMORY_ATTR, None)
    if memory is None:
        return False
    mode = memory.train if module.training else memory.eval
    return bool(mode.get(key, False))


MEMORY_MODES = ("train", "eval")


def memory_flag_keys(flag: str, help: str) -> tuple[ConfigKey, ...]:
    """``settings.memory.{train,eval}.<flag>`` keys, default false (stock OF3).

    ``help`` is prefixed with the mode. These are the keys a module reads through
    :func:`module_flag`.
    """
    return tuple(
        ConfigKey(("settings", "memory", mode, flag), False, f"{mode}: {help}")
        for mode in MEMORY_MODES
    )


def any_key_on(keys: tuple[ConfigKey, ...]) -> Callable[[Any], bool]:
    """``Extension.requested`` for boolean keys: true when any of them is on."""

    def requested(config: Any) -> bool:
        return any(bool(key.read(config)) for key in keys)

    return requested


def exclusive_with_of3_flags(
    keys: tuple[ConfigKey, ...], of3_flags: tuple[str, ...], what: str
) -> Callable[[Any], None]:
    """``Extension.validate`` for memory-flag ``keys`` that replace what OF3's
    ``settings.memory.<mode>`` flags ``of3_flags`` replace: a key on together with any
    of those flags in the same mode raises :class:`KitConfigError` naming both and
    asking for one ``what``."""

    def validate(config: Any) -> None:
        for key in keys:
            if not key.read(config):
                continue
            mode = key.path[2]
            section = config.settings.memory[mode]
            clashing = [flag for flag in of3_flags if section.get(flag)]
            if clashing:
                raise KitConfigError(
                    f"{key.yaml_path} is on together with OF3's "
                    f"{', '.join(clashing)} in settings.memory.{mode}; "
                    f"choose one {what} (set the others to false)"
                )

    return validate


def memory_flag_extension(
    name: str,
    flag: str,
    help: str,
    summary: str,
    *,
    exclusive_with: tuple[str, ...] = (),
    exclusive_what: str = "",
    **fields: Any,
) -> Extension:
    """An extension switched on by ``settings.memory.{train,eval}.<flag>``: the
    record most extensions share.

    Its keys are :func:`memory_flag_keys` (``help`` per mode, default false), it is
    requested when any of them is on (:func:`any_key_on`), ``enable_update`` turns
    it on in training, and its page is ``docs/extensions/<name>.md``. With
    ``exclusive_with`` (OF3's own ``settings.memory`` flags for the same work), a
    key on together with one of them in the same mode is refused
    (:func:`exclusive_with_of3_flags`, asking for one ``exclusive_what``).
    ``fields``: the other :class:`Extension` fields (``requires``,
    ``device_check``, ``patches``, ...).
    """
    keys = memory_flag_keys(flag, help)
    if exclusive_with:
        fields["validate"] = exclusive_with_of3_flags(
            keys, exclusive_with, exclusive_what
        )
    return Extension(
        name=name,
        summary=summary,
        keys=keys,
        requested=any_key_on(keys),
        enable_update={"settings": {"memory": {"train": {flag: True}}}},
        docs=f"docs/extensions/{name}.md",
        **fields,
    )


def module_enabled(module: Any, name: str, flag: str) -> bool:
    """Whether extension ``name`` runs for ``module``: forced on, or its model's
    ``settings.memory.<mode>.<flag>`` is on."""
    return forced_variant(name) is not None or module_flag(module, flag)


@functools.cache
def log_device_fallback(name: str, device: str) -> None:
    """Say once per extension and device type that calls with tensors there run
    OF3's own path: an available extension (a GPU is present) still meets CPU
    tensors, e.g. in OF3's CPU tests or CPU inference on a GPU machine."""
    logger.info(
        "%s: tensors on %s run OF3's own path (the kernels take CUDA tensors, or "
        "CPU tensors under TRITON_INTERPRET=1)",
        name,
        device,
    )


def _yaml_scalar(value: Any) -> str:
    """A key's default as YAML spells it (``false``, ``null``, ``dense``, ``256``)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def keys_markdown(extensions: tuple[Extension, ...] | None = None) -> str:
    """The runner-YAML keys of ``extensions`` (default: every registered one) as a
    Markdown table for the README: key under ``model_update.custom``, default,
    extension, help. A memory flag's ``train`` and ``eval`` keys share one row,
    ``settings.memory.{train,eval}.<flag>``; a flag of one mode only keeps its
    own path."""
    lines = [
        "| key (under `model_update.custom`) | default | extension | what it does |",
        "|---|---|---|---|",
    ]
    seen: set[str] = set()
    for ext in tuple(EXTENSIONS.values()) if extensions is None else extensions:
        memory = [k for k in ext.keys
                  if k.path[:2] == ("settings", "memory") and k.path[2] in MEMORY_MODES]
        modes: dict[tuple[str, ...], set[str]] = {}
        for key in memory:
            modes.setdefault(key.path[3:], set()).add(key.path[2])
        for key in ext.keys:
            name, help = key.dotted, key.help
            if key in memory and modes[key.path[3:]] == set(MEMORY_MODES):
                name = "settings.memory.{train,eval}." + ".".join(key.path[3:])
                help = help.removeprefix(f"{key.path[2]}: ")
            if name in seen:
                continue
            seen.add(name)
            cells = (
                f"`{name}`",
                f"`{_yaml_scalar(key.default)}`",
                ext.name,
                help.replace("|", "\\|"),
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
