"""Directory swaps shared by the builders that write whole directories (the demo
data set, EvoPipe's feature store)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def replace_directory(staging: Path, target: Path, aside_prefix: str) -> None:
    """Put the finished ``staging`` directory in ``target``'s place (same
    filesystem: renames only).

    An existing ``target`` is first renamed into a fresh directory named
    ``<aside_prefix>*`` beside it and deleted only once ``staging`` is in place; if
    that last rename fails, the old ``target`` is put back. So ``target`` is never
    half-written and never lost, only absent between the two renames. A process
    killed in between leaves the old copy under ``aside_prefix`` (builders clean
    those up under their lock).
    """
    aside = None
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=aside_prefix, dir=target.parent))
        os.replace(target, aside / target.name)
    try:
        os.replace(staging, target)
    except BaseException:
        if aside is not None:
            os.replace(aside / target.name, target)
            aside.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
