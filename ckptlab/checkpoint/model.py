"""The checkpoint model: every format as files, tensors by name, and inert non-tensor values.

A :class:`Checkpoint` is what :func:`ckptlab.open` returns for any checkpoint a PyTorch user
has. Views and the CLI take a ``Checkpoint`` and never ask which format it came from: each
tensor says which byte ranges of which file make it (:class:`Part`), and each file carries its
own segments (they tile the file).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptlab._words import plural
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format._plain import plain_value
from ckptlab.format.layout import Segment, SegmentKind, contiguous_strides

__all__ = ["Checkpoint", "FileEntry", "Part", "Scratch", "TensorEntry", "is_checkpoint",
           "plain_value", "tensor_name"]

KINDS = ("dense", "sparse", "quantized", "nested", "subclass")
FORMATS = ("torch-zip", "torch-legacy", "torchscript", "pt2", "safetensors", "hf", "dcp", "dir",
           "deepspeed", "tensorizer")


@dataclass(frozen=True, slots=True)
class Part:
    """One byte range of one file that holds (a component of) a tensor.

    ``offset`` is the file offset of the element at ``storage_offset`` and ``nbytes`` the span
    from there to one past the last element the view reaches (``numel * itemsize`` when the
    part is contiguous): the bytes ``[offset, offset + nbytes)`` viewed with ``shape`` and
    ``stride`` are the part.
    """

    role: str  # "data"; "indices"/"values"; "crow_indices"; "scales"; "buffer"; "chunk"; ...
    file: str  # path relative to the opened checkpoint
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0  # in elements, inside the storage the part views
    storage_key: str = ""  # the storage (torch formats), tensor key (safetensors)
    # DCP: where the chunk sits in the tensor; role "piece" (a run of a DeepSpeed partition):
    # (the run's row-major element position,)
    chunk_offsets: tuple[int, ...] | None = None
    compression: str | None = None  # DCP transforms ("zstd"), None for raw bytes
    stored_nbytes: int | None = None  # bytes on disk when compressed
    item_offset: int | None = None  # DCP: first byte of the item holding this part

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.shape) or self.numel <= 1

    def run(self, first: int, count: int) -> Part:
        """Elements ``[first, first + count)`` of this contiguous part, as a flat part of
        the same file (a piece :meth:`Checkpoint.read_pieces` reads; a run of a DeepSpeed
        partition)."""
        size = DTYPE_ITEMSIZE[self.dtype]
        return dataclasses.replace(self, offset=self.offset + first * size, nbytes=count * size,
                                   shape=(count,), stride=(1,),
                                   storage_offset=self.storage_offset + first)

    def to_dict(self) -> dict[str, Any]:
        out = {"role": self.role, "file": self.file, "offset": self.offset,
               "nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape),
               "stride": list(self.stride), "storage_offset": self.storage_offset}
        if self.storage_key:
            out["storage_key"] = self.storage_key
        if self.chunk_offsets is not None:
            out["chunk_offsets"] = list(self.chunk_offsets)
        if self.compression is not None:
            out["compression"] = self.compression
            out["stored_nbytes"] = self.stored_nbytes
        return out


def span_nbytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a view's first element to one past its last (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, stride)) + 1) * itemsize


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor as the user knows it: its state-dict name and the bytes that make it."""

    name: str  # the key users know: nested keys joined with "."
    path: tuple[Any, ...]  # the exact keys from the root object
    dtype: str  # torch's name without prefix
    shape: tuple[int, ...] | None  # None where only the bytes know it (strided nested)
    stride: tuple[int, ...] | None
    kind: str  # dense | sparse | quantized | nested | subclass
    parts: tuple[Part, ...]
    layout: str = "strided"  # strided | sparse_coo | sparse_csr | ... | jagged
    requires_grad: bool = False
    is_parameter: bool = False
    subclass: str | None = None  # qualified name of a Tensor subclass
    extra: tuple[tuple[str, Any], ...] = ()  # qscheme, scale, zero_point, axis, ragged_idx...

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's parts occupy in their files (as stored, before any compression)."""
        return sum(p.nbytes for p in self.parts)

    @property
    def numel(self) -> int | None:
        """Elements of the logical tensor (None when the shape is not known from metadata)."""
        if self.shape is None or any(d < 0 for d in self.shape):
            return None
        return math.prod(self.shape)

    @property
    def parameters(self) -> int:
        """Parameter count: elements of the stored values (what a model summary counts)."""
        if self.kind == "dense" or self.kind == "quantized":
            return self.numel or 0
        values = [p for p in self.parts if p.role in ("values", "buffer")]
        if values:
            return sum(p.numel for p in values)
        return sum(p.numel for p in self.parts)

    @property
    def file(self) -> str:
        """The file holding the first part ("" for a tensor without bytes)."""
        return self.parts[0].file if self.parts else ""

    @property
    def offset(self) -> int | None:
        return self.parts[0].offset if self.parts else None

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE.get(self.dtype, 1)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "path": list(self.path), "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "stride": None if self.stride is None else list(self.stride),
            "kind": self.kind, "layout": self.layout, "nbytes": self.nbytes,
            "parameters": self.parameters, "requires_grad": self.requires_grad,
            "is_parameter": self.is_parameter, "file": self.file,
            "parts": [p.to_dict() for p in self.parts]}
        if self.subclass:
            out["subclass"] = self.subclass
        if self.extra:
            out["extra"] = {k: plain_value(v) for k, v in self.extra}
        # the torch-zip fields of the README's tensor entries, from the (first) data part
        data = self.parts[0] if self.parts else None
        if data is not None:
            out["storage_key"] = data.storage_key
            out["storage_offset"] = data.storage_offset
        return out


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint with its byte layout."""

    path: str  # relative to the opened checkpoint (its own name for a single file)
    format: str  # torch-zip, torch-legacy, torchscript, pt2, safetensors, tensorizer, distcp,
    #              dcp-metadata,
    #              json, other
    nbytes: int
    segments: tuple[Segment, ...]  # tile [0, nbytes)
    layout: Any = field(default=None, compare=False)  # ArchiveLayout / DcpLayout / None
    full_path: str = field(default="", compare=False)  # where it is on disk ("" for bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "nbytes": self.nbytes}


def tied_rows(byte_ranges: Sequence[Sequence[Any]]) -> dict[int, int]:
    """{row: the first row with the same byte ranges} for rows whose (non-empty) ranges
    repeat an earlier row's: the one rule for tied tensors (:meth:`Checkpoint.tied`, and the
    served index's totals)."""
    first: dict[Any, int] = {}
    out = {}
    for row, key in enumerate(byte_ranges):
        if len(key) and first.setdefault(key, row) != row:
            out[row] = first[key]
    return out


