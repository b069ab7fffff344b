"""An on-disk inspection cache: what a checkpoint holds, kept between runs, keyed by identity.

Opening a 100,000-tensor torch.save file takes seconds (the pickle is interpreted, every
record placed); the served app and ``inspect`` need only the tensor table and the totals to
show something. :class:`CheckpointIndex` is that table, columnar and JSON-ready, and
:class:`InspectionCache` keeps one per checkpoint on disk so the second look is instant.

Keys are the checkpoint's *identity*: for a file, its real path, size, ``mtime_ns`` and the
SHA-256 of its first and last 64 KiB; for a directory, the same for each regular file directly
inside it (the files :func:`ckptlab.open` reads). A rewritten file is another checkpoint.

Entries are never pickles (a cache directory is as untrusted as the checkpoints are). An entry
is one compact columnar file (:func:`encode_index`): a magic line, a JSON header (the
:data:`CACHE_VERSION`, the identity, the small fields, the string tables and where each column
is) and the columns as little-endian int64/int32 arrays and UTF-8 text, read back with
``numpy.frombuffer`` (a 100,000-tensor index in tens of milliseconds, where the same columns as
per-entry JSON took 0.3 s). A SHA-256 of everything else in the entry (magic, header, columns)
sits before the header, and the columns are checked against each other (each tensor's bytes
are its parts' bytes, its offset and file its first part's, the columns laid out one after the
other in a fixed order). Entries are written atomically (a temporary file in the same
directory, then ``os.replace``) and are bounded in total size (the least recently used go
first; temporary files count too, and those a killed writer left behind are removed). An entry
is read from one descriptor (never following a link, never blocking on a FIFO, never past the
size bound): one that is not a regular file, is too large, does not parse, fails its checksum
or any column check, is of another version, or describes another identity is a miss, removed
and rebuilt; a cache directory that cannot be written makes the cache a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

from ckptlab.errors import InvalidArgumentError
from ckptlab.format._bulk import columns, fields

__all__ = ["CACHE_VERSION", "CheckpointIndex", "InspectionCache", "cache_dir", "decode_index",
           "encode_index", "identity_of"]

# 4: a Hugging Face directory's tensors in file order (shards by name; 3 kept the index's
# order of first mention); 3: the SHA-256 covers the header too and sits before it, the
# columns are cross-checked; 2: the SHA-256 covered the columns only; 1: one JSON document
# per entry (``.json``)
CACHE_VERSION = 4
EDGE_NBYTES = 64 * 1024  # bytes hashed at each end of a file
DEFAULT_MAX_NBYTES = 256 * 2**20  # the whole cache directory's entries
_SUFFIX = ".ckix"
_OLD_SUFFIXES = (".json",)  # earlier versions' entries: never read, pruned like the others
_MAGIC = b"CKPTLAB-INDEX\n"
_HEADER_MAX = 64 * 2**20  # a header longer than this is damage, not an index
_LEN_END = len(_MAGIC) + 8  # the header's length field ends here
_DIGEST_END = _LEN_END + 32  # then the SHA-256 of the rest of the entry (raw bytes)
_TMP_PREFIX = ".tmp-"  # a temporary entry, renamed into place once written
_TMP_MAX_AGE_NS = 10 * 60 * 10**9  # a temporary file untouched this long is a dead writer's
# the int64 columns, in the order they are stored; "parts" columns have one item per part
_INT_COLUMNS = (("nbytes", "tensors"), ("parameters", "tensors"), ("file", "tensors"),
                ("offset", "tensors"), ("part_start", "tensors+1"), ("part_file", "parts"),
                ("part_offset", "parts"), ("part_nbytes", "parts"))
# the string columns kept as a table of distinct values and an int32 code per row
_CODED_COLUMNS = (("dtypes", "tensors"), ("shapes", "tensors"), ("kinds", "tensors"),
                  ("part_role", "parts"))
# every column of the body, in the order it is stored, with its item size (0: the names'
# UTF-8 text, which takes the rest of the body)
_LAYOUT = (*((name, 8, size) for name, size in _INT_COLUMNS),
           *((name, 4, size) for name, size in _CODED_COLUMNS),
           ("name_ends", 8, "tensors"), ("names", 0, ""))


def cache_dir() -> Path:
    """Where the cache lives: ``$CKPTLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptlab``, else
    ``~/.cache/ckptlab``."""
    override = os.environ.get("CKPTLAB_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "ckptlab"


def _file_identity(path: str) -> dict[str, Any]:
    st = os.stat(path)
    head = hashlib.sha256()
    tail = hashlib.sha256()
    with open(path, "rb") as f:
        first = f.read(EDGE_NBYTES)
        head.update(first)
        if st.st_size > EDGE_NBYTES:
            f.seek(max(st.st_size - EDGE_NBYTES, 0))
            tail.update(f.read(EDGE_NBYTES))
        else:
            tail.update(first)
    return {"nbytes": st.st_size, "mtime_ns": st.st_mtime_ns, "head": head.hexdigest(),
            "tail": tail.hexdigest()}


def identity_of(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The identity the cache keys a checkpoint by (see the module docstring).

    Raises
    ------
    OSError
        The path cannot be read.
    """
    full = os.path.realpath(os.fspath(path))
    if os.path.isdir(full):
        members = {}
        for name in sorted(os.listdir(full)):
            member = os.path.join(full, name)
            if os.path.isfile(member):
                members[name] = _file_identity(member)
        return {"path": full, "kind": "dir", "files": members}
    return {"path": full, "kind": "file", **_file_identity(full)}


