"""``ckptlab.open``: recognise any checkpoint (file, directory, file object) and model it.

Files: torch.save zip archives, safetensors. Directories: DCP (``.metadata``), Hugging Face
(``*.index.json`` with shards, a single ``model.safetensors``/``pytorch_model.bin``, their
``variant`` names such as ``model.fp16.safetensors``, Trainer ``checkpoint-N/`` and accelerate
``save_state`` directories with optimizer/scheduler/rng state), and any other directory of
checkpoint files (format ``"dir"``, names prefixed by file). Beside the model's own files, a
file ckptlab cannot read as a checkpoint is listed as ``"other"`` with a note saying why, and
never stops the rest from opening. Adapters for further formats register in
:data:`FILE_ADAPTERS` by the kind :func:`ckptlab.format.detect_format` gives.
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
    TensorEntry,
    file_segments_or_unknown,
    tensor_name,
)
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._bulk import BuiltOnce
from ckptlab.format._paths import resolve_inside
from ckptlab.format._source import ByteSource, file_url_path, is_url
from ckptlab.format.inspect import not_a_checkpoint, sniff
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind

__all__ = ["FILE_ADAPTERS", "open_checkpoint", "open_url"]

Source = str | os.PathLike[str] | BinaryIO | bytes


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
    from ckptlab.format.archive import scan_torch_zip

    if getattr(src, "remote", False):  # behind a URL: no request per record
        from ckptlab.format._remote_zip import NotTorchPlacementError, scan_torch_zip_remote

        try:
            layout = scan_torch_zip_remote(src)  # type: ignore[arg-type]
        except NotTorchPlacementError as exc:
            model = _from_layout(scan_torch_zip(src), rel, "torch-zip")
            model.notes += (f"{rel}: records not placed as torch.save places them ({exc}); "
                            "every local header was read, a request per record or cluster",)
            return model
        return _from_layout(layout, rel, "torch-zip")
    layout = scan_torch_zip(src)
    return _from_layout(layout, rel, "torch-zip")


def _from_layout(layout: ArchiveLayout, rel: str, format: str) -> FileModel:
    storages = {s.key: s for s in layout.storages}
    tensors = LazyEntries(layout.logical, storages, rel)
    if not tensors.deferrable():
        tensors.value()  # raises now what making the entries would raise
    entry = FileEntry(rel, format, layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, tensors, layout.objects, format)  # type: ignore[arg-type]


def _safetensors(src: ByteSource, rel: str) -> FileModel:
    from ckptlab.format.safetensors import scan_safetensors

    layout = scan_safetensors(src)
    by_key = {s.key: s for s in layout.storages}
    tensors = []
    for t in layout.tensors:
        s = by_key[t.storage_key]
        part = Part("data", rel, s.data_offset, s.nbytes, t.dtype, t.shape, t.stride, 0, s.key)
        tensors.append(TensorEntry(t.storage_key, (t.storage_key,), t.dtype, t.shape, t.stride,
                                   "dense", (part,)))
    objects = [(("__metadata__",), dict(layout.metadata))] if layout.metadata else []
    entry = FileEntry(rel, "safetensors", layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, tensors, objects, "safetensors")


# detect_format kind -> adapter(source, relative name) -> FileModel
FILE_ADAPTERS: dict[str, Callable[[ByteSource, str], FileModel]] = {
    # torch.save zips; TorchScript and torch.export (.pt2) zips are told apart by their records
    # (the adapters import this module: theirs are imported on first use)
    "torch-zip": lazy_callable("ckptlab.checkpoint._torchscript:model_zip"),
    "safetensors": _safetensors,
    "legacy-pickle": lazy_callable("ckptlab.checkpoint._legacy:model_legacy"),
    "pickle": lazy_callable("ckptlab.checkpoint._legacy:model_pickle"),  # legacy, protocol 3-5
}


def _model_file(src: ByteSource, rel: str) -> FileModel:
    kind = sniff(src)
    adapter = FILE_ADAPTERS.get(kind)
    if adapter is None:
        raise not_a_checkpoint(src, kind)
    return adapter(src, rel)


# -- reading tensors ---------------------------------------------------------------------------
def _reader(root: str) -> Callable[[Checkpoint, TensorEntry], Any]:
    def read(ck: Checkpoint, entry: TensorEntry) -> Any:
        def path_of(rel: str) -> str:
            f = ck.file(rel)
            if not f.full_path:
                raise UnsupportedFormatError(
                    "the checkpoint was opened from bytes or a file object; read() needs a "
                    "path (open the file by name)", path=ck.path, record=entry.name)
            return f.full_path
        return build_tensor(entry, path_of, source=ck.path)
    return read


def _checkpoint(format: str, path: str, models: list[FileModel], root: str,
                prefix_files: bool, notes: tuple[str, ...] = (),
                reader: Callable[[Checkpoint, TensorEntry], Any] | None = None) -> Checkpoint:
    if len(models) == 1 and not prefix_files and isinstance(models[0].tensors, LazyEntries):
        # one torch.save file: its entries made on first access, when its names are unique
        m = models[0]
        lazy = m.tensors
        names = [] if lazy.built else lazy.names()
        if not lazy.built and len(set(names)) == len(names):  # else unique_names renames
            tensors_ = LazyTensors(names, lazy.entry, lambda: list(lazy.value()))
            return Checkpoint(format, path, (m.entry,), tensors_, _Values(models, False),
                              reader or _reader(root), notes + m.notes)
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
                      _Values(models, prefix_files), reader or _reader(root), notes)


class _Values(BuiltOnce[dict[str, Any]], MutableMapping[str, Any]):
    """Name -> non-tensor value of every file, named when first looked at: a whole
    ``nn.Module`` pickled holds a dozen values per module (flags, hook dicts), hundreds of
    thousands that opening it need not name."""

    __slots__ = ()

    def __init__(self, models: list[FileModel], prefix_files: bool) -> None:
        def named() -> dict[str, Any]:
            value = {}
            for m in models:
                prefix = (m.entry.path,) if prefix_files else ()
                for vpath, item in m.objects:
                    value[tensor_name((*prefix, *vpath))] = item
            return value

        super().__init__(named)

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


def _open_file(source: Source) -> Checkpoint:
    if isinstance(source, (str, os.PathLike)):
        full = os.fspath(source)
        rel = os.path.basename(full)
        with ByteSource(full) as src, task(f"reading {rel}"):
            model = _model_file(src, rel)
        model.entry = _with_full_path(model.entry, full)
        return _checkpoint(model.format, full, [model], os.path.dirname(full), False)
    with ByteSource(source) as src:  # a file object counts from where it stands
        model = _model_file(src, src.name)
    return _checkpoint(model.format, src.name, [model], "", False)


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


def _dir_files(root: str) -> list[str]:
    """Regular files directly in ``root`` (sorted), refusing links that leave it."""
    out = []
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if os.path.islink(full):
            resolve_inside(root, name)  # refuses a link out of the directory
        if os.path.isfile(full):
            out.append(name)
    return out


def _model_path(root: str, rel: str) -> FileModel:
    full = resolve_inside(root, rel)
    with ByteSource(full) as src:
        model = _model_file(src, rel)
    model.entry = _with_full_path(model.entry, full)
    return model


def _json_entry(root: str, rel: str) -> tuple[FileEntry, Any]:
    full = resolve_inside(root, rel)
    with ByteSource(full) as src:
        raw = src.read(0, src.nbytes, what="JSON file")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"not UTF-8 JSON: {str(exc)[:120]}", path=full,
                                  offset=0) from None
    seg = (Segment(SegmentKind.HEADER, 0, len(raw), rel),) if raw else ()
    return FileEntry(rel, "json", len(raw), seg, None, full), value


def _other_entry(root: str, rel: str) -> FileEntry:
    full = resolve_inside(root, rel)
    nbytes = os.path.getsize(full)
    return FileEntry(rel, "other", nbytes, file_segments_or_unknown(nbytes, None), None, full)


def _open_hf_index(root: str, index_name: str, names: list[str]) -> Checkpoint:
    entry, index = _json_entry(root, index_name)
    weight_map = _weight_map(index, entry.full_path)
    shards = sorted(set(weight_map.values()))  # file order: tensors by shard, then offset
    models = []
    with task("reading shards", total=len(shards)) as progress:
        for shard in shards:
            models.append(_model_path(root, shard))
            progress.advance()
    notes = _index_notes(index_name, weight_map, models)
    extra = [n for n in names if n not in shards and n != index_name]
    ck = _checkpoint("hf", root, models, root, False, notes)
    ck = _with_extra_files(ck, root, extra)
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


def _with_extra_files(ck: Checkpoint, root: str, extra: list[str],
                      errors: list[ArchiveError] | None = None) -> Checkpoint:
    """Add the directory's other files: checkpoint files prefixed by name, JSON files as
    values, and every file that is no checkpoint ckptlab reads (a plain pickle, text, a damaged
    archive) listed as ``"other"`` with a note; its error is appended to ``errors``."""
    more_models: list[FileModel] = []
    files = list(ck.files)
    objects = dict(ck._objects)
    notes = list(ck.notes)
    with task("reading files", total=len(extra)) as progress:
        for name in extra:
            progress.advance()
            if name.endswith(".json"):
                try:
                    entry, value = _json_entry(root, name)
                except CorruptArchiveError as exc:
                    files.append(_other_entry(root, name))
                    notes.append(_unread_note(name, exc))
                    continue
                files.append(entry)
                objects[name] = value
                continue
            try:
                more_models.append(_model_path(root, name))
            except ArchiveError as exc:
                files.append(_other_entry(root, name))
                notes.append(_unread_note(name, exc))
                if errors is not None:
                    errors.append(exc)
    tensors = list(ck.tensors.values())
    if more_models:
        extra_ck = _checkpoint("dir", root, more_models, root, True)
        files.extend(extra_ck.files)
        tensors.extend(extra_ck.tensors.values())
        objects.update(extra_ck._objects)
        notes.extend(extra_ck.notes)
    files.sort(key=lambda f: f.path)
    return Checkpoint(ck.format, ck.path, tuple(files), unique_names(tensors), objects,
                      ck._reader, tuple(notes))


def _open_dir(root: str) -> Checkpoint:
    from ckptlab.dcp import METADATA

    names = _dir_files(root)
    if METADATA in names:
        from ckptlab.checkpoint._dcp import open_dcp

        return open_dcp(root)
    index = _hf_model_name(names, HF_INDEXES, _HF_INDEX_RE)
    if index is not None:
        return _open_hf_index(root, index, names)
    from ckptlab.checkpoint._dcp import open_dcp_shards
    from ckptlab.dcp import is_dcp_shards_dir

    if is_dcp_shards_dir(root, names):  # HuggingFaceStorageWriter(save_distributed=True)
        return open_dcp_shards(root)
    single = _hf_model_name(names, HF_SINGLE, _HF_SINGLE_RE)
    if single is not None:
        model = _model_path(root, single)
        ck = _checkpoint("hf", root, [model], root, False)
        return _with_extra_files(ck, root, [n for n in names if n != single])
    candidates = [n for n in names if not n.endswith(".json")]
    if not candidates:
        raise UnsupportedFormatError("a directory without checkpoint files (no .metadata, no "
                                     "*.index.json, no model files)", path=root)
    ck = Checkpoint("dir", root, (), {}, {}, _reader(root))
    errors: list[ArchiveError] = []
    ck = _with_extra_files(ck, root, names, errors)
    if not ck.tensors and not any(f.format not in ("json", "other") for f in ck.files):
        damaged = next((e for e in errors if not isinstance(e, UnsupportedFormatError)), None)
        if damaged is not None:  # its own error says best what is wrong
            raise damaged
        raise UnsupportedFormatError("a directory whose files are not checkpoints ckptlab "
                                     f"reads ({', '.join(names[:5])})", path=root)
    return ck


# -- URLs --------------------------------------------------------------------------------------
def _remote_reader(store: Any, url_of: Callable[[str], str],
                   fetch: Callable[[str, int, int], bytes] | None = None
                   ) -> Callable[[Checkpoint, TensorEntry], Any]:
    """``ck.read`` behind URLs: one ranged request per part of the tensor (``fetch(rel,
    start, end)``, default ``store.range`` of ``url_of(rel)``, moves the bytes of a part).

    The parts' bytes are written at their own offsets into sparse temporary files that stand
    for the remote files, and the tensor is built from them by the same code as a local read
    (every kind: dense, sparse, quantized, nested, DCP chunks); the files go when it returns.
    """
    if fetch is None:
        def fetch(rel: str, start: int, end: int) -> bytes:
            return store.range(url_of(rel), start, end)

    def read(ck: Checkpoint, entry: TensorEntry) -> Any:
        import shutil
        import tempfile

        from ckptlab.checkpoint._tensors import build_tensor
        from ckptlab.errors import TruncatedArchiveError

        tmp = tempfile.mkdtemp(prefix="ckptlab-read-")
        try:
            local: dict[str, str] = {}
            for p in entry.parts:
                if p.file not in local:
                    local[p.file] = os.path.join(tmp, str(len(local)))
                    open(local[p.file], "wb").close()
                if not p.nbytes:
                    continue
                data = fetch(p.file, p.offset, p.offset + p.nbytes)
                if len(data) != p.nbytes:
                    raise TruncatedArchiveError("file ends inside a tensor's bytes",
                                                path=url_of(p.file),
                                                record=entry.name, offset=p.offset,
                                                expected=f"{p.nbytes} bytes",
                                                actual=f"{len(data)} bytes")
                with open(local[p.file], "r+b") as f:
                    f.seek(p.offset)
                    f.write(data)
            return build_tensor(entry, local.__getitem__, source=ck.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return read


def _remote_model(store: Any, url: str, rel: str) -> FileModel:
    """One file behind a URL: zip archives from their tail (at most 3 requests for a torch.save
    file), ``.safetensors`` from their head (1 request up to a 256 KiB header)."""
    import dataclasses

    from ckptlab.format._remote import RemoteSource
    from ckptlab.format._remote_zip import looks_like_zip

    src = RemoteSource(store, url, first="head" if rel.endswith(".safetensors") else "tail")
    try:
        kind = "torch-zip" if looks_like_zip(src) else sniff(src)
        adapter = FILE_ADAPTERS.get(kind)
        if adapter is None:
            raise not_a_checkpoint(src, kind)
        model = adapter(src, rel)
    finally:
        src.close()
    model.entry = dataclasses.replace(model.entry, full_path=url)
    return model


def _remote_json(store: Any, url: str, rel: str) -> tuple[FileEntry, Any]:
    """A JSON file behind a URL, in one request."""
    raw = store.whole(url)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"not UTF-8 JSON: {str(exc)[:120]}", path=url,
                                  offset=0) from None
    seg = (Segment(SegmentKind.HEADER, 0, len(raw), rel),) if raw else ()
    return FileEntry(rel, "json", len(raw), seg, None, url), value


def _open_remote_hf(store: Any, root: str, index_name: str) -> Checkpoint:
    """A Hugging Face sharded directory behind a URL: the index (1 request), then each shard
    it names (1 request per safetensors shard with a header up to 256 KiB)."""
    from ckptlab.format._remote import join_url

    entry, index = _remote_json(store, join_url(root, index_name), index_name)
    weight_map = _weight_map(index, entry.full_path)
    shards = sorted(set(weight_map.values()))  # file order: tensors by shard, then offset
    urls = {shard: join_url(root, shard) for shard in shards}  # refuses names leaving root
    models = []
    with task("reading shards", total=len(shards)) as progress:
        for shard in shards:
            models.append(_remote_model(store, urls[shard], shard))
            progress.advance()
    notes = _index_notes(index_name, weight_map, models)
    ck = _checkpoint("hf", root, models, root, False, notes,
                     _remote_reader(store, lambda rel: join_url(root, rel)))
    ck.files = tuple(sorted((*ck.files, entry), key=lambda f: f.path))
    if isinstance(index.get("metadata"), dict):
        ck._objects[index_name] = index["metadata"]
    return ck


def _open_remote_dcp(store: Any, root: str) -> Checkpoint:
    """A DCP directory behind a URL: ``.metadata`` (1 request), then, in DCP's default
    format, one request of each data file's head (its size and object items; tensor items
    are read when asked for: :mod:`ckptlab.checkpoint._dcp_remote`). Any other format has
    each data file it names moved whole (1 request each) into a temporary directory, for the
    time of the scan."""
    import dataclasses
    import shutil
    import tempfile

    from ckptlab.checkpoint._dcp import open_dcp
    from ckptlab.checkpoint._dcp_remote import open_dcp_remote
    from ckptlab.dcp import METADATA, inspect_dcp, metadata_of
    from ckptlab.format._remote import join_url

    raw = store.whole(join_url(root, METADATA))
    quick = open_dcp_remote(store, root, raw)
    if quick is not None:
        return quick
    meta = metadata_of(raw, join_url(root, METADATA))
    tmp = tempfile.mkdtemp(prefix="ckptlab-dcp-")
    try:
        with open(os.path.join(tmp, METADATA), "wb") as f:
            f.write(raw)
        names = sorted({str(info.relative_path) for info in meta.storage_data.values()})
        for name in names:
            url = join_url(root, name)  # refuses names that leave the directory
            target = os.path.join(tmp, *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                store.stream_to(url, f)
        ck = open_dcp(tmp, fast=False)  # everything read before the files go
        layout = dataclasses.replace(inspect_dcp(tmp), path=root)
    except ArchiveError as exc:  # it names the URL, not the temporary mirror
        if exc.path is not None and (exc.path + "/").startswith(tmp + "/"):
            exc.path = root + exc.path[len(tmp):]
            exc.args = (exc._render(),)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = tuple(dataclasses.replace(
        f, full_path=join_url(root, f.path),
        layout=layout if f.path == METADATA else f.layout) for f in ck.files)
    return Checkpoint("dcp", root, files, ck.tensors, ck._objects,
                      _remote_reader(store, lambda rel: join_url(root, rel)), ck.notes)


def _open_remote_file(store: Any, url: str) -> Checkpoint:
    from ckptlab.format._remote import url_name

    rel = url_name(url)
    model = _remote_model(store, url, rel)
    return _checkpoint(model.format, url, [model], "", False,
                       reader=_remote_reader(store, lambda _rel: url))


# what a directory URL is probed for, in order (HTTP has no listing)
REMOTE_DIR_PROBES = ("model.safetensors.index.json", ".metadata",
                     "pytorch_model.bin.index.json", "model.safetensors", "pytorch_model.bin")


def _open_remote_dir(store: Any, root: str) -> Checkpoint:
    from ckptlab.format._remote import RemoteNotFoundError, join_url

    for name in REMOTE_DIR_PROBES:
        url = join_url(root, name)
        try:
            if name == ".metadata":
                return _open_remote_dcp(store, root)
            if name.endswith(".index.json"):
                return _open_remote_hf(store, root, name)
            return _checkpoint("hf", root, [_remote_model(store, url, name)], root, False,
                               reader=_remote_reader(store, lambda rel: join_url(root, rel)))
        except RemoteNotFoundError as exc:
            if exc.path != url:  # a file the index or .metadata names is missing
                raise
    raise UnsupportedFormatError(
        "a directory URL with none of " + ", ".join(REMOTE_DIR_PROBES) + " (a URL cannot be "
        "listed: give the URL of the checkpoint file, of the index JSON, or of .metadata)",
        path=root)


def open_url(url: str, storage_options: dict[str, Any] | None = None
             ) -> tuple[Checkpoint, Any]:
    """:func:`open_checkpoint` of a URL, and the :class:`~ckptlab.format._remote.RemoteStore`
    whose ``stats`` count the requests made (opening, then each ``read``)."""
    from ckptlab.dcp import METADATA
    from ckptlab.format._remote import RemoteStore, url_name

    store = RemoteStore(url, storage_options)
    name = url_name(url)
    root = url.rstrip("/").rsplit("/", 1)[0]
    if url.endswith("/"):
        ck = _open_remote_dir(store, url.rstrip("/"))
    elif _HF_INDEX_RE.fullmatch(name):
        ck = _open_remote_hf(store, root, name)
    elif name == METADATA:
        ck = _open_remote_dcp(store, root)
    else:
        ck = _open_remote_file(store, url)
    return ck, store


def open_checkpoint(source: Source, *,
                    storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """Open any checkpoint as a :class:`~ckptlab.checkpoint.Checkpoint` (tensor first).

    Parameters
    ----------
    source
        A file path, a directory (DCP, Hugging Face, or any directory of checkpoint files), a
        binary file object (read from its current position, as ``torch.load`` does), bytes,
        or a URL fsspec reads (``https://``, ``s3://``, ``hf://``...; ``file://`` is a local
        path). A URL ending in ``/`` is a directory: it is probed for
        ``model.safetensors.index.json``, ``.metadata``, ``pytorch_model.bin.index.json``,
        ``model.safetensors`` and ``pytorch_model.bin`` in that order (a URL cannot be
        listed); the URL of an index JSON or of ``.metadata`` opens its directory directly.
    storage_options
        For URLs: passed to fsspec (credentials, endpoints, HTTP ``headers``...).

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
    file); see :mod:`ckptlab.format._remote_zip`. Needs the ``remote`` extra.
    """
    if is_url(source):
        local = file_url_path(source)  # type: ignore[arg-type]
        if local is None:
            return open_url(source, storage_options)[0]  # type: ignore[arg-type]
        source = local
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return _open_dir(path)
        if not os.path.exists(path):
            raise ArchiveError("no such file or directory", path=path)
    return _open_file(source)
