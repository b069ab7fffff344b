"""The raw-disk baseline the write benchmarks compare against: O_DIRECT writes, then fsync."""

from __future__ import annotations

import os

CHUNK = 32 << 20  # bytes per write request


def odirect_write(path: str | os.PathLike[str], payload: memoryview, chunk: int = CHUNK) -> None:
    """Write a page-aligned ``payload`` to a new file with O_DIRECT in ``chunk``-byte requests,
    then fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for start in range(0, len(payload), chunk):
            part = payload[start:start + chunk]
            done = 0
            while done < len(part):
                done += os.pwrite(fd, part[done:], start + done)
        os.fsync(fd)
    finally:
        os.close(fd)
