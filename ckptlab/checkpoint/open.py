"""``ckptlab.open``: recognise any checkpoint (file, directory, file object, URL) and model it.

Files: torch.save zip archives, safetensors. Directories: DCP (``.metadata``), Hugging Face
(``*.index.json`` with shards, a single ``model.safetensors``/``pytorch_model.bin``, their
``variant`` names such as ``model.fp16.safetensors``, Trainer ``checkpoint-N/`` and accelerate
``save_state`` directories with optimizer/scheduler/rng state), and any other directory of
checkpoint files (format ``"dir"``, names prefixed by file). Beside the model's own files, a
file ckptlab cannot read as a checkpoint is listed as ``"other"`` with a note saying why, and
never stops the rest from opening. Adapters for further formats register in
:data:`FILE_ADAPTERS` by the kind :func:`ckptlab.format.detect_format` gives.

One path for every place a checkpoint can be: what the user gives is located once
(:func:`ckptlab.source.locate`: a file in a :class:`~ckptlab.source.Tree`, a tree, or an
object to read), and every reader below is written against a
:class:`~ckptlab.source.ByteSource` and a tree. A local directory and a directory URL differ
in what their tree can do (a URL cannot be listed: the names a checkpoint directory has are
opened in order, :data:`DIR_PROBES`), never in how a format is read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any, BinaryIO

from ckptlab._lazy import lazy_callable
from ckptlab._progress import task
from ckptlab.checkpoint._tensors import (
    LazyEntries,
    build_tensor,
    unique_names,
)
from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    LazyTensors,
    Part,
    Scratch,
    TensorEntry,
    file_segments_or_unknown,
    tensor_name,
)
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format._bulk import BuiltOnce
from ckptlab.format.inspect import not_a_checkpoint, sniff
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind
from ckptlab.source import (
    ByteSource,
    IsDirectoryError,
    LocalTree,
    Location,
    NotFoundError,
    Tree,
    locate,
)

__all__ = ["DIR_PROBES", "FILE_ADAPTERS", "as_checkpoint", "directory_location", "open_checkpoint",
           "open_location", "open_url"]

Source = str | os.PathLike[str] | BinaryIO | bytes

Reader = Callable[..., Any]  # (checkpoint, entry[, moved[, scratch]]) -> tensor


# -- one file ----------------------------------------------------------------------------------
class FileModel:
    """What an adapter makes of one file: its entry, tensors, values and a tensor reader."""

    def __init__(self, entry: FileEntry, tensors: list[TensorEntry],
                 objects: Sequence[tuple[tuple[Any, ...], Any]], format: str,
                 notes: tuple[str, ...] = ()) -> None:
        self.entry = entry
        self.tensors = tensors
        self.objects = objects
        self.format = format
        self.notes = notes


def _torch_zip(src: ByteSource, rel: str) -> FileModel:
    from ckptlab.format._placed import scan_torch_zip_cheapest

    layout, note = scan_torch_zip_cheapest(src)
    model = _from_layout(layout, rel, "torch-zip")
    if note is not None:
        model.notes += (f"{rel}: {note}",)
    return model


def _from_layout(layout: ArchiveLayout, rel: str, format: str) -> FileModel:
    storages = {s.key: s for s in layout.storages}
    tensors = LazyEntries(layout.logical, storages, rel)
    if not tensors.deferrable():
        tensors.value()  # raises now what making the entries would raise
    entry = FileEntry(rel, format, layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, tensors, layout.objects, format)  # type: ignore[arg-type]


def _whole_tensors(layout: ArchiveLayout, rel: str,
                   more: Callable[[str], dict[str, Any]] = lambda key: {}
                   ) -> list[TensorEntry]:
    """The tensors of a format that stores each tensor whole in its own byte range
    (safetensors, tensorizer): one dense entry with one ``data`` part each, named by its
    key (none for a non-empty tensor stored without bytes: tensorizer's meta tensors);
    ``more(key)``: the entry's other fields."""
    by_key = {s.key: s for s in layout.storages}
    tensors = []
    for t in layout.tensors:
        s = by_key[t.storage_key]
        parts = (Part("data", rel, s.data_offset, s.nbytes, t.dtype, t.shape, t.stride, 0,
                      s.key),) if s.nbytes or not t.numel else ()
        tensors.append(TensorEntry(t.storage_key, t.path, t.dtype, t.shape, t.stride, "dense",
                                   parts, **more(t.storage_key)))
    return tensors


def _safetensors(src: ByteSource, rel: str) -> FileModel:
    from ckptlab.format.safetensors import scan_safetensors

    layout = scan_safetensors(src)
    objects = [(("__metadata__",), dict(layout.metadata))] if layout.metadata else []
    entry = FileEntry(rel, "safetensors", layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, _whole_tensors(layout, rel), objects, "safetensors")


def _tensorizer(src: ByteSource, rel: str) -> FileModel:
    from ckptlab.format.tensorizer import scan_tensorizer_entries

    layout, extras = scan_tensorizer_entries(src)

    def more(key: str) -> dict[str, Any]:
        info = extras[key]
        return {"is_parameter": info["type"] == "parameter",
                "extra": tuple((k, info[k]) for k in ("type", "hashes", "header", "zeros")
                               if k in info)}

    entry = FileEntry(rel, "tensorizer", layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, _whole_tensors(layout, rel, more), [], "tensorizer")


# detect_format kind -> adapter(source, relative name) -> FileModel
FILE_ADAPTERS: dict[str, Callable[[ByteSource, str], FileModel]] = {
    # torch.save zips; TorchScript and torch.export (.pt2) zips are told apart by their records
    # (the adapters import this module: theirs are imported on first use)
    "torch-zip": lazy_callable("ckptlab.checkpoint._torchscript:model_zip"),
    "safetensors": _safetensors,
    "tensorizer": _tensorizer,
    "legacy-pickle": lazy_callable("ckptlab.checkpoint._legacy:model_legacy"),
    "pickle": lazy_callable("ckptlab.checkpoint._legacy:model_pickle"),  # legacy, protocol 3-5
}


def _model_file(src: ByteSource, rel: str) -> FileModel:
    """One file's model, its ``full_path`` the source's name. A zip is told by the end record
    in the bytes its source keeps already (a URL's first request moved the tail), else by its
    first bytes."""
    import dataclasses

    from ckptlab.format._placed import looks_like_zip

    kind = "torch-zip" if looks_like_zip(src) else sniff(src)
    adapter = FILE_ADAPTERS.get(kind)
    if adapter is None:
        raise not_a_checkpoint(src, kind)
    model = adapter(src, rel)
    model.entry = dataclasses.replace(model.entry, full_path=src.name)
    return model


def _model_in(tree: Tree, rel: str) -> FileModel:
    """The model of the file ``rel`` of ``tree`` (a URL: a ``.safetensors`` from its head, 1
    request up to a 256 KiB header; a zip from its tail, at most 3 requests)."""
    with tree.source(rel) as src:
        return _model_file(src, rel)


# -- reading tensors ---------------------------------------------------------------------------
def _reader(tree: Tree | None) -> Reader:
    """``ck.read``: each part's bytes in one read of its file (``tree.fetch`` by the file's
    ``full_path``: a ``pread``, or one ranged request behind a URL), the tensor built from
    them (every kind: dense, sparse, quantized, nested, DCP chunks). ``moved`` (file ->
    ``[(offset, bytes)]``) holds bytes the caller read already; ``scratch`` (a
    :class:`~ckptlab.checkpoint.model.Scratch`) the memory local parts are read into."""
    def read(ck: Checkpoint, entry: TensorEntry,
             moved: dict[str, list[tuple[int, bytes]]] | None = None,
             scratch: Scratch | None = None) -> Any:
        def name_of(rel: str) -> str:
            return ck.file(rel).full_path or rel

        def part_bytes(p: Part) -> bytes:
            for lo, data in (moved or {}).get(p.file, ()):
                if lo <= p.offset and p.offset + p.nbytes <= lo + len(data):  # (no copy)
                    return memoryview(data)[p.offset - lo:p.offset - lo + p.nbytes]
            full = ck.file(p.file).full_path
            if tree is None or not full:
                raise UnsupportedFormatError(
                    "the checkpoint was opened from bytes or a file object; read() needs a "
                    "path (open the file by name)", path=ck.path, record=entry.name)
            data = tree.fetch(full, p.offset, p.offset + p.nbytes,
                              scratch.take(p.nbytes) if scratch else None) if p.nbytes else b""
            if len(data) != p.nbytes:
                raise TruncatedArchiveError("file ends inside a tensor's bytes", path=full,
                                            record=entry.name, offset=p.offset,
                                            expected=f"{p.nbytes} bytes",
                                            actual=f"{len(data)} bytes")
            extra = dict(entry.extra) if entry.extra else {}  # (most tensors have none)
            if "hashes" in extra:  # a tensorizer tensor: its header and data as it hashed them
                from ckptlab.format.tensorizer import check_hashes

                at, n, block = extra["header"]
                check_hashes(extra["hashes"], tree.fetch(full, at, at + n), block, data,
                             path=full, record=entry.name, offset=p.offset)
            return data

        return build_tensor(entry, part_bytes, name_of, source=ck.path)
    return read


def _checkpoint(format: str, path: str, models: list[FileModel], reader: Reader,
                prefix_files: bool, notes: tuple[str, ...] = ()) -> Checkpoint:
    if len(models) == 1 and not prefix_files and isinstance(models[0].tensors, LazyEntries):
        # one torch.save file: its entries made on first access, when its names are unique
        m = models[0]
        lazy = m.tensors
        names = [] if lazy.built else lazy.names()
        if not lazy.built and len(set(names)) == len(names):  # else unique_names renames
            tensors_ = LazyTensors(names, lazy.entry, lambda: list(lazy.value()))
            return Checkpoint(format, path, (m.entry,), tensors_, _Values(models, False),
                              reader, notes + m.notes)
    tensors: list[TensorEntry] = []
    files = []
    for m in models:
        files.append(m.entry)
        prefix = (m.entry.path,) if prefix_files else ()
        for t in m.tensors:
            if prefix:
                path_ = (*prefix, *t.path)
                t = _renamed(t, path_)
            tensors.append(t)
        notes = notes + m.notes
    return Checkpoint(format, path, tuple(files), unique_names(tensors),
                      _Values(models, prefix_files), reader, notes)


class _Values(BuiltOnce[dict[str, Any]], MutableMapping[str, Any]):
    """Name -> non-tensor value of every file, named when first looked at: a whole
    ``nn.Module`` pickled holds a dozen values per module (flags, hook dicts), hundreds of
    thousands that opening it need not name."""

    __slots__ = ("_paths",)

    def __init__(self, models: list[FileModel], prefix_files: bool) -> None:
        self._paths: dict[str, tuple[Any, ...]] = {}

        def named() -> dict[str, Any]:
            value = {}
            for m in models:
                prefix = (m.entry.path,) if prefix_files else ()
                for vpath, item in m.objects:
                    name = tensor_name((*prefix, *vpath))
                    value[name] = item
                    self._paths[name] = (*prefix, *vpath)
            return value

        super().__init__(named)

    def paths(self) -> dict[str, tuple[Any, ...]]:
        """Name -> the value's path of keys in the file (ints stay ints)."""
        self.value()
        return self._paths

    def __getitem__(self, name: str) -> Any:
        return self.value()[name]

    def __setitem__(self, name: str, value: Any) -> None:  # (an index's metadata, added)
        self.value()[name] = value

    def __delitem__(self, name: str) -> None:
        del self.value()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.value())

    def __len__(self) -> int:
        return len(self.value())


