"""Import-only stand-in (see ../README.md)."""


class PageIterator:
    pass
