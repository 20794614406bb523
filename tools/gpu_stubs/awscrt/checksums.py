"""Import-only stand-in (see ../README.md)."""


def crc32(*args, **kwargs):
    raise RuntimeError("awscrt stand-in: not available on this machine")