def _renamed(t: TensorEntry, path: tuple[Any, ...]) -> TensorEntry:
    import dataclasses

    return dataclasses.replace(t, name=tensor_name(path), path=path)


def _open_file(tree: Tree | None, full: str | None, rel: str | None, obj: Any,
               opened: ByteSource | None = None) -> Checkpoint:
    """One file: ``full`` (its path or URL, ``rel`` its own name) in ``tree``, or ``obj``
    (bytes, a file object, read from where it stands as ``torch.load`` reads it).
    ``opened``: ``full`` opened already (``tree.open``; the bytes it kept are not read
    again), closed here."""
    if tree is None:
        with ByteSource(obj) as src:
            model = _model_file(src, src.name)
        model.entry = _with_full_path(model.entry, "")
        return _checkpoint(model.format, src.name, [model], _reader(None), False)
    assert full is not None and rel is not None
    with tree.open(full) if opened is None else opened as src, task(f"reading {rel}"):
        model = _model_file(src, rel)
    return _checkpoint(model.format, full, [model], _reader(tree), False)


def _with_full_path(entry: FileEntry, full: str) -> FileEntry:
    import dataclasses

    return dataclasses.replace(entry, full_path=full)


# -- directories -------------------------------------------------------------------------------
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pt2", ".tar")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")
# transformers' ``variant`` names (``_add_variant``): model.fp16.safetensors,
# model.safetensors.index.fp16.json; diffusers' and PEFT's weight files go by the same rules
_HF_STEMS = r"(?:model|pytorch_model|diffusion_pytorch_model|adapter_model)"
_HF_INDEX_RE = re.compile(_HF_STEMS + r"\.(?:safetensors|bin)\.index(?:\.[\w-]+)?\.json")
_HF_SINGLE_RE = re.compile(_HF_STEMS + r"(?:\.[\w-]+)?\.(?:safetensors|bin)")
_SHARD_RE = re.compile(r".*-\d{5}-of-\d{5}\.\w+")


