"""``gds.save`` and ``gds.load``: the PyTorch GDS tutorial flow as two calls.

save: write the skeleton with ``skip_data`` at storage alignment 4096 (every record, the
pickle and the central directory, but no storage bytes), find each storage's offset with
:func:`ckptlab.storage_offsets` (no FakeTensorMode, no random reads), then write each storage
once through a :func:`ckptlab.gds.open` handle. load is the inverse: ``torch.load`` under
``skip_data`` builds the objects with empty storages on the target device, then each storage
is read in place.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptlab._io import BLOCK
from ckptlab._torch_compat import skip_data_inflates_storages
from ckptlab.errors import CorruptArchiveError, UnsupportedFormatError
from ckptlab.format.archive import archive_prefix, read_central_directory
from ckptlab.format.offsets import storage_offsets
from ckptlab.format.predict import skeleton_errors
from ckptlab.gds._backends import ODIRECT
from ckptlab.gds._buffers import (
    ALIGNED_STORAGE_MIN,
    aligned_storage,
    populate,
    storage_view,
)
from ckptlab.gds.handle import open as gds_open
from ckptlab.source._bytes import ByteSource

__all__ = ["GDS_ALIGNMENT", "LoadResult", "TransferReport", "load", "save",
           "storages_in_save_order"]

POPULATE_THREADS = 2  # threads faulting in fresh host storages ahead of the reads
GDS_ALIGNMENT = BLOCK  # the storage alignment gds.save writes by default (ckptlab._io.BLOCK)


@dataclass(frozen=True)
class TransferReport:
    """What a :func:`save` or :func:`load` did, phase by phase.

    ``phases`` maps a phase name (``skeleton``, ``offsets``, ``write``/``read``, ``fsync``,
    ``crc``) to seconds; ``storage_nbytes`` is the payload moved (each storage once);
    ``duration_s`` is the whole operation.
    """

    path: str
    backend: str
    io_path: str
    reason: str
    storages: int
    storage_nbytes: int
    file_nbytes: int
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Seconds the whole operation took (the sum of the phases)."""
        return sum(self.phases.values())

    @property
    def seconds(self) -> float:
        """Deprecated name of :attr:`duration_s`."""
        warnings.warn("TransferReport.seconds is deprecated; use TransferReport.duration_s",
                      DeprecationWarning, stacklevel=2)
        return self.duration_s

    @property
    def gbps(self) -> float:
        """Payload GB/s over the whole operation (1 GB = 1e9 bytes)."""
        return self.storage_nbytes / max(self.duration_s, 1e-12) / 1e9

    def phase_gbps(self, phase: str) -> float:
        """Payload GB/s over one phase."""
        return self.storage_nbytes / max(self.phases.get(phase, 0.0), 1e-12) / 1e9