def _key(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


_PARTS, _KIND = attrgetter("parts"), attrgetter("kind")
_ENTRY_NAMES = ("name", "dtype", "shape", "kind")
_PART_NAMES = ("role", "file", "offset", "nbytes")


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


@dataclass(frozen=True, eq=False)
class CheckpointIndex:
    """What a checkpoint holds, as columns: one row per tensor, its parts flattened.

    Built from a :class:`~ckptlab.checkpoint.Checkpoint` (:meth:`from_checkpoint`) or read
    back from a cache entry (:func:`decode_index`); it needs no file access to be shown. Row
    ``i`` is the checkpoint's ``i``-th tensor; its parts are
    ``part_*[part_start[i]:part_start[i + 1]]``. ``file`` and ``part_file`` index ``files``;
    ``nbytes[i]`` is the sum of its parts' ``part_nbytes``; ``offset[i]`` and ``file[i]`` are
    its first part's (-1 for a tensor without parts).
    """

    format: str
    path: str
    files: tuple[tuple[str, str, int], ...]  # (path relative to the checkpoint, format, nbytes)
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[str, ...]  # "[2, 3]", "?" where only the bytes know it
    kinds: tuple[str, ...]
    nbytes: tuple[int, ...]
    parameters: tuple[int, ...]
    file: tuple[int, ...]
    offset: tuple[int, ...]
    part_start: tuple[int, ...]  # len(names) + 1
    part_role: tuple[str, ...]
    part_file: tuple[int, ...]
    part_offset: tuple[int, ...]
    part_nbytes: tuple[int, ...]
    objects: dict[str, Any]  # name -> inert JSON-ready value (plain_value)
    notes: tuple[str, ...] = ()

    @classmethod
    def from_checkpoint(cls, ck: Any) -> CheckpointIndex:
        """The index of an opened :class:`~ckptlab.checkpoint.Checkpoint`."""
        file_ids = {f.path: i for i, f in enumerate(ck.files)}
        entries = list(ck.tensors.values())
        if entries and set(map(len, map(_PARTS, entries))) == {1} and \
                set(map(_KIND, entries)) <= {"dense", "quantized"}:
            return cls._one_part_each(ck, entries, file_ids)
        names, dtypes, shapes, kinds, nbytes, params, file, offset = ([] for _ in range(8))
        start = [0]
        roles, pfile, poff, pnb = [], [], [], []
        for t in ck.tensors.values():
            names.append(t.name)
            dtypes.append(t.dtype)
            shapes.append(_shape_text(t.shape))
            kinds.append(t.kind)
            total = 0
            for p in t.parts:
                roles.append(p.role)
                pfile.append(file_ids.get(p.file, -1))
                poff.append(p.offset)
                pnb.append(p.nbytes)
                total += p.nbytes
            start.append(len(roles))
            nbytes.append(total)
            params.append(t.parameters)
            first = t.parts[0] if t.parts else None
            file.append(file_ids.get(first.file, -1) if first is not None else -1)
            offset.append(first.offset if first is not None else -1)
        return cls(ck.format, str(ck.path),
                   tuple((f.path, f.format, f.nbytes) for f in ck.files),
                   tuple(names), tuple(dtypes), tuple(shapes), tuple(kinds), tuple(nbytes),
                   tuple(params), tuple(file), tuple(offset), tuple(start), tuple(roles),
                   tuple(pfile), tuple(poff), tuple(pnb), dict(ck.objects), tuple(ck.notes))

    @classmethod
    def _one_part_each(cls, ck: Any, entries: list[Any], file_ids: dict[str, int]
                       ) -> CheckpointIndex:
        """:meth:`from_checkpoint` of dense (or quantized) tensors of one part each (the
        common case), column by column: the same index as the loop makes."""
        names, dtypes, shape_values, kinds = map(tuple, fields(entries, _ENTRY_NAMES))
        parts = list(map(itemgetter(0), map(_PARTS, entries)))
        roles, part_files, offsets, nbytes = map(tuple, fields(parts, _PART_NAMES))
        files = tuple(map(file_ids.get, part_files, repeat(-1)))
        texts: dict[Any, tuple[str, int]] = {}  # shape -> (its text, its elements)
        for shape in set(shape_values):
            numel = None if shape is None or any(d < 0 for d in shape) else math.prod(shape)
            texts[shape] = (_shape_text(shape), numel or 0)
        shapes, params = map(tuple, columns(list(map(texts.__getitem__, shape_values)), 2))
        return cls(ck.format, str(ck.path),
                   tuple((f.path, f.format, f.nbytes) for f in ck.files),
                   names, dtypes, shapes, kinds, nbytes, params, files, offsets,
                   tuple(range(len(entries) + 1)), roles, files, offsets, nbytes,
                   dict(ck.objects), tuple(ck.notes))

    # -- totals -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.names)

    @property
    def file_nbytes(self) -> int:
        """Bytes of every file of the checkpoint."""
        return sum(f[2] for f in self.files)

    def tied_rows(self) -> frozenset[int]:
        """Rows whose parts are exactly an earlier row's (tied weights: one tensor's bytes
        under two names), by :func:`ckptlab.checkpoint.model.tied_rows`; worked out once."""
        found = self.__dict__.get("_tied_rows")
        if found is None:
            from ckptlab.checkpoint.model import tied_rows

            starts = self.part_start
            found = frozenset(tied_rows([tuple(zip(
                self.part_role[lo:hi], self.part_file[lo:hi], self.part_offset[lo:hi],
                self.part_nbytes[lo:hi])) for lo, hi in itertools.pairwise(starts)]))
            object.__setattr__(self, "_tied_rows", found)  # a memo of frozen data
        return found

    @property
    def total_parameters(self) -> int:
        """Parameters, a tied tensor's once."""
        tied = self.tied_rows()
        return sum(p for i, p in enumerate(self.parameters) if i not in tied)

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of the tensors, a tied tensor's once."""
        tied = self.tied_rows()
        return sum(n for i, n in enumerate(self.nbytes) if i not in tied)

    def totals_by_dtype(self) -> dict[str, tuple[int, int, int]]:
        """dtype -> (tensors, parameters, bytes), largest bytes first; a tied tensor counts
        as a tensor, its parameters and bytes once."""
        out: dict[str, list[int]] = {}
        tied = self.tied_rows()
        for i, (dtype, params, nb) in enumerate(zip(self.dtypes, self.parameters, self.nbytes)):
            row = out.setdefault(dtype, [0, 0, 0])
            row[0] += 1
            if i not in tied:
                row[1] += params
                row[2] += nb
        return {k: (v[0], v[1], v[2]) for k, v in
                sorted(out.items(), key=lambda kv: (-kv[1][2], kv[0]))}

    def parts_of(self, row: int) -> list[tuple[str, str, int, int]]:
        """(role, file path, offset, nbytes) of tensor ``row``'s parts."""
        lo, hi = self.part_start[row], self.part_start[row + 1]
        return [(self.part_role[i], self.files[self.part_file[i]][0]
                 if self.part_file[i] >= 0 else "", self.part_offset[i], self.part_nbytes[i])
                for i in range(lo, hi)]

    def row_of(self, name: str) -> int:
        """The row of tensor ``name`` (KeyError when there is none)."""
        rows = self.__dict__.get("_rows")
        if rows is None:
            rows = {n: i for i, n in enumerate(self.names)}
            object.__setattr__(self, "_rows", rows)  # a memo of frozen data
        try:
            return rows[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of {self.path}") from None

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The columns as JSON-ready lists (to compare indexes, or to show one as JSON)."""
        return {"format": self.format, "path": self.path,
                "files": [list(f) for f in self.files],
                "names": list(self.names), "dtypes": list(self.dtypes),
                "shapes": list(self.shapes), "kinds": list(self.kinds),
                "nbytes": list(self.nbytes), "parameters": list(self.parameters),
                "file": list(self.file), "offset": list(self.offset),
                "part_start": list(self.part_start), "part_role": list(self.part_role),
                "part_file": list(self.part_file), "part_offset": list(self.part_offset),
                "part_nbytes": list(self.part_nbytes), "objects": self.objects,
                "notes": list(self.notes)}


def _text_column(values: tuple[str, ...]) -> tuple[bytes, list[int]]:
    """``values`` as one UTF-8 text and each value's end, counted in characters."""
    ends = list(itertools.accumulate(map(len, values)))
    return "".join(values).encode("utf-8", "surrogatepass"), ends


def _entry_digest(view: memoryview) -> bytes:
    """The SHA-256 of an entry's bytes other than the digest itself (magic, header length,
    header, body)."""
    digest = hashlib.sha256(view[:_LEN_END])
    digest.update(view[_DIGEST_END:])
    return digest.digest()


def _check_columns(ints: dict[str, Any], n: int, nparts: int, nfiles: int,
                   fail: Callable[[str], Exception], at: Callable[[str, int], str]) -> None:
    """Check the int64 columns against each other (see :class:`CheckpointIndex`).

    ``ints`` maps each of :data:`_INT_COLUMNS` to an int64 array of its length; ``at(name,
    row)`` says where item ``row`` of column ``name`` is (for the message); ``fail`` makes the
    error raised.
    """
    import numpy as np

    start = ints["part_start"]
    down = start[1:] < start[:-1]
    bad: tuple[int, str] | None = None
    if int(start[0]) != 0:
        bad = (0, "0")
    elif bool(down.any()):
        row = int(np.flatnonzero(down)[0]) + 1
        bad = (row, f">= {int(start[row - 1]):,}")
    elif int(start[-1]) != nparts:
        bad = (n, f"{nparts:,}")
    if bad is not None:
        row, want = bad
        raise fail(f"column 'part_start' item {row:,}{at('part_start', row)}: expected "
                   f"{want} (ascending from 0 to the {nparts:,} parts), got {int(start[row]):,}")
    for name in ("file", "part_file"):
        col = ints[name]
        if col.size and not (-1 <= int(col.min()) and int(col.max()) < nfiles):
            raise fail(f"column {name!r}: expected file indexes in [-1, {nfiles}), got "
                       f"[{int(col.min())}, {int(col.max())}]")

    def first_bad(bad: Any) -> int:
        return int(np.flatnonzero(bad)[0])

    part_nbytes = ints["part_nbytes"]
    if part_nbytes.size and int(part_nbytes.min()) < 0:
        row = first_bad(part_nbytes < 0)
        raise fail(f"column 'part_nbytes' part {row:,}{at('part_nbytes', row)}: expected a "
                   f"size >= 0, got {int(part_nbytes[row]):,}")
    ends = np.cumsum(part_nbytes)  # int64: a sum past int64 wraps below the one before it
    if ends.size > 1 and bool((ends[1:] < ends[:-1]).any()):
        raise fail("column 'part_nbytes': expected parts' sizes that sum within int64")
    # start is ascending within [0, nparts]: every index below is in range
    sums = np.concatenate((np.zeros(1, dtype=np.int64), ends))
    lo, hi = start[:-1], start[1:]
    expected = {"nbytes": (sums[hi] - sums[lo], "the sum of its parts' part_nbytes")}
    has = hi > lo
    for name, part_name in (("offset", "part_offset"), ("file", "part_file")):
        firsts = np.full(n, -1, dtype=np.int64)
        firsts[has] = ints[part_name][lo[has]]
        expected[name] = (firsts, f"its first part's {part_name} (-1 without parts)")
    for name, (want, what) in expected.items():
        bad = ints[name] != want
        if bool(bad.any()):
            row = first_bad(bad)
            raise fail(f"column {name!r} row {row:,}{at(name, row)}: expected {int(want[row]):,} "
                       f"({what}), got {int(ints[name][row]):,}")


def encode_index(index: CheckpointIndex, identity: dict[str, Any]) -> bytes:
    """One cache entry: ``index`` of the checkpoint with ``identity``, in the columnar format.

    The layout: :data:`_MAGIC`, the header's length (8 bytes, little-endian), the SHA-256 (32
    raw bytes) of everything else in the entry, the header (JSON: ``version``, ``identity``,
    the small fields, ``tensors``, ``parts``, the string tables, ``columns``: ``name -> [start,
    nbytes]`` within the body), then the body: the int64 columns, the int32 codes of the string
    columns, the names' character ends (int64) and the names as one UTF-8 text, one after the
    other in the order of :data:`_LAYOUT`.

    Raises
    ------
    OverflowError
        A number does not fit int64 (the entry is then not stored).
    InvalidArgumentError
        The columns break one of :class:`CheckpointIndex`'s invariants (such an entry would
        never be read back, so it is not stored).
    """
    import numpy as np

    n, nparts = len(index), len(index.part_role)
    chunks: list[bytes] = []
    where: dict[str, list[int]] = {}
    at = 0

    def put(name: str, data: bytes) -> None:
        nonlocal at
        where[name] = [at, len(data)]
        chunks.append(data)
        at += len(data)

    counts = {"tensors": n, "tensors+1": n + 1, "parts": nparts}
    for name, size in (*_INT_COLUMNS, *_CODED_COLUMNS):
        if len(getattr(index, name)) != counts[size]:
            raise InvalidArgumentError(f"index of {index.path}: column {name!r}: expected "
                                       f"{counts[size]:,} items, got "
                                       f"{len(getattr(index, name)):,}")
    ints = {name: np.array(getattr(index, name), dtype="<i8") for name, _ in _INT_COLUMNS}
    _check_columns(ints, n, nparts, len(index.files),
                   lambda what: InvalidArgumentError(f"index of {index.path}: {what}"),
                   lambda name, row: "")
    for name, _ in _INT_COLUMNS:
        put(name, ints[name].tobytes())
    tables: dict[str, list[str]] = {}
    for name, _ in _CODED_COLUMNS:
        values = getattr(index, name)
        table = list(dict.fromkeys(values))
        codes = dict(zip(table, range(len(table))))
        tables[name] = table
        put(name, np.fromiter(map(codes.__getitem__, values), dtype="<i4",
                              count=len(values)).tobytes())
    text, ends = _text_column(index.names)
    put("name_ends", np.array(ends, dtype="<i8").tobytes())
    put("names", text)
    header = json.dumps({
        "version": CACHE_VERSION, "identity": identity, "format": index.format,
        "path": index.path, "files": [list(f) for f in index.files], "objects": index.objects,
        "notes": list(index.notes), "tensors": n, "parts": nparts, "tables": tables,
        "columns": where,
    }, separators=(",", ":"), allow_nan=True).encode()
    entry = bytearray(_MAGIC + len(header).to_bytes(8, "little") + bytes(32) + header)
    for chunk in chunks:
        entry += chunk
    view = memoryview(entry)
    view[_LEN_END:_DIGEST_END] = _entry_digest(view)
    view.release()
    return bytes(entry)


def decode_index(data: bytes | bytearray | memoryview, identity: dict[str, Any] | None = None,
                 *, where: str = "inspection cache entry") -> CheckpointIndex:
    """Read :func:`encode_index`'s output back, checking everything before it is used.

    The checks: the magic, the SHA-256 (of the header and the body), the version, ``identity``
    (when given), every column's place (the order of :data:`_LAYOUT`, each right after the one
    before, of its length), the string codes within their tables, ``part_start`` ascending from
    0 to the part count, file indexes within ``files`` (or -1), each tensor's ``nbytes``,
    ``offset`` and ``file`` against its parts, the names' ends ascending within their text.

    Raises
    ------
    InvalidArgumentError
        ``data`` is not such an entry, or not this checkpoint's (the message names ``where``,
        the field and the byte offset, and what was expected).
    """
    import numpy as np

    def fail(what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{where}: {what}")

    view = memoryview(data).cast("B")
    if bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise fail(f"offset 0: expected the magic {_MAGIC!r}, got {bytes(view[:len(_MAGIC)])!r}")
    hlen = int.from_bytes(view[len(_MAGIC):_LEN_END], "little")
    if len(view) < _DIGEST_END or hlen > min(_HEADER_MAX, len(view) - _DIGEST_END):
        raise fail(f"offset {len(_MAGIC)}: a header of {hlen:,} bytes does not fit the "
                   f"{len(view):,}-byte entry")
    if _entry_digest(view) != bytes(view[_LEN_END:_DIGEST_END]):
        raise fail(f"offset {_LEN_END}: expected the SHA-256 of the header and the body, "
                   f"got {bytes(view[_LEN_END:_DIGEST_END]).hex()[:16]}... (damaged or edited)")
    head = _DIGEST_END
    try:
        header = json.loads(bytes(view[head:head + hlen]))
    except (ValueError, RecursionError) as exc:
        raise fail(f"offset {head}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise fail(f"offset {head}: expected a JSON object header, got {type(header).__name__}")
    if header.get("version") != CACHE_VERSION:
        raise fail(f"version: expected {CACHE_VERSION}, got {header.get('version')!r}")
    if identity is not None and header.get("identity") != identity:
        raise fail("identity: the entry describes another checkpoint")
    body = view[head + hlen:]
    n, nparts = header.get("tensors"), header.get("parts")
    if type(n) is not int or type(nparts) is not int or n < 0 or nparts < 0:
        raise fail(f"tensors/parts: expected counts, got {n!r}/{nparts!r}")
    counts = {"tensors": n, "tensors+1": n + 1, "parts": nparts}
    columns = header.get("columns")
    if not isinstance(columns, dict) or set(columns) != {name for name, _, _ in _LAYOUT}:
        raise fail(f"columns: expected a JSON object of the {len(_LAYOUT)} columns "
                   f"{[name for name, _, _ in _LAYOUT]}")
    # the columns lie one after the other in _LAYOUT's order, the names' text last
    spans: dict[str, tuple[int, int]] = {}
    at = 0
    for name, itemsize, size in _LAYOUT:
        nbytes = counts[size] * itemsize if itemsize else len(body) - at
        span = columns[name]
        if span != [at, nbytes] or at + nbytes > len(body) or nbytes < 0:
            raise fail(f"column {name!r}: expected [{at:,}, {max(nbytes, 0):,}] (start and "
                       f"length in the {len(body):,}-byte body at entry offset "
                       f"{head + hlen:,}), got {span!r}")
        spans[name] = (at, nbytes)
        at += nbytes

    def raw(name: str) -> memoryview:
        start, nbytes = spans[name]
        return body[start:start + nbytes]

    def place(name: str, row: int) -> str:
        return f" (entry offset {head + hlen + spans[name][0] + 8 * row:,})"

    ints = {name: np.frombuffer(raw(name), dtype="<i8") for name, _ in _INT_COLUMNS}
    files = header.get("files")
    if not isinstance(files, list) or not all(
            isinstance(f, list) and len(f) == 3 and type(f[0]) is str and type(f[1]) is str
            and type(f[2]) is int for f in files):
        raise fail("files: expected [path, format, nbytes] lists")
    _check_columns(ints, n, nparts, len(files), fail, place)
    tables = header.get("tables")
    if not isinstance(tables, dict):
        raise fail("tables: expected a JSON object")
    coded: dict[str, tuple[str, ...]] = {}
    for name, _ in _CODED_COLUMNS:
        table = tables.get(name)
        if not isinstance(table, list) or (table and set(map(type, table)) != {str}):
            raise fail(f"table {name!r}: expected a list of strings")
        codes = np.frombuffer(raw(name), dtype="<i4")
        if codes.size and not (0 <= int(codes.min()) and int(codes.max()) < len(table)):
            raise fail(f"column {name!r}: codes outside its table of {len(table)} values")
        coded[name] = tuple(np.array(table, dtype=object)[codes].tolist()) if codes.size else ()
    ends = np.frombuffer(raw("name_ends"), dtype="<i8")
    try:
        text = bytes(raw("names")).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise fail(f"column 'names': not UTF-8 at byte {exc.start:,}") from None
    if n and (int(ends[0]) < 0 or int(ends[-1]) != len(text)
              or bool((ends[1:] < ends[:-1]).any())):
        raise fail(f"column 'name_ends': expected ascending ends up to {len(text):,}")
    bounds = ends.tolist()
    names = tuple(map(text.__getitem__, map(slice, [0, *bounds[:-1]], bounds)))
    for key in ("format", "path"):
        if type(header.get(key)) is not str:
            raise fail(f"{key!r}: expected a string")
    objects, notes = header.get("objects"), header.get("notes")
    if not isinstance(objects, dict):
        raise fail("objects: expected a JSON object")
    if not isinstance(notes, list) or (notes and set(map(type, notes)) != {str}):
        raise fail("notes: expected a list of strings")
    col = {name: tuple(ints[name].tolist()) for name, _ in _INT_COLUMNS}
    return CheckpointIndex(
        header["format"], header["path"], tuple(tuple(f) for f in files), names,
        coded["dtypes"], coded["shapes"], coded["kinds"], col["nbytes"], col["parameters"],
        col["file"], col["offset"], col["part_start"], coded["part_role"], col["part_file"],
        col["part_offset"], col["part_nbytes"], objects, tuple(notes))


class InspectionCache:
    """:class:`CheckpointIndex` entries on disk, keyed by a checkpoint's identity.

    An explicit object (never a module global): make one per program, or pass ``directory``
    (default :func:`cache_dir`). ``max_nbytes`` bounds the directory's entries; after each
    store the least recently used entries are removed until they fit. ``hits``, ``misses``
    and ``rejected`` (entries that did not parse or did not match) count :meth:`load` calls.

    Parameters
    ----------
    directory
        The cache directory (created on first store).
    max_nbytes
        Bytes the entries may take in all (an entry larger than this is not stored).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 max_nbytes: int = DEFAULT_MAX_NBYTES) -> None:
        if type(max_nbytes) is not int or max_nbytes < 1:
            raise InvalidArgumentError(f"max_nbytes must be an int >= 1, got {max_nbytes!r}")
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.max_nbytes = max_nbytes
        self.hits = self.misses = self.rejected = 0

    def _entry_path(self, identity: dict[str, Any]) -> Path:
        return self.directory / f"v{CACHE_VERSION}" / (_key(identity) + _SUFFIX)

    def load(self, path: str | os.PathLike[str],
             identity: dict[str, Any] | None = None) -> CheckpointIndex | None:
        """The cached index of the checkpoint at ``path``, or None (absent, damaged, stale).

        Never raises for the entry and never blocks on it: one that is not a regular file (a
        link, a FIFO, a device), larger than ``max_nbytes``, unreadable or not a valid entry of
        this checkpoint is a miss (counted in ``rejected``) and is removed.
        """
        identity = identity if identity is not None else identity_of(path)
        entry = self._entry_path(identity)
        seen: list[os.stat_result] = []
        try:
            data = _read_entry(entry, self.max_nbytes, seen)
            index = decode_index(data, identity, where=str(entry))
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, LookupError, TypeError, ArithmeticError, RecursionError):
            # damaged, foreign, stale or not a file at all: ignored, removed, rebuilt by the
            # next store (decode_index raises InvalidArgumentError only; the rest is defence)
            self.rejected += 1
            self.misses += 1
            _discard(entry, seen[0] if seen else None)
            return None
        _touch(entry)  # recently used: the last to be removed
        self.hits += 1
        return index

    def store(self, path: str | os.PathLike[str], index: CheckpointIndex,
              identity: dict[str, Any] | None = None) -> bool:
        """Keep ``index`` for the checkpoint at ``path``; False where it could not be written
        (a read-only directory, an entry over ``max_nbytes``)."""
        identity = identity if identity is not None else identity_of(path)
        entry = self._entry_path(identity)
        try:
            body = encode_index(index, identity)
        except (OverflowError, ValueError):  # a number past int64, a value JSON cannot hold
            return False
        if len(body) > self.max_nbytes:
            return False
        tmp = None
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=_TMP_PREFIX, suffix=_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, entry)
            tmp = None
            _touch(entry)
        except OSError:
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._prune(keep=entry)
        return True

    def _prune(self, keep: Path) -> None:
        """Remove the least recently used entries until the rest fit ``max_nbytes``.

        Temporary files count toward the bound; one untouched for ten minutes (its writer was
        killed between writing it and renaming it into place) is removed first, a younger one
        (a writer at work) is left alone. A file another process removes meanwhile is skipped.
        """
        now = time.time_ns()
        entries: list[tuple[int, int, Path]] = []
        total = 0
        for p in _entry_files(self.directory):
            try:
                st = p.lstat()
            except OSError:  # removed by another process since it was listed
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            nbytes = st.st_size if stat.S_ISREG(st.st_mode) else 0
            if p.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime_ns > _TMP_MAX_AGE_NS and _unlink(p):
                    continue
                total += nbytes  # a writer at work: counted, never removed
                continue
            entries.append((st.st_mtime_ns, nbytes, p))
            total += nbytes
        for _, nbytes, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_nbytes:
                break
            if p != keep and _unlink(p):
                total -= nbytes

    def index_of(self, path: str | os.PathLike[str],
                 open_checkpoint: Callable[[str], Any] | None = None
                 ) -> tuple[CheckpointIndex, Any]:
        """The checkpoint's index, from the cache or by opening it (then stored).

        Returns ``(index, checkpoint)``: ``checkpoint`` is the opened
        :class:`~ckptlab.checkpoint.Checkpoint` on a miss and None on a hit.
        """
        identity = identity_of(path)
        index = self.load(path, identity)
        if index is not None:
            return index, None
        if open_checkpoint is None:
            from ckptlab.checkpoint.open import open_checkpoint
        ck = open_checkpoint(os.fspath(path))
        index = CheckpointIndex.from_checkpoint(ck)
        # the file may have changed while it was read: key the entry by what was there before
        if identity_of(path) == identity:
            self.store(path, index, identity)
        return index, ck


def _touch(path: Path) -> None:
    """Set ``path``'s mtime to now, to the nanosecond (the kernel's own stamp is coarser, so
    entries written in one tick would tie in the least-recently-used order)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


def _unlink(path: Path) -> bool:
    """Remove ``path``; True where it is gone (also when another process removed it first)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_BINARY", 0))


def _read_entry(entry: Path, max_nbytes: int, seen: list[os.stat_result]) -> bytearray:
    """The bytes of the cache entry ``entry``, read from one descriptor.

    The entry is opened without following a link and without blocking (a FIFO), then must be
    a regular file of at most ``max_nbytes`` bytes by ``fstat`` of that descriptor; at most
    its size plus one byte are read (a file that grew meanwhile is refused, never read on).
    What ``fstat`` said is appended to ``seen`` (so that a caller removes that file only).

    Raises
    ------
    FileNotFoundError
        There is no entry.
    OSError
        It cannot be opened or read (a link, where ``O_NOFOLLOW`` exists: ``ELOOP``).
    InvalidArgumentError
        It is not a regular file, is larger than ``max_nbytes``, or changed while read.
    """
    if not hasattr(os, "O_NOFOLLOW") and entry.is_symlink():
        raise InvalidArgumentError(f"{entry}: expected a regular file, got a symbolic link")
    fd = os.open(entry, _OPEN_FLAGS)
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        seen.append(st)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{entry}: expected a regular file, got mode "
                                       f"{stat.filemode(st.st_mode)}")
        if st.st_size > max_nbytes:
            raise InvalidArgumentError(f"{entry}: expected at most {max_nbytes:,} bytes (the "
                                       f"cache's bound), got {st.st_size:,}")
        data = bytearray(st.st_size + 1)  # one byte more: to see a file that grew
        view = memoryview(data)
        got = 0
        while got < len(data):
            step = f.readinto(view[got:])
            if not step:  # the end (0), or a read that would block (None)
                break
            got += step
        view.release()
    if got > st.st_size:
        raise InvalidArgumentError(f"{entry} at offset {st.st_size:,}: expected the end of "
                                   f"the {st.st_size:,}-byte entry, got more (it changed while "
                                   f"read)")
    del data[got:]
    return data


def _discard(entry: Path, seen: os.stat_result | None) -> None:
    """Remove a rejected cache entry where it is ours to remove: not a directory, owned by
    this user, and (where it was opened) still the file that was read, not one another process
    renamed into place since."""
    with contextlib.suppress(OSError):
        now = entry.lstat()
        if stat.S_ISDIR(now.st_mode):
            return
        if hasattr(os, "getuid") and now.st_uid != os.getuid():
            return
        if seen is not None and (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
            return
        entry.unlink()


def _entry_files(directory: Path) -> list[Path]:
    """The entries of every version under a cache directory, and their temporary files."""
    out: list[Path] = []
    with contextlib.suppress(OSError):
        subs = [sub for sub in directory.iterdir()
                if sub.name.startswith("v") and sub.is_dir()]
        for sub in subs:
            with contextlib.suppress(OSError):  # another process removed it meanwhile
                out.extend(p for p in sub.iterdir() if p.suffix in (_SUFFIX, *_OLD_SUFFIXES))
    return out