def _hf_model_name(names: list[str], plain: tuple[str, ...], pattern: re.Pattern[str]
                   ) -> str | None:
    """The directory's model file or index: the plain names first (safetensors before .bin),
    then variants, diffusers' and adapters' names in sorted order."""
    for name in plain:
        if name in names:
            return name
    return next((n for n in names if pattern.fullmatch(n) and not _SHARD_RE.fullmatch(n)),
                None)


def _json_entry(tree: Tree, rel: str) -> tuple[FileEntry, Any]:
    """A JSON file of the directory (one request behind a URL), as an entry and a value."""
    full, raw = tree.read_bytes(rel, what="JSON file")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"not UTF-8 JSON: {str(exc)[:120]}", path=full,
                                  offset=0) from None
    seg = (Segment(SegmentKind.HEADER, 0, len(raw), rel),) if raw else ()
    return FileEntry(rel, "json", len(raw), seg, None, full), value


def _other_entry(tree: Tree, rel: str) -> FileEntry:
    full = tree.resolve(rel)
    nbytes = tree.nbytes(rel)
    return FileEntry(rel, "other", nbytes, file_segments_or_unknown(nbytes, None), None, full)


def _open_hf_index(tree: Tree, index_name: str, names: list[str]) -> Checkpoint:
    """A Hugging Face sharded directory: the index (one request behind a URL), then each
    shard it names (a safetensors shard: one request up to a 256 KiB header); ``names``:
    the directory's other files (none where it cannot be listed)."""
    entry, index = _json_entry(tree, index_name)
    weight_map = _weight_map(index, entry.full_path)
    shards = sorted(set(weight_map.values()))  # file order: tensors by shard, then offset
    for shard in shards:
        tree.resolve(shard)  # refuses names that leave the directory, before any is read
    models = []
    with task("reading shards", total=len(shards)) as progress:
        for shard in shards:
            models.append(_model_in(tree, shard))
            progress.advance()
    notes = _index_notes(index_name, weight_map, models)
    extra = [n for n in names if n not in shards and n != index_name]
    ck = _checkpoint("hf", tree.name, models, _reader(tree), False, notes)
    ck = _with_extra_files(ck, tree, extra)
    ck.files = tuple(sorted((*ck.files, entry), key=lambda f: f.path))
    if isinstance(index.get("metadata"), dict):
        ck._objects[index_name] = index["metadata"]
    return ck