class LoadResult(NamedTuple):
    """What :func:`load` returns: the loaded object and the :class:`TransferReport`.

    A named tuple, so ``obj, report = gds.load(path)`` unpacks it as before.
    """

    obj: Any
    report: TransferReport


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def storages_in_save_order(obj: Any) -> list[Any]:
    """The untyped storages of ``obj`` in the order torch.save numbers them (key "0", "1", ...).

    torch.save keys storages by first encounter while pickling; this pickles ``obj`` the same
    way (protocol 2, storages as persistent ids) into a sink, so no byte of data is copied.
    """
    import torch

    from ckptlab._torch_compat import storage_identity, untyped_storage

    seen: dict[int, Any] = {}

    class _Order(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = untyped_storage(o)
                seen.setdefault(storage_identity(storage), storage)
                return ("storage", len(seen))
            return None

    _Order(_Discard(), protocol=2).dump(obj)
    return list(seen.values())


def _records(path: str) -> tuple[str, dict[str, Any]]:
    with ByteSource(path) as src:
        _, entries = read_central_directory(src)
        prefix = archive_prefix(entries, path)
    return prefix, {e.name: e for e in entries}


def _plan(path: str, obj: Any) -> tuple[list[tuple[str, Any, int]], dict[str, Any], str]:
    """Each non-empty storage of ``obj`` with its data offset in the file at ``path``."""
    offsets = storage_offsets(path).offsets
    prefix, entries = _records(path)
    return _match(path, storages_in_save_order(obj), offsets, entries, prefix), entries, prefix


def _match(path: str, storages: list[Any], offsets: dict[str, int],
           entries: dict[str, Any], prefix: str) -> list[tuple[str, Any, int]]:
    """(key, storage, data offset) for every non-empty storage, checked against its record.

    Empty storages move no bytes and are left out: torch.load gives each tensor of a shared
    empty storage its own, so counting them would not match the file.
    """
    keys = [k for k in sorted(offsets, key=int)
            if (e := entries.get(f"{prefix}/data/{k}")) is None or e.uncompressed_nbytes]
    full = [s for s in storages if s.nbytes()]
    if len(full) != len(keys):
        raise CorruptArchiveError("the object's storages do not match the archive's",
                                  path=path, expected=f"{len(keys)} non-empty storages",
                                  actual=f"{len(full)} non-empty storages")
    pairs = []
    for key, storage in zip(keys, full):
        name = f"{prefix}/data/{key}"
        entry = entries.get(name)
        if entry is None or entry.uncompressed_nbytes != storage.nbytes():
            raise CorruptArchiveError(
                "a storage's size differs from its record", path=path, record=name,
                offset=entry.header_offset if entry else None,
                expected=f"{storage.nbytes()} bytes",
                actual="no record" if entry is None else f"{entry.uncompressed_nbytes} bytes")
        pairs.append((key, storage, offsets[key]))
    return pairs


def save(obj: Any, path: str | os.PathLike[str], *, backend: str = "auto",
         alignment: int = GDS_ALIGNMENT, fix_crc: bool = False,
         fsync: bool = True) -> TransferReport:
    """torch.save ``obj`` the GDS way: skeleton, offsets, then each storage written once.

    Parameters
    ----------
    obj
        A state dict (or anything torch.save accepts) with CPU or CUDA tensors.
    path
        The file to write (replaced if it exists).
    backend
        As for :func:`ckptlab.gds.open`.
    alignment
        Storage alignment of the archive; 4096 makes every storage start on a GDS / O_DIRECT
        boundary.
    fix_crc
        Also write each storage record's CRC-32 into its data descriptor and central
        directory entry, so ``zipfile`` validates the file (``skip_data`` writes CRC 0; torch
        itself does not check). Costs one pass over the data.
    fsync
        Flush the file before returning.

    Returns
    -------
    TransferReport
        Bytes, seconds per phase and the I/O path that really ran. The file loads with plain
        ``torch.load``.
    """
    import torch

    path = os.fspath(path)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    from torch.utils.serialization import config

    try:
        with skeleton_errors("gds.save writes a skip_data skeleton and", path), \
                config.patch({"save.storage_alignment": alignment}), \
                torch.serialization.skip_data():
            torch.save(obj, path)
    except UnsupportedFormatError:
        with contextlib.suppress(OSError):
            os.unlink(path)  # torch had started the file: never leave a torn archive behind
        raise
    phases["skeleton"] = time.perf_counter() - t
    t = time.perf_counter()
    pairs, entries, prefix = _plan(path, obj)
    phases["offsets"] = time.perf_counter() - t
    t = time.perf_counter()
    on_device = bool(pairs) and all(s.device.type != "cpu" for _, s, _ in pairs)
    with gds_open(path, os.O_RDWR, backend=backend,
                  device=None if on_device else "cpu") as handle:
        if handle.moves_host_bytes and pairs:
            _write_in_file_order(handle, path, pairs)
        else:  # cuFile backends write storages only: into the skeleton's holes
            for _, storage, offset in pairs:
                handle.save_storage(storage, offset)
        phases["write"] = time.perf_counter() - t
        if fsync:
            t = time.perf_counter()
            handle.fsync()
            phases["fsync"] = time.perf_counter() - t
        if fix_crc:
            t = time.perf_counter()
            _write_crcs(path, pairs, entries, prefix)
            phases["crc"] = time.perf_counter() - t
        return TransferReport(path, handle.backend, handle.io_path, handle.reason, len(pairs),
                              sum(s.nbytes() for _, s, _ in pairs), os.path.getsize(path), phases)


def _write_in_file_order(handle: Any, path: str, pairs: list[tuple[str, Any, int]]) -> None:
    """Write the whole file again front to back: the skeleton's own bytes between the
    storages, and each storage at its offset.

    The skeleton leaves holes where the storages go; filling holes with O_DIRECT costs the
    filesystem more than appending (about 10% on ext4 here), so the skeleton's bytes (small:
    headers, the pickle, descriptors, the central directory) are read back, the file is
    emptied, and every byte is written again in file order. The result is byte-identical.
    """
    spans = sorted((offset, storage.nbytes(), storage) for _, storage, offset in pairs)
    size = os.path.getsize(path)
    pieces: list[tuple[int, bytes]] = []
    cursor = 0
    with ByteSource(path) as src:
        for offset, nbytes, _ in spans:
            if offset < cursor:
                raise CorruptArchiveError("two storages overlap in the skeleton", path=path,
                                          offset=offset, expected=f"offset >= {cursor}",
                                          actual=offset)
            pieces.append((cursor, src.read(cursor, offset - cursor, what="skeleton bytes")))
            cursor = offset + nbytes
        tail = src.read(cursor, size - cursor, what="skeleton bytes")
    os.truncate(path, 0)  # from here on every write appends: no holes to fill
    for (at, piece), (offset, _, storage) in zip(pieces, spans):
        if piece:
            handle.write_bytes(piece, at)
        handle.save_storage(storage, offset)
    if tail:
        handle.write_bytes(tail, cursor)


def _write_crcs(path: str, pairs: list[tuple[str, Any, int]], entries: dict[str, Any],
                prefix: str) -> None:
    """Patch each storage record's CRC-32 in its descriptor and central directory entry.

    Through its own POSIX handle: the fields are a few bytes each, and the GPU backends move
    storages only.
    """
    with ByteSource(path) as src, gds_open(path, os.O_RDWR, backend="posix") as handle:
        for key, storage, offset in pairs:
            entry = entries[f"{prefix}/data/{key}"]
            host = storage if storage.device.type == "cpu" else storage.cpu()
            crc = zlib.crc32(storage_view(host))
            packed = struct.pack("<I", crc)
            if entry.flags & 0x08:  # torch writes a descriptor: PK\7\8, crc32, sizes
                at = offset + entry.compressed_nbytes
                if src.read(at, 4, what="data descriptor", record=entry.name) != b"PK\x07\x08":
                    raise CorruptArchiveError("no data descriptor after the data", path=path,
                                              record=entry.name, offset=at)
                handle.write_bytes(packed, at + 4)
            handle.write_bytes(packed, entry.entry_offset + 16)
        handle.fsync()


def _placer(sizes: list[int] | None, device: Any, huge_pages: bool, path: str
            ) -> Callable[[Any, str], Any]:
    """``map_location`` for the skeleton: host storages from 1 MiB go to page-aligned memory
    (backed by huge pages when O_DIRECT will fill them; see
    :func:`ckptlab._io.aligned_buffer`), device storages to ``device``.

    ``sizes`` (the non-empty storages' true byte counts in the pickle's order) is for a
    torch whose skip_data storages are inflated by their element size
    (:func:`ckptlab._torch_compat.skip_data_inflates_storages`): torch asks for each new
    storage in that order, and each is made at its true size. Empty storages stay empty
    (torch asks for a shared empty one once per tensor).
    """
    import torch

    on_host = torch.device(device).type == "cpu"
    true_sizes = iter(sizes) if sizes is not None else None

    def place(storage: Any, location: str) -> Any:
        n = storage.nbytes()
        if true_sizes is not None and n:
            true = next(true_sizes, None)
            if true is None or not (n % true == 0 and n // true in (1, 2, 4, 8, 16)):
                raise CorruptArchiveError(
                    "the skeleton's storages do not follow the pickle's", path=path,
                    expected="a storage of its declared size" if true is None
                    else f"{true} bytes (times an element size)", actual=f"{n} bytes")
            n = true
        if not on_host:
            return torch.UntypedStorage(n, device=device)
        if n >= ALIGNED_STORAGE_MIN:
            return aligned_storage(n, huge_pages=huge_pages)
        return storage if n == storage.nbytes() else torch.UntypedStorage(n)
    return place


def _refuse_skeleton_unsafe(path: str) -> Any:
    """Refuse files whose tensors a skip_data skeleton cannot rebuild, read without pickle.

    A strided nested tensor keeps its sizes in storages: under ``skip_data`` torch rebuilds it
    from buffers that were never read (uninitialised memory). Wrapper subclasses cannot be
    rebuilt on a ``map_location`` callable.
    """
    from ckptlab.format import inspect

    layout = inspect(path)
    for t in layout.logical:
        if (t.kind == "nested" and t.layout == "strided") or (
                t.kind == "subclass" and [r for r, _ in t.parts] != ["data"]):
            name = ".".join(map(str, t.path)) or "<root>"
            raise UnsupportedFormatError(
                f"tensor {name!r} is a {t.kind} tensor ({t.subclass or t.layout}) whose "
                "structure lives in its storages; gds.load fills storages after a skip_data "
                "skeleton and cannot rebuild it: use torch.load (or ckptlab.open(path).read)",
                path=path, record=name)
    return layout


def load(path: str | os.PathLike[str], device: Any = "cpu", *, backend: str = "auto",
         weights_only: bool = True) -> LoadResult:
    """Load a checkpoint the GDS way: objects with empty storages on ``device``, then reads.

    Parameters
    ----------
    path
        A torch.save file (any alignment works; 4096 lets O_DIRECT / GDS read in place).
    device
        Where the storages are allocated (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    backend
        As for :func:`ckptlab.gds.open`.
    weights_only
        Passed to ``torch.load`` for the skeleton.

    Returns
    -------
    LoadResult
        ``.obj`` (what ``torch.load`` gives) and ``.report``; unpacks as ``(obj, report)``.
    """
    import torch

    path = os.fspath(path)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    on_host = torch.device(device).type == "cpu"
    layout = _refuse_skeleton_unsafe(path)
    sizes = [s.nbytes for s in layout.storages if s.nbytes] \
        if skip_data_inflates_storages() else None
    # the handle first: whether O_DIRECT fills the host storages decides how they are mapped
    with gds_open(path, os.O_RDONLY, backend=backend, device=device) as handle:
        with skeleton_errors("gds.load builds a skip_data skeleton and", path), \
                torch.serialization.skip_data():
            # host storages: page-aligned memory, so O_DIRECT reads land in place (no bounce)
            where = device if not on_host and sizes is None else \
                _placer(sizes, device, handle.io_path == ODIRECT, path)
            obj = torch.load(path, map_location=where, weights_only=weights_only)
        phases["skeleton"] = time.perf_counter() - t
        t = time.perf_counter()
        pairs, _, _ = _plan(path, obj)
        phases["offsets"] = time.perf_counter() - t
        t = time.perf_counter()
        # fault in the fresh host storages on another thread, ahead of the reads that fill them
        with ThreadPoolExecutor(POPULATE_THREADS, thread_name_prefix="ckptlab-populate") as pool:
            pool.map(populate, [s for _, s, _ in pairs])
            for _, storage, offset in pairs:
                handle.load_storage(storage, offset)
        phases["read"] = time.perf_counter() - t
        report = TransferReport(path, handle.backend, handle.io_path, handle.reason,
                                len(pairs), sum(s.nbytes() for _, s, _ in pairs),
                                os.path.getsize(path), phases)
    return LoadResult(obj, report)
