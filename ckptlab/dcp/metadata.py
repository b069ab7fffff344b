"""A DCP directory's ``.metadata``: found, read (bounded) and decoded, two ways.

``.metadata`` is a pickle. Loading it with ``pickle`` runs whatever it names, so it is never
loaded that way:

- :func:`load_metadata` / :func:`metadata_of` give DCP's own ``Metadata`` object: the pickle is
  run by ckptlab's bounded interpreter (:mod:`ckptlab.format._unpickle`, nothing imported or
  called) and only an allow-list of DCP metadata classes, checked field by field, becomes real
  objects (:mod:`ckptlab.dcp._decode`);
- :func:`read_columns` gives typed columns instead (:mod:`ckptlab.dcp.columns`), about ten
  times faster and without one Python object per item; it returns None for anything but the
  plain shape ``pickle.dump`` writes, and the caller then takes the first way, which accepts or
  refuses the file with its own messages.
"""

from __future__ import annotations

import os
from typing import Any

from ckptlab.dcp._decode import MetadataDecodeError, decode_metadata
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.source import check_unchanged, file_identity
from ckptlab.source._paths import open_inside

__all__ = ["MAX_METADATA_NBYTES", "METADATA", "is_dcp_dir", "load_metadata", "metadata_of",
           "read_columns"]

METADATA = ".metadata"
MAX_METADATA_NBYTES = 1 << 30


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """``torch.distributed.checkpoint.metadata.Metadata`` of a DCP directory, read safely.

    Raises
    ------
    UnsupportedFormatError
        When ``.metadata`` names anything outside the allow-list (a malicious or foreign
        pickle): nothing it names is imported or called.
    ArchiveError
        When it is missing, truncated or not a pickle of DCP Metadata.
    """
    meta_path = os.path.join(os.fspath(path), METADATA)
    try:
        # a regular file inside the directory: not a symlink out of it, not a FIFO
        with open_inside(path, METADATA) as f:
            nbytes = os.fstat(f.fileno()).st_size
            if nbytes > MAX_METADATA_NBYTES:
                raise CorruptArchiveError("metadata larger than 1 GiB", path=meta_path,
                                          expected=f"<= {MAX_METADATA_NBYTES} bytes",
                                          actual=f"{nbytes} bytes")
            data = f.read(nbytes)  # read(n) allocates n bytes up front: never more than the file
    except OSError as exc:
        raise ArchiveError(f"cannot read DCP metadata: {exc.strerror}", path=meta_path) from None
    return metadata_of(data, meta_path)


def metadata_of(data: bytes, meta_path: str) -> Any:
    """:func:`load_metadata` of ``.metadata``'s bytes (read from ``meta_path``, which errors
    name): the same bounded decoding, the same errors."""
    try:
        return decode_metadata(data)
    except MetadataDecodeError as exc:
        error = UnsupportedFormatError if exc.foreign else CorruptArchiveError
        message = str(exc) if exc.offset is not None else \
            f"not DCP Metadata ckptlab can read safely: {exc}"
        raise error(message, path=meta_path, offset=exc.offset) from None


def is_dcp_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a ``.metadata`` entry (what ``dcp.save``
    writes). Reads no file."""
    # any .metadata that is not a directory: a FIFO or a symlink out of the directory is a DCP
    # directory that load_metadata refuses with the reason, not "not a checkpoint file"
    meta = os.path.join(os.fspath(path), METADATA)
    return os.path.isdir(path) and os.path.lexists(meta) and not os.path.isdir(meta)



def read_columns(root: str) -> tuple[Any, int, tuple[int, ...]] | None:
    """``.metadata`` (a regular file inside ``root``, at most 1 GiB) decoded into columns
    (:func:`ckptlab.dcp.columns.decode_columns`), with its size and identity
    (device, inode, size, mtime); None where the general path should decide (and say what is
    wrong).

    The file is mapped, not copied: the decoder reads the pages straight from the page cache,
    so a 127 MB ``.metadata`` does not become 127 MB of process memory."""
    import mmap

    from ckptlab.dcp.columns import decode_columns

    try:
        with open_inside(root, METADATA) as f:
            info = os.fstat(f.fileno())
            nbytes = info.st_size
            if not 0 < nbytes <= MAX_METADATA_NBYTES:
                return None
            with mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as data:
                cols = decode_columns(data)
    except (OSError, ValueError, ArchiveError):
        return None
    return (cols, nbytes, file_identity(info)) if cols is not None else None


def _load_unchanged(root: str, identity: tuple[int, ...]) -> Any:
    """:func:`load_metadata` of ``root``, refused when ``.metadata`` is no longer the file the
    layout was built from (another inode, size or mtime)."""
    check_unchanged(os.path.join(root, METADATA), METADATA, identity, unreadable="DCP metadata")
    return load_metadata(root)