def _weight_map(index: Any, path: str) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face index (tensor name -> shard file), checked."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptArchiveError("index has no weight_map of tensor name -> shard file",
                                  path=path)
    return weight_map


def _index_notes(index_name: str, weight_map: dict[str, str], models: list[FileModel]
                 ) -> tuple[str, ...]:
    """What differs between an index's weight_map and the tensors its shards hold."""
    found = {t.name: m.entry.path for m in models for t in m.tensors}
    missing = [k for k in weight_map if k not in found]
    unlisted = [k for k in found if k not in weight_map]
    elsewhere = [k for k, v in weight_map.items() if k in found and found[k] != v]
    notes: tuple[str, ...] = ()
    if missing:
        notes += (f"{len(missing)} names in {index_name} are in none of its shards "
                  f"(first: {missing[0]!r})",)
    if unlisted:
        notes += (f"{len(unlisted)} tensors of the shards are not in {index_name} "
                  f"(first: {unlisted[0]!r} in {found[unlisted[0]]})",)
    if elsewhere:
        notes += (f"{len(elsewhere)} tensors are in another shard than {index_name} says "
                  f"(first: {elsewhere[0]!r} in {found[elsewhere[0]]}, index: "
                  f"{weight_map[elsewhere[0]]})",)
    return notes


