"""DCP directories behind URLs, opened at the cost of their ``.metadata``.

The local fast open (:mod:`ckptlab.checkpoint._dcp_fast`) reads ``.metadata`` and, per data
file, its size and the object items; tensor items are read up to their data when a tensor is
first asked for. Here the same open runs over ranged requests:

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
  costs one head per item where items are large). The bytes moved are kept up to 64 MiB
  (oldest first out);
- an item scanned in full (the first of its shape, or one that matches no template) is moved
  whole when it is at most 1 MiB, else its first 64 KiB (with the same read-ahead) and its
  last 65 KiB;
- ``ck.read(name)`` costs **one request per part**: a tensor not built yet has each of its
  items moved whole (header, data, directory: one request each), its entry built from those
  bytes and its data taken from them; a tensor built already has each part's data moved.

Anything the fast open does not take (SAFETENSORS serialization, zstd transforms, a
``.metadata`` the columnar decoder does not read) returns None: the caller then mirrors the
data files (:func:`ckptlab.checkpoint.open._open_remote_dcp`).
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

import numpy as np

from ckptlab.checkpoint._dcp_fast import DcpCheckpoint, item_order, open_columns
from ckptlab.format.layout import ArchiveLayout
from ckptlab.plan.metadata import _item_layout, _ItemLayouts

__all__ = ["RemoteItems", "open_dcp_remote"]

_HEAD = 4096  # bytes of an item read with its head: its records' headers and its pickle
_AHEAD_GAP = 1 << 20  # read-ahead: a gap up to this between item heads is moved through...
_AHEAD_SPAN = 16 << 20  # ... in one request of at most this many bytes
_KEEP = 64 << 20  # bytes of read-ahead and scans kept, over every file (oldest first out)
_WHOLE = 1 << 20  # an item scanned in full is moved whole up to this size...
_EDGE = 64 << 10  # ... else its first this many bytes (what a scan reads)...
_TAIL = _EDGE + 1024  # ... and last (the end-of-directory search reads 64 KiB + 97 bytes)


class RemoteItems(_ItemLayouts):
    """:class:`~ckptlab.plan.metadata._ItemLayouts` over ranged requests: one
    :class:`~ckptlab.format._remote.RemoteSource` per data file, read-ahead over item heads,
    a bounded keep of the bytes moved (see the module docstring)."""

    def __init__(self, root: str, sources: dict[str, Any],
                 spans: dict[str, tuple[list[int], list[int]]]) -> None:
        super().__init__(root)
        self.sources = sources  # file -> RemoteSource
        self.spans = spans  # file -> (item starts, item ends), in offset order
        self._kept: deque[tuple[str, int, int]] = deque()  # (file, lo, hi) moved, in order
        self._kept_nbytes = 0

    # -- moving bytes --------------------------------------------------------------------------
    def _move(self, file: str, lo: int, hi: int) -> None:
        """Move ``[lo, hi)`` in one request, unless all of it is kept, and keep it, dropping
        the oldest kept ranges past :data:`_KEEP`."""
        src = self.sources[file]
        hi = min(hi, src.nbytes)
        if hi <= lo or src.kept(lo, hi - lo) is not None:
            return
        src.forget(lo, hi)  # what is missing is then one range: one request
        src.prefetch([(lo, hi)])
        self._kept.append((file, lo, hi))
        self._kept_nbytes += hi - lo
        while self._kept_nbytes > _KEEP and len(self._kept) > 1:
            old_file, old_lo, old_hi = self._kept.popleft()
            self._kept_nbytes -= old_hi - old_lo
            self.sources[old_file].forget(old_lo, old_hi)

    def _around(self, file: str, lo: int, hi: int) -> tuple[int, int]:
        """What a read of ``[lo, hi)`` that missed moves: also the heads of the items next to
        it, before and after (a listing may walk a file either way), while the gaps stay
        under :data:`_AHEAD_GAP` and the span under :data:`_AHEAD_SPAN`, and without a kept
        range inside (so the miss is one request)."""
        starts, ends = self.spans.get(file, ([], []))
        kept = self.sources[file].kept_ranges()
        k = bisect.bisect_right(kept, (lo, float("inf")))
        floor = kept[k - 1][1] if k else 0  # past lo when lo is kept: nothing before
        stop = kept[k][0] if k < len(kept) else self.sources[file].nbytes
        head = max(_HEAD, hi - lo)
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
            j -= 1
        # after
        j = bisect.bisect_right(starts, lo)
        while j < len(starts):
            a, b = starts[j], min(ends[j], starts[j] + head)
            if a - hi > _AHEAD_GAP or b - first > _AHEAD_SPAN or b > stop:
                break
            hi = max(hi, b)
            j += 1
        return first, hi

    def read(self, file: str, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` at ``offset`` (fewer at the file's end): from kept bytes, else one
        request that reads ahead over the next items' heads."""
        src = self.sources[file]
        end = min(offset + nbytes, src.nbytes)
        if end <= offset:
            return b""
        data = src.kept(offset, end - offset)
        if data is None:
            self._move(file, *self._around(file, offset, end))
            data = src.read(offset, end - offset)
        return data

    def scan_item(self, file: str, offset: int, length: int) -> ArchiveLayout:
        """The item's layout, scanned from its bytes moved whole (up to :data:`_WHOLE`) or
        from its first and last :data:`_EDGE` bytes (a scan reads no tensor data)."""
        from ckptlab.format._window import PositionalFile

        head = length if length <= _WHOLE else _EDGE
        if self.sources[file].kept(offset, head) is None:  # else _around would move it again
            self._move(file, *self._around(file, offset, offset + head))
        if head < length:
            self._move(file, max(offset + head, offset + length - _TAIL), offset + length)
        return _item_layout(PositionalFile(self.sources[file]), file, offset, length)

    def fetch(self, file: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` for ``ck.read``: kept ones, else one request; not kept
        after."""
        src = self.sources[file]
        data = src.kept(start, end - start)
        if data is None:
            src.forget(start, end)  # so that what is missing is one range: one request
            data = src.read(start, end - start)
        src.forget(start, end)
        return data

    def move_whole(self, file: str, lo: int, hi: int) -> None:
        """Move ``[lo, hi)`` (an item) in one request, unless it is kept already; it is not
        counted in the bounded keep (``read`` forgets it when done)."""
        src = self.sources[file]
        if src.kept(lo, hi - lo) is None:
            src.forget(lo, hi)
            src.prefetch([(lo, hi)])

    def close(self) -> None:
        for src in self.sources.values():
            src.forget()
        self._kept.clear()
        self._kept_nbytes = 0


class RemoteDcpCheckpoint(DcpCheckpoint):
    """A :class:`~ckptlab.checkpoint._dcp_fast.DcpCheckpoint` behind a URL: ``read`` costs
    one request per part (see the module docstring)."""

    def read(self, name: str) -> Any:
        dcp = self._dcp
        items: RemoteItems = dcp.items
        moved: list[tuple[str, int, int]] = []
        if name in dcp.cols.tensors and name not in self.tensors._built:  # type: ignore
            cols = dcp.cols
            for e in dcp.by_fqn.get(dcp.fqn_ids.get(name, -1), ()):
                file = cols.files[cols.entry_file[e]]
                lo = cols.entry_offset[e]
                hi = lo + cols.entry_length[e]
                items.move_whole(file, lo, hi)
                moved.append((file, lo, hi))
        try:
            return super().read(name)
        finally:
            for file, lo, hi in moved:
                items.sources[file].forget(lo, hi)

    def dcp_layout(self) -> Any:
        """As :meth:`DcpCheckpoint.dcp_layout`, reading the items in file order first (each
        read-ahead request then serves the items after it)."""
        dcp = self._dcp
        cols = dcp.cols
        for e in dcp.order if dcp._layout is None else ():
            fqn = cols.fqns[cols.entry_fqn[e]]
            if fqn in cols.tensors:
                dcp.part(int(e), fqn, cols.tensors[fqn][0])
        return super().dcp_layout()


def _windows(cols: Any, file_of: np.ndarray, offset: np.ndarray, length: np.ndarray,
             tensor_item: np.ndarray) -> np.ndarray:
    """Per data file: how many bytes of its head the open needs (object items before the
    first tensor item, and that item's 4-byte magic); at least 1 (the size comes with it)."""
    nf = len(cols.files)
    first = np.full(nf, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, file_of[tensor_item], offset[tensor_item])
    need = np.where(first < np.iinfo(np.int64).max, first + 4, 1)
    obj = ~tensor_item
    before = offset[obj] < first[file_of[obj]]
    np.maximum.at(need, file_of[obj][before], (offset + length)[obj][before])
    return need


def open_dcp_remote(store: Any, root: str, raw: bytes) -> DcpCheckpoint | None:
    """The lazy checkpoint of the DCP directory at the URL ``root`` whose ``.metadata`` is
    ``raw`` (moved by the caller), or None where the caller must mirror the data files.

    Raises
    ------
    ArchiveError
        A data file name that leaves the directory, a request that failed; what
        :func:`ckptlab.checkpoint._dcp_fast.open_columns` raises (a missing data file, items
        past its end, chunks that do not tile their tensor...).
    """
    from ckptlab.checkpoint.open import _remote_reader
    from ckptlab.errors import ArchiveError
    from ckptlab.format._remote import RemoteNotFoundError, RemoteSource, join_url
    from ckptlab.plan._metadata_columns import decode_columns
    from ckptlab.plan.metadata import MAX_METADATA_NBYTES, METADATA, metadata_of

    if not 0 < len(raw) <= MAX_METADATA_NBYTES:
        return None
    try:
        cols = decode_columns(raw)
    except (ValueError, ArchiveError):
        return None
    if cols is None or cols.transforms or not cols.has_storage_data:
        return None
    n = cols.entries
    file_of = np.frombuffer(cols.entry_file, dtype=np.int32) if n else np.empty(0, np.int32)
    offset = np.frombuffer(cols.entry_offset, dtype=np.int64) if n else np.empty(0, np.int64)
    length = np.frombuffer(cols.entry_length, dtype=np.int64) if n else np.empty(0, np.int64)
    order = item_order(cols, file_of, offset, length)
    if order is None:
        return None  # decided before any data file is asked for
    fqn_of = np.frombuffer(cols.entry_fqn, dtype=np.int32) if n else np.empty(0, np.int32)
    is_tensor = np.array([f in cols.tensors for f in cols.fqns], dtype=bool)
    tensor_item = is_tensor[fqn_of] if n else np.zeros(0, bool)
    windows = _windows(cols, file_of, offset, length, tensor_item)
    urls = {name: join_url(root, name) for name in cols.files}  # refuses names leaving root
    sources: dict[str, Any] = {}
    for fid in sorted(range(len(cols.files)), key=cols.files.__getitem__):
        name = cols.files[fid]
        try:
            sources[name] = RemoteSource(store, urls[name], first="head",
                                         window_nbytes=int(windows[fid]))
        except RemoteNotFoundError:
            continue  # open_columns says which item's file is missing
    spans: dict[str, tuple[list[int], list[int]]] = {}
    if n:
        bounds = np.flatnonzero(np.diff(file_of[order])) + 1
        for group in np.split(order, bounds):
            spans[cols.files[file_of[group[0]]]] = (offset[group].tolist(),
                                                    (offset + length)[group].tolist())
    items = RemoteItems(root, sources, spans)
    ck = open_columns(root, cols, {name: src.nbytes for name, src in sources.items()}, items,
                      metadata_nbytes=len(raw), identity=(),
                      reader=_remote_reader(store, urls.__getitem__, items.fetch),
                      full_path=lambda name: join_url(root, name),
                      checkpoint=RemoteDcpCheckpoint,
                      metadata_loader=lambda: metadata_of(raw, join_url(root, METADATA)))
    items.close()  # the heads moved at open did their work (object items are scanned)
    return ck
