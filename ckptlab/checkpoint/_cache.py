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
per-entry JSON took 0.3 s). The header carries the SHA-256 of the columns. Entries are written
atomically (a temporary file in the same directory, then ``os.replace``) and are bounded in
total size (the least recently used go first). An entry that does not parse, fails its
checksum or any column check, is of another version, or describes another identity is ignored
and rebuilt; a cache directory that cannot be written makes the cache a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import operator
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptlab.errors import InvalidArgumentError

__all__ = ["CACHE_VERSION", "CheckpointIndex", "InspectionCache", "cache_dir", "decode_index",
           "encode_index", "identity_of"]

# 2: one columnar file per entry (``.ckix``); 1 was one JSON document (``.json``)
CACHE_VERSION = 2
EDGE_NBYTES = 64 * 1024  # bytes hashed at each end of a file
DEFAULT_MAX_NBYTES = 256 * 2**20  # the whole cache directory's entries
_SUFFIX = ".ckix"
_OLD_SUFFIXES = (".json",)  # earlier versions' entries: never read, pruned like the others
_MAGIC = b"CKPTLAB-INDEX\n"
_HEADER_MAX = 64 * 2**20  # a header longer than this is damage, not an index
# the int64 columns, in the order they are stored; "parts" columns have one item per part
_INT_COLUMNS = (("nbytes", "tensors"), ("parameters", "tensors"), ("file", "tensors"),
                ("offset", "tensors"), ("part_start", "tensors+1"), ("part_file", "parts"),
                ("part_offset", "parts"), ("part_nbytes", "parts"))
# the string columns kept as a table of distinct values and an int32 code per row
_CODED_COLUMNS = (("dtypes", "tensors"), ("shapes", "tensors"), ("kinds", "tensors"),
                  ("part_role", "parts"))


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


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