def _unread_note(name: str, exc: ArchiveError) -> str:
    where = "".join(f", {k} {v!r}" for k, v in (("record", exc.record), ("offset", exc.offset))
                    if v is not None)
    return f"{name}{where}: listed as other, not read: {exc.reason}"


def _with_extra_files(ck: Checkpoint, tree: Tree, extra: list[str],
                      errors: list[ArchiveError] | None = None) -> Checkpoint:
    """Add the directory's other files: checkpoint files prefixed by name, JSON files as
    values, and every file that is no checkpoint ckptlab reads (a plain pickle, text, a damaged
    archive) listed as ``"other"`` with a note; its error is appended to ``errors``."""
    if not extra:
        return ck
    more_models: list[FileModel] = []
    files = list(ck.files)
    objects = dict(ck._objects)
    notes = list(ck.notes)
    with task("reading files", total=len(extra)) as progress:
        for name in extra:
            progress.advance()
            if name.endswith(".json"):
                try:
                    entry, value = _json_entry(tree, name)
                except CorruptArchiveError as exc:
                    files.append(_other_entry(tree, name))
                    notes.append(_unread_note(name, exc))
                    continue
                files.append(entry)
                objects[name] = value
                continue
            try:
                more_models.append(_model_in(tree, name))
            except ArchiveError as exc:
                files.append(_other_entry(tree, name))
                notes.append(_unread_note(name, exc))
                if errors is not None:
                    errors.append(exc)
    tensors = list(ck.tensors.values())
    if more_models:
        extra_ck = _checkpoint("dir", tree.name, more_models, ck._reader, True)
        files.extend(extra_ck.files)
        tensors.extend(extra_ck.tensors.values())
        objects.update(extra_ck._objects)
        notes.extend(extra_ck.notes)
    files.sort(key=lambda f: f.path)
    return Checkpoint(ck.format, ck.path, tuple(files), unique_names(tensors), objects,
                      ck._reader, tuple(notes))


# what a directory that cannot be listed (a URL) is probed for, in order (a miss: one request)
DIR_PROBES = ("model.safetensors.index.json", ".metadata", "pytorch_model.bin.index.json",
              "model.safetensors", "pytorch_model.bin")
REMOTE_DIR_PROBES = DIR_PROBES  # the name it had when only URLs were probed


def _open_named(tree: Tree, name: str, names: list[str]) -> Checkpoint:
    """The directory opened from the file that says what it is: ``.metadata`` (DCP), an index
    JSON (Hugging Face shards) or the model file; ``names``: the directory's other files."""
    from ckptlab.dcp import METADATA

    if name == METADATA:
        from ckptlab.checkpoint._dcp import open_dcp

        ck = open_dcp(tree)
        # files beside DCP's own: Megatron-Core's metadata.json and common.pt, a README...
        own = {f.path for f in ck.files}
        return _with_extra_files(ck, tree, [n for n in names if n not in own])
    if _HF_INDEX_RE.fullmatch(name):
        return _open_hf_index(tree, name, names)
    ck = _checkpoint("hf", tree.name, [_model_in(tree, name)], _reader(tree), False)
    return _with_extra_files(ck, tree, [n for n in names if n != name])


