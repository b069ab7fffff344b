"""DCP directories behind URLs, read at the cost of their ``.metadata``.

The local fast open (:mod:`ckptlab.checkpoint._dcp_fast`) reads ``.metadata`` and, per data
file, its size and the object items; tensor items are read up to their data when a tensor is
first asked for. Here the same reads run over ranged requests (:func:`remote_items`, used by
:mod:`ckptlab.checkpoint._dcp_remote`):

- ``.metadata``: one request (the caller's), decoded into columns;
- each data file: **one** request of its head, ``Range: bytes=0-(W-1)``, whose
  ``Content-Range`` gives the file's size and whose bytes hold the object items (DCP's
  ``FileSystemWriter`` writes them first in each file) and the first tensor item's magic
  (is it a torch.save zip or a SAFETENSORS blob?). ``W`` is worked out from the columns: the
  end of the object items before the first tensor item, or 4 bytes into that item;
- nothing else at open: a directory opens in ``1 + files`` requests (``2 + files`` from a
  directory URL, which probes ``model.safetensors.index.json`` first), moving the object
  items and a few bytes per file, whatever the size of the tensors.

Afterwards (:class:`RemoteItems`):

- a tensor's entry reads each of its items up to the data: on a miss, one request moves that
  head and the heads of the items before and after it in the same file while the gap between
  heads stays under 1 MiB and the request under 16 MiB (a read-ahead that turns a listing of
  many small items into a few requests, in whichever order the listing walks the file, and
  costs one head per item where items are large). Of what it moves, the range asked for and
  the heads (4 KiB) are kept, up to 64 MiB (oldest first out): not the data between them,
  which a later miss would otherwise move again;
- an item scanned in full (the first of its shape, or one that matches no template) is moved
  whole when it is at most 1 MiB, else its first 64 KiB (with the same read-ahead) and its
  last 65 KiB;
- :meth:`RemoteItems.fetch` moves a byte range for ``ck.read`` (one request, nothing kept).

Anything the fast open does not take (SAFETENSORS serialization, zstd transforms, a
``.metadata`` the columnar decoder does not read) gives None: the caller then mirrors the
data files (:func:`ckptlab.checkpoint.open._open_remote_dcp`).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Any

import numpy as np

from ckptlab.dcp.columns import EntryColumns
from ckptlab.dcp.items import ItemLayouts, item_layout
from ckptlab.format.layout import ArchiveLayout

__all__ = ["RemoteItems", "remote_items"]

_HEAD = 4096  # bytes of an item read with its head: its records' headers and its pickle
_AHEAD_GAP = 1 << 20  # read-ahead: a gap up to this between item heads is moved through...
_AHEAD_SPAN = 16 << 20  # ... in one request of at most this many bytes
_KEEP = 64 << 20  # bytes of read-ahead and scans kept, over every file (oldest first out)
_WHOLE = 1 << 20  # an item scanned in full is moved whole up to this size...
_EDGE = 64 << 10  # ... else its first this many bytes (what a scan reads)...
_TAIL = _EDGE + 1024  # ... and last (the end-of-directory search reads 64 KiB + 97 bytes)


class RemoteItems(ItemLayouts):
    """:class:`~ckptlab.dcp.items.ItemLayouts` over ranged requests: one
    :class:`~ckptlab.format._remote.RemoteSource` per data file, read-ahead over item heads,
    a bounded keep of the bytes moved (see the module docstring). Thread-safe: the sources'
    kept bytes change under :attr:`lock` only."""

    def __init__(self, root: str, sources: dict[str, Any],
                 spans: dict[str, tuple[list[int], list[int]]]) -> None:
        super().__init__(root)
        self.sources = sources  # file -> RemoteSource
        self.spans = spans  # file -> (item starts, item ends), in offset order
        self.lock = threading.RLock()
        self._kept: deque[tuple[str, int, int]] = deque()  # (file, lo, hi) kept, in order
        self._kept_nbytes = 0

    # -- moving bytes (under the lock) -------------------------------------------------------
    def _move(self, file: str, lo: int, hi: int,
              keep: list[tuple[int, int]] | None = None) -> None:
        """Move ``[lo, hi)`` in one request, unless all of it is kept, and keep it (only the
        ranges ``keep`` of it, when given), dropping the oldest kept ranges past
        :data:`_KEEP`."""
        src = self.sources[file]
        hi = min(hi, src.nbytes)
        if hi <= lo or src.kept(lo, hi - lo) is not None:
            return
        src.forget(lo, hi)  # what is missing is then one range: one request
        src.prefetch([(lo, hi)])
        pieces = [(lo, hi)] if keep is None else _merged(
            [(max(a, lo), min(b, hi)) for a, b in keep if min(b, hi) > max(a, lo)])
        cursor = lo
        for a, b in pieces:  # drop what is not kept (the tensor data moved through)
            if a > cursor:
                src.forget(cursor, a)
            cursor = b
        if cursor < hi:
            src.forget(cursor, hi)
        for a, b in pieces:
            self._kept.append((file, a, b))
            self._kept_nbytes += b - a
        while self._kept_nbytes > _KEEP and len(self._kept) > 1:
            old_file, old_lo, old_hi = self._kept.popleft()
            self._kept_nbytes -= old_hi - old_lo
            self.sources[old_file].forget(old_lo, old_hi)

    def _around(self, file: str, lo: int, hi: int, head: int = _HEAD
                ) -> tuple[int, int, list[tuple[int, int]]]:
        """What a read of ``[lo, hi)`` that missed moves, and what of it is kept.

        It moves also the heads of the items next to it, before and after (a listing may
        walk a file either way), while the gaps stay under :data:`_AHEAD_GAP` and the span
        under :data:`_AHEAD_SPAN`, and without a kept range inside (so the miss is one
        request, and what is kept is not moved again). It keeps ``[lo, hi)`` and the first
        ``head`` bytes of each item it covers (what is compared with a template): not the
        tensor data after them."""
        starts, ends = self.spans.get(file, ([], []))
        kept = self.sources[file].kept_ranges()
        k = bisect.bisect_right(kept, (lo, float("inf")))
        floor = kept[k - 1][1] if k else 0  # past lo when lo is kept: nothing before
        stop = kept[k][0] if k < len(kept) else self.sources[file].nbytes
        keep = [(lo, hi)]
        # before: items wholly before lo, nearest first
        j = bisect.bisect_right(starts, lo) - 1
        if j >= 0 and starts[j] < lo < ends[j]:
            j -= 1  # lo is inside item j: its head is moved by the read itself or was before
        first = lo
        while j >= 0:
            a, b = starts[j], min(ends[j], starts[j] + head)
            if first - b > _AHEAD_GAP or hi - a > _AHEAD_SPAN // 2 or a < floor:
                break
            first = a
            keep.append((a, b))
            j -= 1
        # after
        j = bisect.bisect_right(starts, lo)
        while j < len(starts):
            a, b = starts[j], min(ends[j], starts[j] + head)
            if a - hi > _AHEAD_GAP or b - first > _AHEAD_SPAN or b > stop:
                break
            hi = max(hi, b)
            keep.append((a, b))
            j += 1
        return first, hi, keep

    # -- what ItemLayouts reads -------------------------------------------------------------
    def layout(self, file: str, fqn: str, offset: int, length: int, key: Any) -> ArchiveLayout:
        with self.lock:
            return super().layout(file, fqn, offset, length, key)

    def scan(self, file: str, fqn: str, offset: int, length: int) -> ArchiveLayout:
        with self.lock:
            return super().scan(file, fqn, offset, length)

    def read(self, file: str, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` at ``offset`` (fewer at the file's end): from kept bytes, else one
        request that reads ahead over the neighbouring items' heads."""
        with self.lock:
            src = self.sources[file]
            end = min(offset + nbytes, src.nbytes)
            if end <= offset:
                return b""
            data = src.kept(offset, end - offset)
            if data is None:
                self._move(file, *self._around(file, offset, end, max(_HEAD, nbytes)))
                data = src.read(offset, end - offset)
            return data

    def scan_item(self, file: str, offset: int, length: int) -> ArchiveLayout:
        """The item's layout, scanned from its bytes moved whole (up to :data:`_WHOLE`) or
        from its first :data:`_EDGE` and last :data:`_TAIL` bytes (a scan reads no tensor
        data)."""
        from ckptlab.format._window import PositionalFile

        with self.lock:
            src = self.sources[file]
            head = length if length <= _WHOLE else _EDGE
            if src.kept(offset, head) is None:  # else _around would move it again
                self._move(file, *self._around(file, offset, offset + head))
            if head < length:
                self._move(file, max(offset + head, offset + length - _TAIL), offset + length)
            return item_layout(PositionalFile(src), file, offset, length)

    # -- what ck.read reads ------------------------------------------------------------------
    def fetch(self, file: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` for ``ck.read``: kept ones, else one request (outside the
        lock, nothing kept)."""
        src = self.sources[file]
        with self.lock:
            data = src.kept(start, end - start)
        return data if data is not None else src.fetch(start, end)

    def close(self) -> None:
        with self.lock:
            for src in self.sources.values():
                src.forget()
            self._kept.clear()
            self._kept_nbytes = 0


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, those that overlap or touch merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _windows(cols: Any, entries: EntryColumns) -> np.ndarray:
    """Per data file: how many bytes of its head the open needs (object items before the
    first tensor item, and that item's 4-byte magic); at least 1 (the size comes with it)."""
    file_of, offset, tensor_item = entries.file_of, entries.offset, entries.tensor_item
    nf = len(cols.files)
    first = np.full(nf, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, file_of[tensor_item], offset[tensor_item])
    need = np.where(first < np.iinfo(np.int64).max, first + 4, 1)
    obj = ~tensor_item
    before = offset[obj] < first[file_of[obj]]
    np.maximum.at(need, file_of[obj][before], (offset + entries.length)[obj][before])
    return need


def _raw_items(cols: Any, entries: EntryColumns) -> bool:
    """Whether some tensor item is no longer than its chunk's raw bytes: not a torch.save
    zip (which adds its headers, pickle and directory to them) but a SAFETENSORS blob of one
    tensor (several overlap, which ``entries.order`` finds). Decided from the columns, so
    that such a directory goes to the mirror before any data file is asked for."""
    from ckptlab.format._dtypes import DTYPE_ITEMSIZE

    volume = entries.volumes  # -1 (no chunk, or too large to say): never raw
    itemsize = np.array([DTYPE_ITEMSIZE.get(cols.tensors[f][0], 1) if f in cols.tensors else 1
                         for f in cols.fqns], dtype=np.int64)[entries.fqn_of]
    return bool(((volume >= 0) & (entries.length <= volume * itemsize)).any())



def remote_items(store: Any, root: str, raw: bytes
                 ) -> tuple[RemoteItems, EntryColumns, dict[str, str]] | None:
    """The items of the DCP directory at the URL ``root`` whose ``.metadata`` is ``raw``
    (moved by the caller), read through ranged requests: its columns (``entries.cols``), one
    :class:`~ckptlab.format._remote.RemoteSource` per data file that exists (each opened with
    one request of the head the open needs) and each data file's URL; or None where the
    caller must mirror the data files (decided before any data file is asked for).

    Raises
    ------
    ArchiveError
        A data file name that leaves the directory, a request that failed.
    """
    from ckptlab.dcp.columns import decode_columns
    from ckptlab.dcp.metadata import MAX_METADATA_NBYTES
    from ckptlab.errors import ArchiveError
    from ckptlab.format._remote import RemoteNotFoundError, RemoteSource, join_url

    if not 0 < len(raw) <= MAX_METADATA_NBYTES:
        return None
    try:
        cols = decode_columns(raw)
    except (ValueError, ArchiveError):
        return None
    if cols is None or cols.transforms or not cols.has_storage_data:
        return None
    entries = EntryColumns(cols)
    order = entries.order
    if order is None or _raw_items(cols, entries):
        return None  # decided before any data file is asked for
    file_of, offset, length = entries.file_of, entries.offset, entries.length
    windows = _windows(cols, entries)
    urls = {name: join_url(root, name) for name in cols.files}  # refuses names leaving root
    sources: dict[str, Any] = {}
    for fid in sorted(range(len(cols.files)), key=cols.files.__getitem__):
        name = cols.files[fid]
        try:
            sources[name] = RemoteSource(store, urls[name], first="head",
                                         window_nbytes=int(windows[fid]))
        except RemoteNotFoundError:
            continue  # the checkpoint's open says which item's file is missing
    spans: dict[str, tuple[list[int], list[int]]] = {}
    if cols.entries:
        bounds = np.flatnonzero(np.diff(file_of[order])) + 1
        for group in np.split(order, bounds):
            spans[cols.files[file_of[group[0]]]] = (offset[group].tolist(),
                                                    (offset + length)[group].tolist())
    return RemoteItems(root, sources, spans), entries, urls
