"""``ckptlab offsets`` of any checkpoint, local or behind a URL; opening one; JSON out."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ckptlab.cli._checks import _is_url
from ckptlab.cli._text import _table, _text
from ckptlab.errors import InvalidArgumentError


# -- offsets of any checkpoint ----------------------------------------------------------------
def _sniff_file(path: str) -> str | None:
    """:func:`ckptlab.format.inspect.sniff` of a local file; None for a directory."""
    from ckptlab.format.inspect import sniff
    from ckptlab.source._bytes import ByteSource

    if os.path.isdir(path):
        return None
    with ByteSource(path) as src:
        return sniff(src)


# sniff's kinds that take the torch.save offsets path first: a zip, and files that are no
# checkpoint at all (its own errors for an empty or foreign file); safetensors, legacy files
# and directories go through the checkpoint model
_STORAGE_OFFSETS_KINDS = ("torch-zip", "empty", "unknown")


def _other_zip(refusal: Exception, open_model: Callable[[], Any]) -> Any:
    """The checkpoint model of a zip that :func:`ckptlab.format.storage_offsets` refused
    (``refusal``, an UnsupportedFormatError) as no torch.save archive: sniff says "torch-zip"
    of any zip, so what it is is told by its records, as :func:`ckptlab.open` tells it
    (``ckptlab.checkpoint._torchscript.model_zip``: TorchScript, torch.export). A zip the
    model does not read as one of those keeps the refusal."""
    from ckptlab.errors import UnsupportedFormatError

    try:
        ck = open_model()
    except UnsupportedFormatError:
        raise refusal from None
    if ck.format == "torch-zip":  # a torch.save archive after all: the refusal stands
        raise refusal
    return ck


class _Count:
    """Read calls and bytes of the header pass, per file and in words."""

    def __init__(self) -> None:
        self.reads = 0
        self.bytes_read = 0
        self.files: dict[str, dict[str, Any]] = {}

    def add(self, file: str, how: str, reads: int, nbytes: int) -> None:
        entry = self.files.setdefault(file, {"how": how, "reads": 0, "bytes_read": 0})
        entry["reads"] += reads
        entry["bytes_read"] += nbytes
        self.reads += reads
        self.bytes_read += nbytes


def _mismatch(ck: Any, key: str, part: Any, found: int | None) -> NoReturn:
    from ckptlab.errors import CorruptArchiveError

    raise CorruptArchiveError(
        "the file's headers and ckptlab's checkpoint model place this tensor differently "
        "(the file changed while it was read, or a bug in ckptlab: report it)",
        path=os.path.join(ck.path, part.file) if len(ck.files) > 1 else ck.path, record=key,
        offset=part.offset, expected=part.offset, actual=found)


def _check_parts(ck: Any, parts: list[tuple[str, Any]], found: Callable[[Any], int | None]
                 ) -> None:
    for key, part in parts:
        at = found(part)
        if at != part.offset:
            _mismatch(ck, key, part, at)


def _itemsize(dtype: str) -> int:
    from ckptlab.format._dtypes import DTYPE_ITEMSIZE

    return DTYPE_ITEMSIZE.get(dtype, 1)


def _dcp_header_pass(ck: Any, entry: Any, parts: list[tuple[str, Any]], count: _Count,
                     item_nbytes: dict[tuple[str, int], int]) -> None:
    """A DCP data file: each torch.save item's zip directory (the storage offsets way), each
    safetensors blob's header; a compressed chunk's place is in .metadata (no read)."""
    import bisect

    from ckptlab.cli import storage_offsets
    from ckptlab.format.layout import SegmentKind
    from ckptlab.format.safetensors import scan_safetensors
    from ckptlab.source._bytes import ByteSource
    from ckptlab.source._window import FileWindow

    starts = [s.offset for s in entry.segments]
    found: dict[int, Callable[[Any], int | None]] = {}
    with open(entry.full_path, "rb") as fh:
        for key, part in parts:
            item = part.item_offset if part.item_offset is not None else part.offset
            if part.compression is not None:
                if part.offset != item:
                    _mismatch(ck, key, part, item)
                continue
            if item not in found:
                i = bisect.bisect_right(starts, item) - 1
                kind = entry.segments[i].kind if i >= 0 and entry.segments[i].offset == item \
                    else None
                if kind is SegmentKind.LOCAL_HEADER:
                    nbytes = item_nbytes.get((entry.path, item), entry.nbytes - item)
                    window = FileWindow(fh, item, nbytes, f"{entry.full_path}@{item}")
                    so = storage_offsets(window)
                    count.add(entry.path, "item zip directories", so.reads, so.bytes_read)
                    first = next(iter(so.offsets.values()), None)
                    found[item] = (lambda p, first=first, item=item: None if first is None
                                   else item + first + p.storage_offset * _itemsize(p.dtype))
                elif kind is SegmentKind.HEADER_LENGTH:
                    window = FileWindow(fh, item, entry.nbytes - item,
                                        f"{entry.full_path}@{item}")
                    with ByteSource(window) as src:
                        blob = scan_safetensors(src)
                    count.add(entry.path, "safetensors header", src.reads, src.bytes_read)
                    where = {s.key: item + s.data_offset for s in blob.storages}
                    found[item] = lambda p, where=where: where.get(p.storage_key)
                else:
                    found[item] = lambda p: p.offset  # a layout ckptlab only models
                    count.files.setdefault(entry.path, {"how": "not counted", "reads": 0,
                                                        "bytes_read": 0})
            at = found[item](part)
            if at != part.offset:
                _mismatch(ck, key, part, at)


def checkpoint_offsets(ck: Any) -> dict[str, Any]:
    """``ckptlab offsets --json`` of a checkpoint that is not one torch.save file.

    ``offsets`` maps every tensor part (keys as :func:`ckptlab.gds.readiness.tensor_ranges`
    names them) to the absolute offset of its bytes in its file; ``files`` and ``nbytes``
    say which file and how many bytes. The offsets are the checkpoint model's; a second,
    counted pass re-derives each from its file's headers alone (safetensors: the header;
    torch.save: the zip directory, as ``storage_offsets`` does; DCP: ``.metadata`` and each
    item's zip directory or safetensors header) and must agree. ``reads`` and
    ``bytes_read`` count that pass: what a reader needs to find the bytes without loading
    anything. Files of a kind it does not cover are listed in ``uncounted_files``.
    """
    from ckptlab.cli import storage_offsets
    from ckptlab.format.safetensors import scan_safetensors
    from ckptlab.gds.readiness import tensor_ranges
    from ckptlab.source._bytes import ByteSource

    parts = [(r.name, p) for r, p in zip(
        tensor_ranges(ck), (p for t in ck.tensors.values() for p in t.parts), strict=True)]
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for key, part in parts:
        by_file.setdefault(part.file, []).append((key, part))
    count = _Count()
    item_nbytes: dict[tuple[str, int], int] = {}
    if ck.format == "dcp":
        from ckptlab.dcp import METADATA, inspect_dcp

        meta = inspect_dcp(ck.path, item_layouts=False)  # .metadata alone, in one read
        count.add(METADATA, ".metadata", 1, meta.metadata_nbytes)
        item_nbytes = {(i.file, i.offset): i.nbytes for i in meta.items}
    for entry in ck.files:
        if entry.format == "json" and entry.path.endswith(".json") and ".index" in entry.path:
            count.add(entry.path, "index", 1, entry.nbytes)  # names the shards
    uncounted = []
    for entry in ck.files:
        mine = by_file.get(entry.path)
        if not mine:
            continue
        if not entry.full_path:
            uncounted.append(entry.path)
        elif entry.format == "safetensors":
            with ByteSource(entry.full_path) as src:
                layout = scan_safetensors(src)
            count.add(entry.path, "safetensors header", src.reads, src.bytes_read)
            where = {s.key: s.data_offset for s in layout.storages}
            _check_parts(ck, mine, lambda p, where=where: where.get(p.storage_key))
        elif entry.format == "torch-zip":
            so = storage_offsets(entry.full_path)
            count.add(entry.path, "zip directory", so.reads, so.bytes_read)
            _check_parts(ck, mine, lambda p, so=so: None if p.storage_key not in so.offsets
                         else so.offsets[p.storage_key] + p.storage_offset * _itemsize(p.dtype))
        elif entry.format == "distcp":
            _dcp_header_pass(ck, entry, mine, count, item_nbytes)
        else:
            uncounted.append(entry.path)
    uncounted += [f for f, c in count.files.items() if c["how"] == "not counted"]
    doc: dict[str, Any] = {
        "offsets": {k: p.offset for k, p in parts},
        "files": {k: p.file for k, p in parts},
        "nbytes": {k: p.nbytes for k, p in parts},
        "reads": count.reads if count.files or not uncounted else None,
        "bytes_read": count.bytes_read if count.files or not uncounted else None,
        "method": "headers" if count.files else "model", "format": ck.format,
        "path": ck.path,
        "tensors": {k: name for (k, _), name in zip(parts, (
            t.name for t in ck.tensors.values() for _ in t.parts))},
        "read_per_file": {f: c for f, c in count.files.items() if c["how"] != "not counted"},
        "uncounted_files": sorted(set(uncounted))}
    compressed = {k: p.compression for k, p in parts if p.compression is not None}
    if compressed:
        doc["compression"] = compressed
    return doc


def render_offsets(doc: dict[str, Any]) -> str:
    """``ckptlab offsets`` of any checkpoint: one row per tensor part, then what was read."""
    multi = len(set(doc["files"].values())) > 1
    compressed = doc.get("compression", {})
    chunked = any("@" in k and doc["tensors"].get(k) != k for k in doc["offsets"])
    unit = "tensor (@chunk offsets)" if chunked else "tensor"
    rows = []
    for key, offset in sorted(doc["offsets"].items(),
                              key=lambda kv: (doc["files"][kv[0]], kv[1], kv[0])):
        row = [_text(key)]
        if multi:
            row.append(_text(doc["files"][key]))
        row += [f"{offset:,}", f"{doc['nbytes'][key]:,}"]
        if compressed:
            row.append(compressed.get(key, "-"))
        rows.append(row)
    header = [unit, *(["file"] * multi), "data offset", "bytes",
              *(["compressed"] * bool(compressed))]
    right = {header.index("data offset"), header.index("bytes")}
    out = [_table(rows, header, right) if rows else "(no tensors)"]
    if doc["reads"] is None:
        out.append(f"reads not counted: ckptlab has no header-only reader for "
                   f"{', '.join(doc['uncounted_files'])}; the offsets come from its model")
    else:
        hows: dict[str, list[int]] = {}
        for c in doc["read_per_file"].values():
            acc = hows.setdefault(c["how"], [0, 0])
            acc[0] += 1
            acc[1] += c["reads"]
        said = "; ".join((f"{how} of {files} files" if files > 1 else how)
                         + f" ({reads} read{'s' * (reads != 1)})"
                         for how, (files, reads) in hows.items())
        out.append(f"{doc['reads']} read{'s' * (doc['reads'] != 1)}, {doc['bytes_read']:,} "
                   f"bytes read: {said}")
        if doc["uncounted_files"]:
            out.append(f"not counted (no header-only reader): "
                       f"{', '.join(doc['uncounted_files'])}")
    if compressed:
        out.append("a compressed chunk's offset and bytes are those of its stored frame: it is "
                   "inflated on read, never read in place")
    return "\n".join(out)


# -- output ---------------------------------------------------------------------------------
def _print_json(obj: Any) -> None:
    """One JSON object: indented for a person at a terminal, one compact line for a pipe."""
    if sys.stdout.isatty():
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(json.dumps(obj, separators=(",", ":"), default=str))


def _needs(extra: str, exc: ImportError) -> NoReturn:
    raise InvalidArgumentError(
        f"this verb needs {exc.name or 'a missing module'}: install ckptlab's '{extra}' extra "
        f"(pip install 'ckptlab[{extra}]')") from None


def _open(path: str) -> tuple[Any, Any]:
    """The checkpoint at ``path``, and for a URL the store counting its requests (else None)."""
    if _is_url(path):
        from ckptlab.checkpoint.open import open_url

        return open_url(path)
    from ckptlab.checkpoint import open_checkpoint

    return open_checkpoint(path), None


def _dcp_layout(ck: Any) -> Any:
    from ckptlab.checkpoint._json import dcp_layout_of

    return dcp_layout_of(ck)


def _url_records_layout(ck: Any) -> Any:
    """``inspect --records`` of a checkpoint behind a URL: its byte-level layout."""
    if ck.format == "dcp":
        return _dcp_layout(ck)
    if len(ck.files) == 1 and ck.files[0].layout is not None:
        return ck.files[0].layout
    raise InvalidArgumentError(
        f"{ck.path}: --records shows one torch.save or safetensors file, or a DCP directory; "
        f"this is a {ck.format} checkpoint of {len(ck.files)} files: run without --records")


def url_offsets(path: str, scan: bool = False) -> dict[str, Any]:
    """``ckptlab offsets --json`` of a URL: ``reads`` and ``bytes_read`` count HTTP requests
    (or store requests) and the bytes they moved, the opening's included.

    A torch.save file: :func:`ckptlab.format.storage_offsets` through the remote file (the
    tail request, the directory if longer, the head records: at most 3 requests). Other
    checkpoints: the offsets of the opened model (each format's headers, see
    :func:`ckptlab.open`), read through the same store from the bytes already moved: a
    TorchScript or torch.export zip (told by its records), a directory URL written without
    its ``/`` (the redirect that says it is one is counted).
    """
    import dataclasses

    from ckptlab.checkpoint.open import directory_location, open_location
    from ckptlab.cli import storage_offsets
    from ckptlab.errors import UnsupportedFormatError
    from ckptlab.format._placed import looks_like_zip
    from ckptlab.source import IsDirectoryError, locate
    from ckptlab.source._remote import RemoteFileObject, RemoteSource

    where = locate(path)
    assert where.tree is not None and where.tree.store is not None  # a URL, not file://
    store = where.tree.store
    src = ck = None
    if where.file is not None and not (where.rel or "").endswith((".json", ".metadata",
                                                                  ".safetensors")):
        try:
            src = RemoteSource(store, where.file, first="tail")
        except IsDirectoryError as exc:  # "dir": the server says it is "dir/"
            where = directory_location(where, exc)
        else:
            if looks_like_zip(src):
                try:
                    result = storage_offsets(RemoteFileObject(src), scan=scan)
                except UnsupportedFormatError as refusal:
                    opened = src
                    ck = _other_zip(refusal, lambda: open_location(where, opened)[0])
                else:
                    result = dataclasses.replace(result, reads=store.stats.requests,
                                                 bytes_read=store.stats.bytes_moved)
                    return {**result.to_dict(), "format": "torch-zip", "path": path}
    if scan:
        raise InvalidArgumentError(
            f"{path}: --scan takes the storage order from a torch.save file's data.pkl; "
            "this is not a torch.save file: run without --scan")
    if ck is None:
        ck, _ = open_location(where, src)
    from ckptlab.gds.readiness import tensor_ranges

    parts = [(r.name, p) for r, p in zip(
        tensor_ranges(ck), (p for t in ck.tensors.values() for p in t.parts), strict=True)]
    return {"offsets": {k: p.offset for k, p in parts}, "files": {k: p.file for k, p in parts},
            "nbytes": {k: p.nbytes for k, p in parts}, "reads": store.stats.requests,
            "bytes_read": store.stats.bytes_moved, "method": "headers", "format": ck.format,
            "path": ck.path,
            "tensors": {k: name for (k, _), name in zip(parts, (
                t.name for t in ck.tensors.values() for _ in t.parts))},
            "read_per_file": {}, "uncounted_files": []}