def _open_dir(tree: Tree, entry: str | None = None, *, composite: bool = True) -> Checkpoint:
    """A directory: from ``entry`` (a file naming what the directory is: ``.metadata``, an
    index JSON), else from its listing (a composite model's components first:
    :mod:`ckptlab.checkpoint.composite`), else (a URL) from the first of :data:`DIR_PROBES`
    there."""
    from ckptlab.dcp import METADATA

    names = tree.list()
    if entry is not None:
        return _open_named(tree, entry, names or [])
    if names is None:
        return _open_probed(tree)
    if composite and isinstance(tree, LocalTree):
        from ckptlab.checkpoint.composite import composite_parts, open_composite

        parts = composite_parts(tree.root, names)
        if parts is not None:
            return open_composite(
                tree.root, parts, lambda path: _open_dir(LocalTree(path), composite=False),
                lambda rel: _json_entry(tree, rel))
    if METADATA in names:
        return _open_named(tree, METADATA, names)
    index = _hf_model_name(names, HF_INDEXES, _HF_INDEX_RE)
    if index is not None:
        return _open_named(tree, index, names)
    from ckptlab.checkpoint._dcp import open_dcp_shards
    from ckptlab.dcp import is_dcp_shards_dir

    if is_dcp_shards_dir(tree.name, names):  # HuggingFaceStorageWriter(save_distributed=True)
        return open_dcp_shards(tree)
    single = _hf_model_name(names, HF_SINGLE, _HF_SINGLE_RE)
    if single is not None:
        return _open_named(tree, single, names)
    candidates = [n for n in names if not n.endswith(".json")]
    if not candidates:
        raise UnsupportedFormatError("a directory without checkpoint files (no .metadata, no "
                                     "*.index.json, no model files)", path=tree.name)
    from ckptlab.checkpoint.deepspeed import (
        deepspeed_checkpoint,
        is_deepspeed_save,
        universal_files,
    )

    deepspeed = is_deepspeed_save(names)
    if deepspeed and isinstance(tree, LocalTree):  # a universal checkpoint's zero/<param>/
        names = names + universal_files(tree.root)
    ck = Checkpoint("dir", tree.name, (), {}, {}, _reader(tree))
    errors: list[ArchiveError] = []
    ck = _with_extra_files(ck, tree, names, errors)
    if not ck.tensors and not any(f.format not in ("json", "other") for f in ck.files):
        damaged = next((e for e in errors if not isinstance(e, UnsupportedFormatError)), None)
        if damaged is not None:  # its own error says best what is wrong
            raise damaged
        raise UnsupportedFormatError("a directory whose files are not checkpoints ckptlab "
                                     f"reads ({', '.join(names[:5])})", path=tree.name)
    return deepspeed_checkpoint(ck) if deepspeed else ck


def _open_probed(tree: Tree) -> Checkpoint:
    """A directory that cannot be listed, from the first of :data:`DIR_PROBES` it has."""
    for name in DIR_PROBES:
        try:
            return _open_named(tree, name, [])
        except NotFoundError as exc:
            if exc.path != tree.name_of(name):  # a file the index or .metadata names is missing
                raise
    raise UnsupportedFormatError(
        "a directory URL with none of " + ", ".join(DIR_PROBES) + " (a URL cannot be "
        "listed: give the URL of the checkpoint file, of the index JSON, or of .metadata)",
        path=tree.name)


# -- where the checkpoint is -------------------------------------------------------------------
def _open_location(source: Any, storage_options: dict[str, Any] | None
                   ) -> tuple[Checkpoint, Tree | None]:
    """:func:`open_checkpoint`, and the tree it read from (None: bytes or a file object)."""
    return open_location(locate(source, storage_options))


def open_location(where: Location, opened: ByteSource | None = None
                  ) -> tuple[Checkpoint, Tree | None]:
    """:func:`open_checkpoint` of what :func:`~ckptlab.source.locate` found, and the tree it
    read from (None: bytes or a file object). ``opened``: the file ``where.file`` opened
    already by the caller (``where.tree.open``; what it kept is not asked for again), closed
    here.

    A URL taken for a file whose first request says it is a directory opens as that
    directory (:func:`directory_location`)."""
    from ckptlab.dcp import METADATA

    tree = where.tree
    if tree is None:
        return _open_file(None, None, None, where.obj), None
    if where.file is None:
        return _open_dir(tree), tree
    rel = where.rel
    assert rel is not None
    if rel == METADATA or _HF_INDEX_RE.fullmatch(rel):  # opens its directory, no probing
        return _open_dir(tree, rel), tree
    try:
        return _open_file(tree, where.file, rel, None, opened), tree
    except IsDirectoryError as exc:  # "dir" of a URL: the server says it is "dir/"
        inside = directory_location(where, exc).tree
        assert inside is not None
        return _open_dir(inside), inside


