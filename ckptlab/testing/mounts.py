"""Small real file systems for tests: a ramfs that refuses O_DIRECT, a tiny tmpfs that fills.

Mounting needs root and ``mount(8)``; where either is missing, or the kernel refuses, the
test is skipped with the reason (never faked).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["mounted"]


@contextlib.contextmanager
def mounted(fstype: str, target: Path, options: str | None = None) -> Iterator[Path]:
    """``mount -t fstype [-o options]`` on ``target`` (created) for the block, then unmount.

    Parameters
    ----------
    fstype
        ``"ramfs"`` (no O_DIRECT: open with it fails with EINVAL), ``"tmpfs"``...
    target
        A directory path that does not exist yet.
    options
        Mount options, e.g. ``"size=64k"`` for a file system that fills up at once.
    """
    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"mounting a {fstype} needs root and mount(8)")
    target.mkdir()
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True,
                          check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
