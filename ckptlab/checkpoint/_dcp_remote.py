"""DCP directories behind URLs as a lazy :class:`~ckptlab.checkpoint.Checkpoint`, opened at
the cost of their ``.metadata``.

The bytes are read by :mod:`ckptlab.dcp.remote` (``.metadata`` and one head request per data
file at open; item heads with read-ahead afterwards); this module builds the checkpoint from
them (:func:`ckptlab.checkpoint._dcp_fast.open_columns`) and its ``read``: ``ck.read(name)``
costs **one request per part**: a tensor not built yet has each of its items moved whole
(header, data, directory: one request each), its entry built from those bytes and its data
taken from them; a tensor built already has each part's data moved.

Anything the remote read does not take returns None: the caller then mirrors the data files
(:func:`ckptlab.checkpoint.open._open_remote_dcp`).
"""

from __future__ import annotations

from typing import Any

from ckptlab.checkpoint._dcp_fast import DcpCheckpoint, open_columns
from ckptlab.dcp.remote import RemoteItems

__all__ = ["RemoteDcpCheckpoint", "open_dcp_remote"]


class RemoteDcpCheckpoint(DcpCheckpoint):
    """A :class:`~ckptlab.checkpoint._dcp_fast.DcpCheckpoint` behind a URL: ``read`` costs
    one request per part (see the module docstring)."""

    _url_of: Any = None  # data file name -> URL (set by open_dcp_remote)
    _store: Any = None

    def read(self, name: str) -> Any:
        dcp = self._dcp
        items: RemoteItems = dcp.items
        if name not in dcp.cols.tensors or name in self.tensors._built:  # type: ignore
            return super().read(name)
        # the entry is not built: each item moved whole (one request each, outside the
        # lock), the entry built from those bytes (kept for that time only), the tensor's
        # data sliced from them
        cols = dcp.cols
        moved: dict[str, list[tuple[int, bytes]]] = {}
        for e in dcp.by_fqn.get(dcp.fqn_ids.get(name, -1), ()):
            file = cols.files[cols.entry_file[e]]
            lo = cols.entry_offset[e]
            data = items.sources[file].fetch(lo, lo + cols.entry_length[e])
            moved.setdefault(file, []).append((lo, data))
        with items.lock:
            for file, pieces in moved.items():
                for lo, data in pieces:
                    items.sources[file].keep(lo, data)
            try:
                entry = self.tensors[name]
            finally:
                for file, pieces in moved.items():
                    for lo, data in pieces:
                        items.sources[file].forget(lo, lo + len(data))

        def fetch(file: str, start: int, end: int) -> bytes:
            for lo, data in moved.get(file, ()):
                if lo <= start and end <= lo + len(data):
                    return data[start - lo:end - lo]
            return items.fetch(file, start, end)

        from ckptlab.checkpoint.open import _remote_reader

        return _remote_reader(self._store, self._url_of, fetch)(self, entry)

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
    from ckptlab.dcp import METADATA, metadata_of
    from ckptlab.dcp.remote import remote_items
    from ckptlab.format._remote import join_url

    found = remote_items(store, root, raw)
    if found is None:
        return None
    items, entries, urls = found
    sizes = {name: src.nbytes for name, src in items.sources.items()}
    ck = open_columns(root, entries.cols, sizes, items, metadata_nbytes=len(raw), identity=(),
                      reader=_remote_reader(store, urls.__getitem__, items.fetch),
                      full_path=lambda name: join_url(root, name),
                      checkpoint=RemoteDcpCheckpoint,
                      metadata_loader=lambda: metadata_of(raw, join_url(root, METADATA)),
                      entries=entries)
    items.close()  # the heads moved at open did their work (object items are scanned)
    if ck is not None:
        ck._url_of = urls.__getitem__
        ck._store = store
    return ck