def directory_location(where: Location, exc: IsDirectoryError) -> Location:
    """``where``, a URL taken for a file, as the directory ``exc`` says it is: the first
    request of ``dir`` was redirected to ``dir/`` (nginx: 301, then 403 without a listing).
    The new location reads through the same store (its requests, the redirect's included,
    are counted together). ``exc`` is raised again when it is about another file."""
    if where.tree is None or exc.path != where.file:
        raise exc
    return Location(_directory_of(where.tree, exc.path))


def _directory_of(tree: Tree, full: str) -> Tree:
    """The tree of the directory whose name (without its ``/``) is ``full``."""
    from ckptlab.source import RemoteTree

    assert isinstance(tree, RemoteTree)  # only a URL is a directory found by reading it
    return RemoteTree(tree.store, full)


def open_url(url: str, storage_options: dict[str, Any] | None = None
             ) -> tuple[Checkpoint, Any]:
    """:func:`open_checkpoint` of a URL, and the :class:`~ckptlab.source.RemoteStore` whose
    ``stats`` count the requests made (opening, then each ``read``)."""
    ck, tree = _open_location(url, storage_options)
    return ck, getattr(tree, "store", None)


def as_checkpoint(source: Any) -> Checkpoint:
    """``source`` as it is where it is a :class:`Checkpoint`, else opened
    (:func:`open_checkpoint`): for functions that take either."""
    return source if isinstance(source, Checkpoint) else open_checkpoint(source)


def open_checkpoint(source: Source, *,
                    storage_options: dict[str, Any] | None = None,
                    step: int | None = None) -> Checkpoint:
    """Open any checkpoint as a :class:`~ckptlab.checkpoint.Checkpoint` (tensor first).

    Parameters
    ----------
    source
        A file path, a directory (DCP, Hugging Face, or any directory of checkpoint files), a
        binary file object (read from its current position, as ``torch.load`` does), bytes,
        or a URL fsspec reads (``https://``, ``s3://``, ``hf://``...; ``file://`` is a local
        path). A directory URL is probed for ``model.safetensors.index.json``, ``.metadata``,
        ``pytorch_model.bin.index.json``, ``model.safetensors`` and ``pytorch_model.bin`` in
        that order (a URL cannot be listed); written without its trailing ``/`` it costs the
        redirect the server answers with first. The path or URL of an index JSON or of
        ``.metadata`` opens its directory directly.
    storage_options
        For URLs: passed to fsspec (credentials, endpoints, HTTP ``headers``...).
    step
        For a training run's directory (several saves side by side: DeepSpeed, Megatron,
        the transformers Trainer, torchtune, Lightning, ``step-N`` DCP directories; see
        :mod:`ckptlab.checkpoint.runs`): open the save of that step instead of the one the
        framework resumes from. The checkpoint's ``run`` lists every save.

    Raises
    ------
    ArchiveError
        The checkpoint is damaged (truncated, corrupt), or is of a kind ckptlab does not read;
        the message names the file, what it is, and what to do.

    Notes
    -----
    Nothing from the checkpoint is executed; pickles are interpreted by ckptlab's bounded
    interpreter.

    A URL is read with exact ranged requests and no listing: a torch.save file opens in at
    most 3 requests, a Hugging Face sharded directory in 1 + one per shard, a DCP directory in
    2 + one per data file (its head; tensor items are read when a tensor is first asked
    for), and ``read(name)`` costs one request per part. Remote opening checks
    what a local one checks except the local headers and descriptors of storage records
    (derived from the central directory by torch's placement rules, verified to tile the
    file); see :mod:`ckptlab.format._placed`. Needs the ``remote`` extra.
    """
    from ckptlab.checkpoint.runs import RUN_LAYOUTS, resolve_run

    source, run = resolve_run(source, step)
    if step is not None and run is None:
        raise UnsupportedFormatError(f"step= is for a training run's directory (saves side by "
                                     f"side: {RUN_LAYOUTS}); this is not one",
                                     path=os.fspath(source) if isinstance(
                                         source, (str, os.PathLike)) else "<source>")
    ck = _open_location(source, storage_options)[0]
    ck.run = run
    return ck