def tensor_name(path: tuple[Any, ...]) -> str:
    """The state-dict name of a path: keys joined with "." as DCP flattens them."""
    if not path:
        return "<root>"
    return ".".join(map(str, path))


class LazyTensors(Mapping[str, TensorEntry]):
    """Name -> :class:`TensorEntry` whose entries are made when first looked up.

    Stands in for the dict :attr:`Checkpoint.tensors` holds: the names (unique, in the
    checkpoint's order) are known at once; ``ckpt.tensors[name]`` makes one entry (and keeps
    it); iterating values or items, comparing, ``repr`` and copying make them all at once
    (``make_all``, equal entries in the same order, the ones made before kept) and from then
    on it answers from that dict. Iteration over names, ``len`` and ``in`` make nothing.
    """

    __slots__ = ("_built", "_dict", "_index", "_make_all", "_make_one", "_names")

    def __init__(self, names: list[str], make_one: Callable[[int], TensorEntry],
                 make_all: Callable[[], list[TensorEntry]]) -> None:
        self._names = names
        self._index: dict[str, int] | None = None
        self._make_one = make_one
        self._make_all = make_all
        self._built: dict[int, TensorEntry] = {}
        self._dict: dict[str, TensorEntry] | None = None

    @property
    def built(self) -> int:
        """How many entries have been made."""
        return len(self._names) if self._dict is not None else len(self._built)

    def _rows(self) -> dict[str, int]:
        index = self._index
        if index is None:
            index = self._index = dict(zip(self._names, range(len(self._names))))
        return index

    def __getitem__(self, name: str) -> TensorEntry:
        if self._dict is not None:
            return self._dict[name]
        row = self._rows()[name]  # KeyError(name), as the dict
        entry = self._built.get(row)
        if entry is None:
            entry = self._built[row] = self._make_one(row)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._names) if self._dict is None else iter(self._dict)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        if self._dict is not None:
            return name in self._dict
        try:
            return name in self._rows()
        except TypeError:  # unhashable: in no dict
            return False

    def as_dict(self) -> dict[str, TensorEntry]:
        """Every entry, as the dict ``Checkpoint.tensors`` would be (made on the first call)."""
        if self._dict is None:
            entries = self._make_all()
            if len(entries) != len(self._names):
                raise RuntimeError(f"made {len(entries)} tensor entries for "
                                   f"{len(self._names)} names")
            for row, entry in list(self._built.items()):
                entries[row] = entry  # the same objects as the lookups gave
            made = dict(zip(self._names, entries))
            if self._dict is None:  # (another thread's, when it was first)
                self._dict = made
        return self._dict

    def values(self):  # type: ignore[no-untyped-def,override]
        return self.as_dict().values()

    def items(self):  # type: ignore[no-untyped-def,override]
        return self.as_dict().items()

    def copy(self) -> dict[str, TensorEntry]:
        return dict(self.as_dict())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTensors):
            other = other.as_dict()
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.as_dict() == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Any) -> dict[str, TensorEntry]:
        return self.as_dict() | other

    def __repr__(self) -> str:
        return repr(self.as_dict())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.as_dict(),))  # pickles and copies as the dict


