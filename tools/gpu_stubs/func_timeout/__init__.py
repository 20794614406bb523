"""Import-only stand-in (see ../README.md): runs the function without a timeout."""

from .exceptions import FunctionTimedOut


def func_timeout(timeout, func, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


__all__ = ["FunctionTimedOut", "func_timeout"]
