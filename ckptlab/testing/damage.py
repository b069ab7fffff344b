"""Damaged copies of a checkpoint, and the checks every parser's damage tests share.

House habit 8 asks each parser for a truncation and a mutation test; these helpers are the
loops those tests repeat: every prefix of a file, every bit flipped in a byte range, opening a
damaged copy and reading every tensor it lists, and checking that segments tile a file.

Importing this module imports neither torch nor hypothesis; :func:`open_and_read` imports
:mod:`ckptlab` when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["assert_tiles", "bit_flips", "flip_bit", "open_and_read", "truncations"]


def flip_bit(data: bytes, index: int) -> bytes:
    """``data`` with one bit of byte ``index`` flipped (bit ``index % 8``, so a sweep over
    consecutive bytes flips every bit position).

    Parameters
    ----------
    data
        The original bytes.
    index
        The byte to damage, ``0 <= index < len(data)``.

    Returns
    -------
    bytes
        A copy with that one bit changed.
    """
    if not 0 <= index < len(data):
        raise IndexError(f"byte {index} is outside the {len(data)} bytes given")
    mutated = bytearray(data)
    mutated[index] ^= 1 << (index % 8)
    return bytes(mutated)


def bit_flips(data: bytes, ranges: Iterable[tuple[int, int]] | None = None
              ) -> Iterator[tuple[int, bytes]]:
    """``(index, flip_bit(data, index))`` for every byte in ``ranges`` (``[start, end)``
    pairs), or in the whole of ``data`` when ``ranges`` is None.

    Parameters
    ----------
    data
        The original bytes.
    ranges
        Byte ranges to damage, each ``(start, end)`` with ``end`` exclusive.

    Yields
    ------
    tuple[int, bytes]
        The index flipped and the damaged copy.
    """
    for start, end in ((0, len(data)),) if ranges is None else ranges:
        for index in range(start, end):
            yield index, flip_bit(data, index)


def truncations(data: bytes, step: int = 1) -> Iterator[bytes]:
    """Every proper prefix ``data[:n]`` for ``n`` in ``range(0, len(data), step)``.

    Parameters
    ----------
    data
        The whole file.
    step
        Distance between successive cut points (1: every prefix).

    Yields
    ------
    bytes
        The truncated copy.
    """
    if step < 1:
        raise ValueError(f"step must be at least 1, got {step}")
    for n in range(0, len(data), step):
        yield data[:n]


def open_and_read(data: bytes, path: str | os.PathLike[str] | None = None) -> Any:
    """Open ``data`` with :func:`ckptlab.open` and read every tensor it lists.

    A :class:`~ckptlab.errors.CkptlabError` (on open or on any read) is the expected answer
    to damage and is swallowed; any other exception propagates, which is what a damage test
    checks. With ``path`` the bytes are written there first and opened as a file (the file
    path exercises the readers that take a path); else they are opened as bytes.

    Returns
    -------
    Checkpoint or None
        The checkpoint when it opened, else None.
    """
    import ckptlab
    from ckptlab.errors import CkptlabError

    source: Any = data
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
        source = path
    try:
        ck = ckptlab.open(source)
    except CkptlabError:
        return None
    for name in ck.tensors:
        try:
            ck.read(name)
        except CkptlabError:
            pass
    return ck


def assert_tiles(segments: Iterable[Any], nbytes: int, what: object = "") -> None:
    """Assert that ``segments`` (objects with ``offset``, ``nbytes`` and ``end_offset``) cover
    ``[0, nbytes)`` in order with no gap, no overlap and no empty segment.

    Raises
    ------
    AssertionError
        Naming the first segment out of place (and ``what``, e.g. the file).
    """
    cursor = 0
    for seg in segments:
        assert seg.offset == cursor and seg.nbytes > 0, (what, cursor, seg)
        cursor = seg.end_offset
    assert cursor == nbytes, (what, cursor, nbytes)