@dataclass(frozen=True, eq=False)
class CheckpointIndex:
    """What a checkpoint holds, as columns: one row per tensor, its parts flattened.

    Built from a :class:`~ckptlab.checkpoint.Checkpoint` (:meth:`from_checkpoint`) or read
    back from JSON (:meth:`from_dict`); it needs no file access to be shown. Row ``i`` is the
    checkpoint's ``i``-th tensor; its parts are ``part_*[part_start[i]:part_start[i + 1]]``.
    ``file`` and ``part_file`` index ``files``; ``offset`` is -1 for a tensor without bytes.
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

    # -- totals -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.names)

    @property
    def file_nbytes(self) -> int:
        """Bytes of every file of the checkpoint."""
        return sum(f[2] for f in self.files)

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters)

    @property
    def tensor_nbytes(self) -> int:
        return sum(self.nbytes)

    def totals_by_dtype(self) -> dict[str, tuple[int, int, int]]:
        """dtype -> (tensors, parameters, bytes), largest bytes first."""
        out: dict[str, list[int]] = {}
        for dtype, params, nb in zip(self.dtypes, self.parameters, self.nbytes):
            row = out.setdefault(dtype, [0, 0, 0])
            row[0] += 1
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
        """JSON-ready columns (the cache's entry body)."""
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

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointIndex:
        """Read :meth:`to_dict`'s output back, checking every column's type and length.

        Raises
        ------
        InvalidArgumentError
            ``data`` is not such a dict (a damaged or foreign cache entry).
        """
        def fail(what: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"inspection cache entry: {what}")

        if not isinstance(data, dict):
            raise fail(f"expected a JSON object, got {type(data).__name__}")

        def column(key: str, kind: type, n: int | None) -> tuple[Any, ...]:
            value = data.get(key)
            if not isinstance(value, list) or (n is not None and len(value) != n):
                raise fail(f"column {key!r}: expected a list of {n} items")
            if value and set(map(type, value)) != {kind}:  # every item exactly a kind
                raise fail(f"column {key!r}: expected {kind.__name__} items")
            return tuple(value)

        names = column("names", str, None)
        n = len(names)
        files = data.get("files")
        if not isinstance(files, list) or not all(
                isinstance(f, list) and len(f) == 3 and type(f[0]) is str and type(f[1]) is str
                and type(f[2]) is int for f in files):
            raise fail("files: expected [path, format, nbytes] lists")
        start = column("part_start", int, n + 1)
        nparts = start[-1] if start else 0
        if start[0] != 0 or not all(map(operator.le, start, itertools.islice(start, 1, None))):
            raise fail("part_start: expected ascending offsets from 0")
        file = column("file", int, n)
        part_file = column("part_file", int, nparts)
        if any(column and not (-1 <= min(column) and max(column) < len(files))
               for column in (file, part_file)):
            raise fail("file index out of range")
        objects = data.get("objects")
        notes = column("notes", str, None)
        for key in ("format", "path"):
            if type(data.get(key)) is not str:
                raise fail(f"{key!r}: expected a string")
        if not isinstance(objects, dict):
            raise fail("objects: expected a JSON object")
        index = cls(data["format"], data["path"], tuple(tuple(f) for f in files), names,
                    column("dtypes", str, n), column("shapes", str, n), column("kinds", str, n),
                    column("nbytes", int, n), column("parameters", int, n), file,
                    column("offset", int, n), start, column("part_role", str, nparts),
                    part_file, column("part_offset", int, nparts),
                    column("part_nbytes", int, nparts), objects, notes)
        return index


def _text_column(values: tuple[str, ...]) -> tuple[bytes, list[int]]:
    """``values`` as one UTF-8 text and each value's end, counted in characters."""
    ends = list(itertools.accumulate(map(len, values)))
    return "".join(values).encode("utf-8", "surrogatepass"), ends


def encode_index(index: CheckpointIndex, identity: dict[str, Any]) -> bytes:
    """One cache entry: ``index`` of the checkpoint with ``identity``, in the columnar format.

    The layout: :data:`_MAGIC`, the header's length (8 bytes, little-endian), the header (JSON:
    ``version``, ``identity``, the small fields, ``tensors``, ``parts``, the string tables,
    ``columns``: ``name -> [start, nbytes]`` within the body, ``body_sha256``), then the body:
    the int64 columns, the int32 codes of the string columns, the names' character ends
    (int64) and the names as one UTF-8 text.

    Raises
    ------
    OverflowError
        A number does not fit int64 (the entry is then not stored).
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

    for name, _ in _INT_COLUMNS:
        put(name, np.array(getattr(index, name), dtype="<i8").tobytes())
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
    body = b"".join(chunks)
    header = json.dumps({
        "version": CACHE_VERSION, "identity": identity, "format": index.format,
        "path": index.path, "files": [list(f) for f in index.files], "objects": index.objects,
        "notes": list(index.notes), "tensors": n, "parts": nparts, "tables": tables,
        "columns": where, "body_sha256": hashlib.sha256(body).hexdigest(),
    }, separators=(",", ":"), allow_nan=True).encode()
    return _MAGIC + len(header).to_bytes(8, "little") + header + body


def decode_index(data: bytes, identity: dict[str, Any] | None = None, *,
                 where: str = "inspection cache entry") -> CheckpointIndex:
    """Read :func:`encode_index`'s output back, checking everything before it is used.

    The checks: the magic, the version, ``identity`` (when given), the body's SHA-256, every
    column's length, the string codes within their tables, ``part_start`` ascending from 0 to
    the part count, file indexes within ``files`` (or -1), the names' ends ascending within
    their text.

    Raises
    ------
    InvalidArgumentError
        ``data`` is not such an entry, or not this checkpoint's (the message names ``where``,
        the field and the byte offset, and what was expected).
    """
    import numpy as np

    def fail(what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{where}: {what}")

    view = memoryview(data)
    head = len(_MAGIC) + 8
    if bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise fail(f"offset 0: expected the magic {_MAGIC!r}, got {bytes(view[:len(_MAGIC)])!r}")
    hlen = int.from_bytes(view[len(_MAGIC):head], "little")
    if len(view) < head or hlen > min(_HEADER_MAX, len(view) - head):
        raise fail(f"offset {len(_MAGIC)}: a header of {hlen:,} bytes does not fit the "
                   f"{len(view):,}-byte entry")
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
    if hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise fail(f"offset {head + hlen}: the body's SHA-256 does not match the header's")
    n, nparts = header.get("tensors"), header.get("parts")
    if type(n) is not int or type(nparts) is not int or n < 0 or nparts < 0:
        raise fail(f"tensors/parts: expected counts, got {n!r}/{nparts!r}")
    counts = {"tensors": n, "tensors+1": n + 1, "parts": nparts}
    columns = header.get("columns")
    if not isinstance(columns, dict):
        raise fail("columns: expected a JSON object")

    def raw(name: str, itemsize: int, count: int | None) -> memoryview:
        span = columns.get(name)
        if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
                and 0 <= span[0] and 0 <= span[1] and span[0] + span[1] <= len(body)):
            raise fail(f"column {name!r}: expected [start, nbytes] within the "
                       f"{len(body):,}-byte body, got {span!r}")
        if count is not None and span[1] != count * itemsize:
            raise fail(f"column {name!r} at body offset {span[0]:,}: expected {count:,} items "
                       f"({count * itemsize:,} bytes), got {span[1]:,} bytes")
        return body[span[0]:span[0] + span[1]]

    ints = {name: np.frombuffer(raw(name, 8, counts[size]), dtype="<i8")
            for name, size in _INT_COLUMNS}
    files = header.get("files")
    if not isinstance(files, list) or not all(
            isinstance(f, list) and len(f) == 3 and type(f[0]) is str and type(f[1]) is str
            and type(f[2]) is int for f in files):
        raise fail("files: expected [path, format, nbytes] lists")
    start = ints["part_start"]
    if start[0] != 0 or start[-1] != nparts or (n and bool((np.diff(start) < 0).any())):
        raise fail(f"part_start: expected ascending offsets from 0 to {nparts:,}")
    for name in ("file", "part_file"):
        col = ints[name]
        if col.size and not (-1 <= int(col.min()) and int(col.max()) < len(files)):
            raise fail(f"column {name!r}: expected file indexes in [-1, {len(files)}), got "
                       f"[{int(col.min())}, {int(col.max())}]")
    tables = header.get("tables")
    if not isinstance(tables, dict):
        raise fail("tables: expected a JSON object")
    coded: dict[str, tuple[str, ...]] = {}
    for name, size in _CODED_COLUMNS:
        table = tables.get(name)
        if not isinstance(table, list) or (table and set(map(type, table)) != {str}):
            raise fail(f"table {name!r}: expected a list of strings")
        codes = np.frombuffer(raw(name, 4, counts[size]), dtype="<i4")
        if codes.size and not (0 <= int(codes.min()) and int(codes.max()) < len(table)):
            raise fail(f"column {name!r}: codes outside its table of {len(table)} values")
        coded[name] = tuple(np.array(table, dtype=object)[codes].tolist()) if codes.size else ()
    ends = np.frombuffer(raw("name_ends", 8, n), dtype="<i8")
    try:
        text = bytes(raw("names", 1, None)).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise fail(f"column 'names': not UTF-8 at byte {exc.start:,}") from None
    if n and (int(ends[0]) < 0 or int(ends[-1]) != len(text)
              or bool((np.diff(ends) < 0).any())):
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
        """The cached index of the checkpoint at ``path``, or None (absent, damaged, stale)."""
        identity = identity if identity is not None else identity_of(path)
        entry = self._entry_path(identity)
        try:
            if entry.stat().st_size > self.max_nbytes:
                raise ValueError("larger than the cache")
            index = decode_index(entry.read_bytes(), identity, where=str(entry))
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, RecursionError, UnicodeDecodeError):
            # damaged, foreign or stale: ignored, and replaced by the next store
            self.rejected += 1
            self.misses += 1
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
            fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=_SUFFIX)
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
        """Remove the least recently used entries until the rest fit ``max_nbytes``."""
        try:
            entries = [(p.stat().st_mtime_ns, p.stat().st_size, p)
                       for p in _entry_files(self.directory)]
        except OSError:
            return
        total = sum(e[1] for e in entries)
        for _, nbytes, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_nbytes:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
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


def _entry_files(directory: Path) -> list[Path]:
    """The entries of every version under a cache directory."""
    out: list[Path] = []
    if not directory.is_dir():
        return out
    for sub in directory.iterdir():
        if sub.is_dir() and sub.name.startswith("v"):
            out.extend(p for p in sub.iterdir()
                       if p.suffix in (_SUFFIX, *_OLD_SUFFIXES)
                       and not p.name.startswith(".tmp-"))
    return out
