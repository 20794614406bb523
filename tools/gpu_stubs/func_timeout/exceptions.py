"""Import-only stand-in (see ../README.md)."""


class FunctionTimedOut(Exception):
    pass
