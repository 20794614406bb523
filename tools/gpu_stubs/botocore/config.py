"""Import-only stand-in (see ../README.md)."""


class Config:
    def __init__(self, *args, **kwargs):
        pass
