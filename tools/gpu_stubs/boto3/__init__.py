"""Import-only stand-in (see ../README.md)."""


class Session:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("boto3 stand-in: S3 is not available on this machine")


def client(*args, **kwargs):
    raise RuntimeError("boto3 stand-in: S3 is not available on this machine")
