"""Exceptions the kit raises where a user can act on the message."""


class KitError(Exception):
    """Base class: the message is meant for the person running OF3."""


class KitConfigError(KitError, ValueError):
    """A kit key in the runner YAML has a value the kit cannot accept."""


class ExtensionUnavailableError(KitError, RuntimeError):
    """An extension was asked for but cannot run here (names the missing piece)."""
