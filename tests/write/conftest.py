"""Fixtures shared by the writer tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 3 MiB tmpfs (needs mount rights: root in the CI container; skipped otherwise)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the injected ENOSPC "
                    "tests cover the path")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
