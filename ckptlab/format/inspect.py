"""``inspect``: recognise a checkpoint file and return its full layout."""

from __future__ import annotations

import os
from typing import BinaryIO

from ckptlab._io.durable import METADATA
from ckptlab.errors import (
    ArchiveError,
    InvalidArgumentError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format.archive import scan_torch_zip
from ckptlab.format.layout import ArchiveLayout
from ckptlab.format.safetensors import looks_like_safetensors, scan_safetensors
from ckptlab.source._bytes import ByteSource

__all__ = ["detect_format", "inspect", "read_range"]

LEGACY_MAGIC = bytes.fromhex("80028a0a6cfc9c46f9206aa850192e")


def detect_format(head: bytes, file_nbytes: int) -> str:
    """Name the kind of file from its first bytes (up to 512).

    One of ``"torch-zip"`` (any zip), ``"safetensors"``, ``"tensorizer"``, ``"legacy-pickle"``,
    ``"legacy-tar"``, ``"pickle"``, ``"empty"`` or ``"unknown"``.
    """
    if file_nbytes == 0:
        return "empty"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "torch-zip"
    if head.startswith(LEGACY_MAGIC):
        return "legacy-pickle"
    if head[257:262] == b"ustar":
        return "legacy-tar"
    if looks_like_safetensors(head, file_nbytes):
        return "safetensors"
    if head[:5] == b"|TZR|":  # (ckptlab.format.tensorizer.MAGIC)
        return "tensorizer"
    if head[:1] == b"\x80" and 2 <= head[1:2][0] <= 5 if len(head) > 1 else False:
        return "pickle"
    return "unknown"


_UNSUPPORTED = {
    "legacy-pickle": "a legacy torch.save file (pre-1.6 pickle format, or "
                     "_use_new_zipfile_serialization=False): ckptlab.open reads it (`ckptlab "
                     "inspect` without --records); re-save it with torch.save to get a zip "
                     "archive",
    # legacy-tar and pickle: ckptlab.format._kinds words them (torch's tar or any tar; a plain
    # pickle or a legacy torch.save file of protocol 3-5)
    "safetensors": "a safetensors file, not a torch.save archive (ckptlab.inspect reads its "
                   "tensor offsets from the header)",
}


def inspect(source: str | os.PathLike[str] | BinaryIO | bytes) -> ArchiveLayout:
    """Full layout of a checkpoint: a torch.save zip archive, a .safetensors file or a
    tensorizer ``.tensors`` file.

    Parameters
    ----------
    source
        A path, a bytes-like object, or a binary file object.

    Returns
    -------
    ArchiveLayout
        Every record, storage and tensor, and segments that tile the file exactly.

    Raises
    ------
    TruncatedArchiveError, CorruptArchiveError
        The file is damaged (the message names the file, record and offset).
    UnsupportedFormatError
        A legacy torch file, a TorchScript archive, a plain pickle, a DCP directory (read
        those with ``ckptlab.inspect``, which dispatches to :func:`ckptlab.plan.inspect_dcp`)
        or an unknown format; the message says which.

    Notes
    -----
    Nothing in the file is executed: ``data.pkl`` is interpreted by a scanner that resolves
    every global to an inert stand-in.
    """
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        if os.path.exists(os.path.join(source, METADATA)):
            raise UnsupportedFormatError("a torch.distributed.checkpoint directory: use "
                                         "ckptlab.inspect or ckptlab.plan.inspect_dcp",
                                         path=source)
        raise ArchiveError("is a directory, not a checkpoint file", path=source)
    with ByteSource(source) as src:
        kind = sniff(src)
        if kind == "torch-zip":
            return scan_torch_zip(src)
        if kind == "safetensors":
            return scan_safetensors(src)
        if kind == "tensorizer":
            from ckptlab.format.tensorizer import scan_tensorizer

            return scan_tensorizer(src)
        raise not_a_checkpoint(src, kind)


def sniff(src: ByteSource) -> str:
    """:func:`detect_format` of a source's first bytes (one read)."""
    return detect_format(src.read(0, min(512, src.nbytes), what="file header"), src.nbytes)


def not_a_checkpoint(src: ByteSource, kind: str) -> ArchiveError:
    """The error for a file of ``kind`` that is neither a torch zip nor safetensors.

    The message names the file, what it is (from its magic bytes: compressed, NumPy, HDF5,
    GGUF, tensorizer, ONNX, a pickle, ...; see :mod:`ckptlab.format._kinds`), what to do, and
    its first bytes in hex.
    """
    from ckptlab.format._kinds import describe

    if kind == "empty":
        return TruncatedArchiveError("empty file", path=src.name, offset=0,
                                     expected="a checkpoint", actual="0 bytes")
    head = src.read(0, min(512, src.nbytes), what="file header")
    first = head[:8].hex(" ")
    found = describe(head, src.nbytes, src.name,
                     lambda n: src.read(0, n, what="file header"), kind)
    if found is not None and found.truncated:
        return TruncatedArchiveError(found.message(head[:8]), path=src.name, offset=0)
    if found is not None:
        message = found.message(head[:8])
    elif kind in _UNSUPPORTED:
        message = f"{_UNSUPPORTED[kind]} (first bytes {first})"
    else:
        message = f"not a checkpoint format ckptlab knows (first bytes {first})"
    return UnsupportedFormatError(message, path=src.name, offset=0)


def read_range(source: str | os.PathLike[str] | BinaryIO | bytes, offset: int,
               nbytes: int) -> bytes:
    """Exactly ``nbytes`` raw bytes of a file at ``offset`` (for hex views), one read.

    Raises
    ------
    TruncatedArchiveError
        When ``[offset, offset + nbytes)`` is not inside the file, naming the file and range.
    """
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise InvalidArgumentError(
            f"offset and nbytes must be non-negative ints, got {offset!r} and {nbytes!r}")
    with ByteSource(source) as src:
        return src.read(offset, nbytes, what="requested range")
