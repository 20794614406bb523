"""Exceptions the kit raises where a user can act on the message, and the helpers
that word their messages."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
"""The line with which torch's ``ExceptionWrapper.reraise`` puts a data-loader
worker's traceback in front of the message it raises again in the main process."""


class KitError(Exception):
    """Base class: the message is meant for the person running OF3."""


class KitConfigError(KitError, ValueError):
    """A kit key in the runner YAML has a value the kit cannot accept."""


class ExtensionUnavailableError(KitError, RuntimeError):
    """An extension was asked for but cannot run here (names the missing piece)."""


def user_message(error: KitError) -> str:
    """The kit's own message of ``error``, without a data-loader worker's traceback.

    An error raised in a ``DataLoader`` worker comes back to the main process as
    the same exception type with the message ``Caught <type> in DataLoader worker
    process N.\\nOriginal Traceback ...\\n<module>.<type>: <message>``; this returns
    the ``<message>``. Any other error's message is returned unchanged.
    """
    text = str(error)
    if _WORKER_TRACEBACK not in text:
        return text
    marker = f"{type(error).__name__}: "
    tail = text.rpartition(_WORKER_TRACEBACK)[2]
    line_start = tail.rfind("\n" + type(error).__module__ + "." + marker)
    if line_start < 0:
        line_start = tail.rfind("\n" + marker)
    if line_start < 0:
        return text
    return tail[line_start:].split(marker, 1)[1].strip()


def unwritable_cause(path: Path, error: OSError) -> str:
    """Why a directory could not be created or written at ``path``, in words.

    A regular file at ``path`` or on its way (``errno`` then says ``File exists``
    or ``Not a directory``) is named; any other error keeps its ``strerror``.
    """
    for candidate in (path, *path.parents):
        if candidate.is_file():
            return f"{candidate} is a regular file, not a directory"
    return f"cannot create or write a directory there ({error.strerror or error})"


@contextmanager
def one_line_errors(before: Callable[[], None] | None = None) -> Iterator[None]:
    """Turn the kit's own errors into a command's one-line message and exit status 1
    (``click.ClickException`` with :func:`user_message`), also when a data-loader
    worker raised them; ``before`` runs first (e.g. to end progress bars)."""
    try:
        yield
    except KitError as error:
        import click

        if before is not None:
            before()
        raise click.ClickException(user_message(error)) from error
