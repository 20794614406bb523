"""Import-only stand-in (see ../README.md): OF3's template pipeline imports kalign."""


def align(*args, **kwargs):
    raise RuntimeError("kalign stand-in: kalign-python is not installed here")
