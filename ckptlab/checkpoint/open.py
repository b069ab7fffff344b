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
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptlab.checkpoint._tensors import (
    build_tensor,
    entries_from_logical,
    unique_names,
)
from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    Part,
    TensorEntry,
    file_segments_or_unknown,
    tensor_name,
)
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._paths import resolve_inside
from ckptlab.format._source import ByteSource
from ckptlab.format.inspect import not_a_checkpoint, sniff
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind

__all__ = ["FILE_ADAPTERS", "open_checkpoint"]

Source = str | os.PathLike[str] | BinaryIO | bytes


# -- one file ----------------------------------------------------------------------------------
class FileModel:
    """What an adapter makes of one file: its entry, tensors, values and a tensor reader."""

    def __init__(self, entry: FileEntry, tensors: list[TensorEntry],
                 objects: list[tuple[tuple[Any, ...], Any]], format: str,
                 notes: tuple[str, ...] = ()) -> None:
        self.entry = entry
        self.tensors = tensors
        self.objects = objects
        self.format = format
        self.notes = notes


def _torch_zip(src: ByteSource, rel: str) -> FileModel:
    from ckptlab.format.archive import scan_torch_zip

    layout = scan_torch_zip(src)
    return _from_layout(layout, rel, "torch-zip")


def _from_layout(layout: ArchiveLayout, rel: str, format: str) -> FileModel:
    storages = {s.key: s for s in layout.storages}
    tensors = entries_from_logical(layout.logical, storages, rel)
    entry = FileEntry(rel, format, layout.file_nbytes, layout.segments, layout)
    return FileModel(entry, tensors, list(layout.objects), format)


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


def _lazy(module: str, name: str) -> Callable[[ByteSource, str], FileModel]:
    """An adapter from ``module``, imported on first use (the adapters import this module)."""
    def adapter(src: ByteSource, rel: str) -> FileModel:
        import importlib

        return getattr(importlib.import_module(module), name)(src, rel)
    return adapter


# detect_format kind -> adapter(source, relative name) -> FileModel
FILE_ADAPTERS: dict[str, Callable[[ByteSource, str], FileModel]] = {
    # torch.save zips; TorchScript and torch.export (.pt2) zips are told apart by their records
    "torch-zip": _lazy("ckptlab.checkpoint._torchscript", "model_zip"),
    "safetensors": _safetensors,
    "legacy-pickle": _lazy("ckptlab.checkpoint._legacy", "model_legacy"),
    "pickle": _lazy("ckptlab.checkpoint._legacy", "model_pickle"),  # legacy, protocol 3-5
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
                prefix_files: bool, notes: tuple[str, ...] = ()) -> Checkpoint:
    tensors: list[TensorEntry] = []
    objects: dict[str, Any] = {}
    files = []
    for m in models:
        files.append(m.entry)
        prefix = (m.entry.path,) if prefix_files else ()
        for t in m.tensors:
            if prefix:
                path_ = (*prefix, *t.path)
                t = _renamed(t, path_)
            tensors.append(t)
        for vpath, value in m.objects:
            objects[tensor_name((*prefix, *vpath))] = value
        notes = notes + m.notes
    return Checkpoint(format, path, tuple(files), unique_names(tensors), objects,
                      _reader(root), notes)


def _renamed(t: TensorEntry, path: tuple[Any, ...]) -> TensorEntry:
    import dataclasses

    return dataclasses.replace(t, name=tensor_name(path), path=path)


def _open_file(source: Source) -> Checkpoint:
    if isinstance(source, (str, os.PathLike)):
        full = os.fspath(source)
        rel = os.path.basename(full)
        with ByteSource(full) as src:
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
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptArchiveError("index has no weight_map of tensor name -> shard file",
                                  path=entry.full_path)
    shards = list(dict.fromkeys(weight_map.values()))
    models = []
    for shard in shards:
        models.append(_model_path(root, shard))
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
    extra = [n for n in names if n not in shards and n != index_name]
    ck = _checkpoint("hf", root, models, root, False, notes)
    ck = _with_extra_files(ck, root, extra)
    ck.files = tuple(sorted((*ck.files, entry), key=lambda f: f.path))
    if isinstance(index.get("metadata"), dict):
        ck._objects[index_name] = index["metadata"]
    return ck


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
    for name in extra:
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
    from ckptlab.plan.metadata import METADATA

    names = _dir_files(root)
    if METADATA in names:
        from ckptlab.checkpoint._dcp import open_dcp

        return open_dcp(root)
    index = _hf_model_name(names, HF_INDEXES, _HF_INDEX_RE)
    if index is not None:
        return _open_hf_index(root, index, names)
    from ckptlab.checkpoint._dcp import is_dcp_shards_dir, open_dcp_shards

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


def open_checkpoint(source: Source) -> Checkpoint:
    """Open any checkpoint as a :class:`~ckptlab.checkpoint.Checkpoint` (tensor first).

    Parameters
    ----------
    source
        A file path, a directory (DCP, Hugging Face, or any directory of checkpoint files), a
        binary file object (read from its current position, as ``torch.load`` does) or bytes.

    Raises
    ------
    ArchiveError
        The checkpoint is damaged (truncated, corrupt), or is of a kind ckptlab does not read;
        the message names the file, what it is, and what to do.

    Notes
    -----
    Nothing from the checkpoint is executed; pickles are interpreted by ckptlab's bounded
    interpreter.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return _open_dir(path)
        if not os.path.exists(path):
            raise ArchiveError("no such file or directory", path=path)
    return _open_file(source)