class Scratch:
    """Memory that :meth:`Checkpoint.read` reads a tensor's bytes into, the same memory again
    at the next read: for a loop that looks at one tensor at a time (``diff``, ``stats``)
    and would otherwise have the system hand it new pages for every tensor. A tensor read
    with a scratch is valid until the next read with it; parts of one tensor get distinct
    buffers. Where bytes arrive from a URL they are used as they come."""

    def __init__(self) -> None:
        self._buffers: list[bytearray] = []
        self._next = 0

    def start(self) -> None:
        """A new read: every buffer free again."""
        self._next = 0

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of memory not taken since :meth:`start` (a buffer kept, or a new one
        that replaces a smaller one)."""
        if self._next == len(self._buffers):
            self._buffers.append(bytearray(nbytes))
        elif len(self._buffers[self._next]) < nbytes:
            self._buffers[self._next] = bytearray(nbytes)  # (a tensor may still hold the old)
        buf = self._buffers[self._next]
        self._next += 1
        return memoryview(buf)[:nbytes]


def is_checkpoint(source: Any) -> bool:
    """Whether ``source`` is a :class:`Checkpoint` (by its interface: ``files``, ``tensors``
    and ``format``), as the views that take a checkpoint or a layout tell them apart."""
    return hasattr(source, "files") and hasattr(source, "tensors") and hasattr(source, "format")


class Checkpoint:
    """Any checkpoint, tensor first. Made by :func:`ckptlab.open`; see the module docstring.

    Attributes
    ----------
    format
        ``"torch-zip"``, ``"torch-legacy"``, ``"torchscript"``, ``"pt2"``, ``"safetensors"``,
        ``"hf"``, ``"dcp"``, ``"dir"``, ``"deepspeed"`` or ``"tensorizer"``.
    path
        What was opened.
    files
        Every file with its byte layout (segments tile each file).
    tensors
        Name -> :class:`TensorEntry`, in the checkpoint's own order.
    objects
        Name -> inert, printable non-tensor value (step, lr, config...).
    run
        When a training run's directory was opened: the :class:`~ckptlab.checkpoint.runs.Run`
        (every save, which one this is); else None. ``steps`` lists its saves.
    """

    def __init__(self, format: str, path: str, files: tuple[FileEntry, ...],
                 tensors: Mapping[str, TensorEntry], objects: Mapping[str, Any],
                 reader: Callable[[Checkpoint, TensorEntry], Any],
                 notes: tuple[str, ...] = ()) -> None:
        self.format = format
        self.path = path
        self.files = files
        # a LazyTensors (one torch.save file) makes its entries on first access
        self.tensors: Mapping[str, TensorEntry] = (
            tensors if isinstance(tensors, LazyTensors) else dict(tensors))
        self._objects = objects
        self._reader = reader
        self.notes = notes  # what ckptlab could not describe fully, in words
        self.run: Any = None  # the training run it is one save of (runs.Run), if opened so

    @property
    def steps(self) -> tuple[Any, ...]:
        """The saves of the training run this checkpoint was opened from (in order), or ()."""
        return self.run.steps if self.run is not None else ()

    @property
    def objects(self) -> dict[str, Any]:
        return {k: plain_value(v) for k, v in self._objects.items()}

    def object_paths(self) -> dict[str, tuple[Any, ...]]:
        """Name of each non-tensor value -> its path of keys, as :attr:`TensorEntry.path`
        (``('optimizer', 'param_groups')``; ints stay ints)."""
        paths = getattr(self._objects, "paths", None)
        known = paths() if paths is not None else {}
        return {name: known.get(name, (name,)) for name in self._objects}

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def parameters(self) -> int:
        """Parameters of the tensors, each stored value once: a tensor tied to another
        (:meth:`tied`) is not counted again (as ``model.num_parameters()`` counts)."""
        tied = self.tied()
        return sum(t.parameters for t in self.tensors.values() if t.name not in tied)

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of the tensors in their files, each byte range once (:meth:`tied`)."""
        tied = self.tied()
        return sum(t.nbytes for t in self.tensors.values() if t.name not in tied)

    def tied(self) -> dict[str, str]:
        """{name: the first tensor whose bytes it is}: tensors made of exactly the byte
        ranges of a tensor before them (tied weights, ``lm_head.weight`` saved as
        ``transformer.wte.weight``'s storage; a DeepSpeed parameter's shared names)."""
        found = self.__dict__.get("_tied")
        if found is None:
            ts = list(self.tensors.values())
            found = {ts[i].name: ts[j].name for i, j in tied_rows(
                [tuple((p.role, p.file, p.offset, p.nbytes) for p in t.parts) for t in ts])
                .items()}
            self.__dict__["_tied"] = found
        return found

    def __repr__(self) -> str:
        return (f"<Checkpoint {self.format} {self.path!r}: "
                f"{plural(len(self.tensors), 'tensor')}, {plural(len(self._objects), 'object')}, "
                f"{plural(len(self.files), 'file')}, {self.nbytes:,} bytes>")

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def read(self, name: str, *, scratch: Scratch | None = None) -> Any:
        """The tensor ``name`` as ``torch.load`` (or the format's own loader) gives it.

        Only that tensor's bytes are read and no pickle runs: sparse, quantized and nested
        tensors are rebuilt with torch's constructors from their parts; a DCP tensor is
        assembled from its chunks. With ``scratch`` (a :class:`Scratch`) the bytes are read
        into its memory: the tensor may share it, and is valid until the next read with it.

        Raises
        ------
        KeyError
            No tensor of that name (see :attr:`tensors`).
        UnsupportedFormatError
            A tensor ckptlab describes but cannot rebuild without importing code the file
            names (a Tensor subclass other than torch's own).
        """
        try:
            entry = self.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of {self.path}") from None
        return self._read_entry(entry, scratch)

    def _read_entry(self, entry: TensorEntry, scratch: Scratch | None) -> Any:
        """The tensor ``entry`` describes, through this checkpoint's reader (into
        ``scratch``'s memory, freed for this read, where given)."""
        if scratch is not None:
            scratch.start()
        return self._reader(self, entry, None, scratch)

    def read_pieces(self, name: str, *, most: int, scratch: Scratch | None = None
                    ) -> Iterator[Any]:
        """Tensor ``name`` in pieces of at most ``most`` elements, in order, for a loop that
        holds one piece at a time: a dense tensor stored contiguously in one byte range is
        read piece by piece (a read, or one ranged request, each), as flat tensors; any other
        (sparse, quantized, a DCP tensor of several chunks, a view) comes whole, as
        :meth:`read` gives it. With ``scratch`` each piece is read into its memory and is
        valid until the next read with it."""
        entry = self.tensors[name]
        part = entry.parts[0] if len(entry.parts) == 1 else None
        size = DTYPE_ITEMSIZE.get(entry.dtype, 0)
        if (part is None or entry.kind != "dense" or entry.layout != "strided"
                or part.role != "data" or part.chunk_offsets is not None
                or part.compression is not None or not part.contiguous or not size
                or entry.shape is None or part.numel <= most or most < 1):
            yield self.read(name, scratch=scratch)
            return
        for start in range(0, part.numel, most):
            n = min(most, part.numel - start)
            yield self._read_entry(TensorEntry(f"{name}[{start}:{start + n}]", entry.path,
                                               entry.dtype, (n,), (1,), "dense",
                                               (part.run(start, n),)), scratch)

    def read_part(self, name: str, role: str) -> Any:
        """One part of tensor ``name`` (``"indices"``, ``"scales"``, an inner tensor of a
        subclass...) as a dense tensor with the part's own shape and stride."""
        import dataclasses

        entry = self.tensors[name]
        for part in entry.parts:
            if part.role == role:
                # read as a dense tensor of that one part, through this checkpoint's own
                # reader (local files, or ranged requests behind a URL)
                alone = dataclasses.replace(part, role="data", chunk_offsets=None)
                return self._reader(self, TensorEntry(
                    f"{entry.name}:{role}", entry.path, part.dtype, part.shape, part.stride,
                    "dense", (alone,)))
        raise KeyError(f"{name!r} has no part {role!r} (parts: "
                       f"{', '.join(p.role for p in entry.parts)})")

    def to_dict(self, tensors: Any = None) -> dict[str, Any]:
        """JSON-ready: ``format``, ``path``, ``files``, ``tensors`` (list: these entries,
        default all), ``objects``, ``notes``, and ``run`` for a save opened from its training
        run's directory."""
        shown = self.tensors.values() if tensors is None else tensors
        out = {"format": self.format, "path": self.path, "file_nbytes": self.nbytes,
               "files": [f.to_dict() for f in self.files],
               "tensors": [t.to_dict() for t in shown],
               "objects": self.objects, "notes": list(self.notes)}
        if self.run is not None:
            out["run"] = self.run.to_dict()
        return out


def full_path(root: str, relative: str) -> str:
    return os.path.join(root, relative) if relative else root


def file_segments_or_unknown(nbytes: int, segments: tuple[Segment, ...] | None
                             ) -> tuple[Segment, ...]:
    """``segments`` or one unknown segment over the whole file."""
    if segments:
        return segments
    return (Segment(SegmentKind.UNKNOWN, 0, nbytes),) if nbytes else ()
