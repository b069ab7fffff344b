"""TorchScript archives (``torch.jit.save``), and the zip dispatch for every torch zip.

A TorchScript archive is a zip written by torch's ``PyTorchStreamWriter`` (the same records,
alignment and trailer as ``torch.save``), with, under the archive name:

- ``data.pkl``: the module object. Each module is ``NEWOBJ`` of a ``__torch__.<qualified>``
  class then ``BUILD`` with a dict of every attribute in slot order (parameters, buffers, plain
  tensor attributes, submodules, ``training``...). Tensors are ``_rebuild_tensor_v2`` of
  persistent ids ``('storage', torch.XStorage, key, location, numel)`` whose bytes are the
  record ``data/<key>``;
- ``constants.pkl``: a tuple of the tensors the code names ``CONSTANTS.c0``, ``c1``... (traced
  modules), bytes in ``constants/<key>``;
- ``code/__torch__/<module path>.py``: the classes, each declaring
  ``__parameters__ = [...]`` and ``__buffers__ = [...]``;
- ``version`` (or ``.data/version``), ``byteorder``, ``.data/serialization_id``, and optionally
  ``extra/*``, ``traced_inputs.pkl`` with ``traced_inputs/*``, ``bytecode.pkl``, debug pickles.

Names are those of ``torch.jit.load(f).state_dict()``, in its order: for each module its
parameters, then its buffers (both in slot order, non-persistent buffers included, as TorchScript
keeps no persistence flag), then each submodule; a submodule held under two attributes is listed
under both. Which attributes are parameters and buffers is read from the class's
``__parameters__``/``__buffers__`` lines in ``code/`` (the text is matched, never run). Tensors
that are not in the state dict follow: plain tensor attributes by their attribute path
(``sub.c``), then the constants as ``CONSTANTS.c0``... (the name the code uses). Each entry's
``extra`` says its ``slot``: parameter, buffer, attribute or constant.

``ck.read(name)`` gives the tensor as the loaded module holds it (``requires_grad`` as saved);
``state_dict()`` gives the same values detached. ``traced_inputs.pkl`` (example inputs of a
traced module; torch writes their records empty) and ``bytecode.pkl`` are left as records.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptlab.checkpoint._legacy import (
    check_grad,
    check_parts_inside,
    scan_torch_pickle,
    storage_dtypes,
)
from ckptlab.checkpoint._tensors import entries_from_logical
from ckptlab.checkpoint.model import FileEntry, TensorEntry
from ckptlab.checkpoint.open import FileModel
from ckptlab.errors import CorruptArchiveError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._pickle import PickleScan, ScannedTensor
from ckptlab.format._records import replace as replace_record
from ckptlab.format._tensor_refs import _TENSOR_REFS
from ckptlab.format._unpickle import Global, Reduced
from ckptlab.format.archive import (
    fold_name,
    largest_alignment,
    read_central_directory,
    read_record_data,
    read_small_record,
    record_segments,
    records_one_by_one,
)
from ckptlab.format.layout import (
    ArchiveLayout,
    Record,
    Segment,
    StorageInfo,
    TensorInfo,
)
from ckptlab.source._bytes import ByteSource

__all__ = ["ZipScan", "model_torchscript", "model_zip", "scan_zip"]


# -- any zip: records and segments ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ZipScan:
    """Every record of a zip written by torch's stream writer, and segments tiling the file."""

    trailer: _zip.Trailer
    records: tuple[Record, ...]
    segments: tuple[Segment, ...]
    prefix: str  # the archive name: the first record's directory (torch's reader takes it)
    by_short: dict[str, Record]  # fold_name(name under the prefix) -> record

    def record(self, short: str) -> Record | None:
        """The record ``<prefix>/<short>``, looked up as torch does (ASCII case ignored)."""
        return self.by_short.get(fold_name(short))

    def small(self, src: ByteSource, short: str) -> str | None:
        """The small ASCII record ``<prefix>/<short>``, or None when there is none."""
        rec = self.record(short)
        return None if rec is None else read_small_record(src, rec)


def scan_zip(src: ByteSource) -> ZipScan:
    """Records (local headers, extras, descriptors checked against the central directory)."""
    trailer, entries = read_central_directory(src)
    records, headers = records_one_by_one(src, trailer, entries)
    segments = record_segments(records, headers, trailer, src.nbytes, src.name)
    first = entries[0].name if entries else ""
    prefix = first.split("/", 1)[0] if "/" in first else ""
    head = fold_name(prefix + "/") if prefix else ""
    by_short = {fold_name(r.name)[len(head):]: r for r in records
                if fold_name(r.name).startswith(head)}
    return ZipScan(trailer, tuple(records), segments, prefix, by_short)


def zip_layout(zs: ZipScan, src: ByteSource, format: str, storages: tuple[StorageInfo, ...],
               tensors: tuple[TensorInfo, ...], *, pickle_protocol: int | None = None,
               logical: tuple[Any, ...] = (), objects: tuple[Any, ...] = (),
               metadata: dict[str, str] | None = None) -> ArchiveLayout:
    """The :class:`ArchiveLayout` of a TorchScript or torch.export archive."""
    t = zs.trailer
    return ArchiveLayout(
        format=format, path=src.name, file_nbytes=src.nbytes, archive_name=zs.prefix,
        records=zs.records, storages=storages, tensors=tensors, segments=zs.segments,
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=any(r.zip64_extra_nbytes for r in zs.records),
        central_directory_offset=t.cd_offset, central_directory_nbytes=t.cd_nbytes,
        zip64_eocd_offset=t.zip64_eocd_offset, zip64_locator_offset=t.zip64_locator_offset,
        eocd_offset=t.eocd_offset, byteorder=zs.small(src, "byteorder"),
        pickle_protocol=pickle_protocol, metadata=metadata,
        logical=logical, objects=objects)


def model_zip(src: ByteSource, rel: str) -> FileModel:
    """Any zip: a torch.save archive, else a TorchScript or torch.export archive.

    The torch.save scan runs first (it costs nothing more for the common case); a zip it
    refuses as not its own is scanned again and recognised by its records: ``data.pkl`` with
    ``constants.pkl`` or ``code/`` is TorchScript, an ``archive_format`` record saying ``pt2``
    is torch.export's, ``serialized_exported_program.json`` with ``serialized_state_dict.pt``
    is torch.export's of torch 2.7 and earlier. Anything else keeps the torch.save refusal.
    """
    from ckptlab.checkpoint.open import _torch_zip
    from ckptlab.format._kinds import foreign_zip, looks_like_export

    try:
        return _torch_zip(src, rel)
    except UnsupportedFormatError as refusal:
        zs = scan_zip(src)
        shorts = {fold_name(s) for s in zs.by_short}
        if "data.pkl" in shorts and ("constants.pkl" in shorts or
                                     any(s.startswith("code/") for s in shorts)):
            return model_torchscript(src, rel, zs)
        if (zs.small(src, "archive_format") or "").strip() == "pt2":
            from ckptlab.checkpoint._pt2 import model_pt2

            return model_pt2(src, rel, zs)
        from ckptlab.checkpoint._pt2 import is_legacy_pt2, model_pt2_legacy

        if is_legacy_pt2(zs):  # torch.export.save of torch 2.7 and before
            return model_pt2_legacy(src, rel, zs)
        if "model.json" in shorts and "attributes.pkl" in shorts:
            raise UnsupportedFormatError("an early TorchScript archive (model.json with "
                                         "attributes.pkl): load it with torch.jit.load and "
                                         "save it again", path=src.name) from None
        names = [r.name for r in zs.records]
        if "data.pkl" not in shorts and looks_like_export(names):  # but it is not one
            raise UnsupportedFormatError(foreign_zip(names, export_checked=True),
                                         path=src.name) from None
        raise refusal from None


# -- TorchScript ---------------------------------------------------------------------------------
def _same(value: Any = None, *rest: Any) -> Any:
    return value


# globals TorchScript's pickler writes around typed containers: the value is the first argument
_HANDLERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch.jit._pickle", name): _same
    for name in ("restore_type_tag", "build_intlist", "build_tensorlist", "build_doublelist",
                 "build_boollist")
}


@dataclass(frozen=True, slots=True)
class _ClassInfo:
    is_module: bool
    parameters: frozenset[str]
    buffers: frozenset[str]


_CLASS_LINE = re.compile(r"class ([A-Za-z_][A-Za-z0-9_]*)(?:\(([^)]*)\))?:\s*")
_SLOTS_LINE = re.compile(r"  (__parameters__|__buffers__) = (\[.*\])\s*")


class _Classes:
    """The classes the archive's ``code/`` declares, parsed on first use (one file each)."""

    def __init__(self, src: ByteSource, zs: ZipScan) -> None:
        self.src = src
        self.zs = zs
        self.files: dict[str, dict[str, _ClassInfo]] = {}
        self.unknown: set[str] = set()

    def info(self, cls: Global) -> _ClassInfo | None:
        if not cls.module.startswith("__torch__"):
            return None
        short = "code/" + cls.module.replace(".", "/") + ".py"
        if short not in self.files:
            self.files[short] = self._parse(short)
        found = self.files[short].get(cls.name)
        if found is None:
            self.unknown.add(cls.qualname)
        return found

    def _parse(self, short: str) -> dict[str, _ClassInfo]:
        rec = self.zs.record(short)
        if rec is None:
            return {}
        raw = read_record_data(self.src, rec)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptArchiveError("code record is not UTF-8", path=self.src.name,
                                      record=rec.name, offset=rec.data_offset) from None
        out: dict[str, _ClassInfo] = {}
        name = None
        slots: dict[str, frozenset[str]] = {}
        is_module = False
        for line in text.splitlines():
            m = _CLASS_LINE.fullmatch(line)
            if m is not None:
                if name is not None:
                    out[name] = _ClassInfo(is_module, slots.get("__parameters__", frozenset()),
                                           slots.get("__buffers__", frozenset()))
                name, is_module, slots = m[1], (m[2] or "").strip() == "Module", {}
                continue
            m = _SLOTS_LINE.fullmatch(line)
            if m is not None and name is not None:
                slots[m[1]] = self._names(m[2], rec, m[1])
        if name is not None:
            out[name] = _ClassInfo(is_module, slots.get("__parameters__", frozenset()),
                                   slots.get("__buffers__", frozenset()))
        return out

    def _names(self, text: str, rec: Record, what: str) -> frozenset[str]:
        try:
            value = ast.literal_eval(text)  # a list literal of strings; nothing is run
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CorruptArchiveError(f"{what} is not a list of names", path=self.src.name,
                                      record=rec.name, offset=rec.data_offset,
                                      actual=text[:80])
        return frozenset(value)


_MODULE_BOOKKEEPING = frozenset({"training", "_is_full_backward_hook"})


def _attrs(obj: Reduced) -> list[tuple[str, Any]]:
    state = obj.state
    if not isinstance(state, dict):
        return []
    return [(k, v) for k, v in state.items() if isinstance(k, str)]


class _StateDictWalk:
    """``state_dict()`` names: parameters, buffers, then submodules, depth first."""

    MAX_DEPTH = 256

    def __init__(self, classes: _Classes, by_ref: dict[int, ScannedTensor], limit: int,
                 path: str) -> None:
        self.classes = classes
        self.by_ref = by_ref
        self.limit = limit  # names + visits: modules shared along a chain expand exponentially
        self.path = path
        self.steps = 0
        self.out: list[tuple[tuple[str, ...], ScannedTensor, str]] = []
        self.modules: set[tuple[str, ...]] = set()  # paths of the modules visited

    def is_module(self, value: Any) -> bool:
        if not isinstance(value, Reduced):
            return False
        info = self.classes.info(value.func)
        if info is not None:
            return info.is_module
        # no code for the class: a TorchScript module always has a 'training' attribute
        return value.func.module.startswith("__torch__") and isinstance(value.state, dict) \
            and "training" in value.state

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limit:
            raise CorruptArchiveError(
                f"the module tree expands to more than {self.limit} names (modules shared "
                "along a chain?)", path=self.path, record="data.pkl")

    def visit(self, module: Reduced, prefix: tuple[str, ...], ancestors: frozenset[int]) -> None:
        if len(prefix) > self.MAX_DEPTH:
            raise CorruptArchiveError(f"modules nested deeper than {self.MAX_DEPTH} levels",
                                      path=self.path, record="data.pkl")
        self.step()
        self.modules.add(prefix)
        info = self.classes.info(module.func)
        attrs = _attrs(module)
        if info is not None:
            for slot, names in (("parameter", info.parameters), ("buffer", info.buffers)):
                for key, value in attrs:
                    if key in names and isinstance(value, _TENSOR_REFS):
                        found = self.by_ref.get(id(value))
                        if found is not None:
                            self.step()
                            self.out.append(((*prefix, key), found, slot))
        for key, value in attrs:
            if self.is_module(value) and id(value) not in ancestors:
                self.visit(value, (*prefix, key), ancestors | {id(value)})


def _storage_infos(src: ByteSource, zs: ZipScan, scan: PickleScan, directory: str,
                   pkl: Record) -> dict[str, StorageInfo]:
    """The pickle's storages joined with their records ``<directory>/<key>``."""
    dtypes = storage_dtypes(scan)
    out = {}
    for s in scan.storages:
        short = f"{directory}/{s.key}"
        rec = zs.record(short)
        if rec is None:
            raise CorruptArchiveError(f"the pickle references storage {s.key!r} but the archive "
                                      f"has no record {short!r}", path=src.name,
                                      record=pkl.name, offset=pkl.header_offset)
        if rec.uncompressed_nbytes != s.nbytes:
            raise CorruptArchiveError("storage record size differs from the pickle's "
                                      f"{s.storage_type} of {s.numel} elements", path=src.name,
                                      record=rec.name, offset=rec.header_offset,
                                      expected=f"{s.nbytes} bytes",
                                      actual=f"{rec.uncompressed_nbytes} bytes")
        if rec.method != 0 and s.nbytes:
            raise UnsupportedFormatError("storage record is compressed: its bytes are not in "
                                         "the file as the tensor holds them", path=src.name,
                                         record=rec.name, offset=rec.header_offset)
        dtype = s.dtype if s.storage_type != "UntypedStorage" else dtypes.get(s.key, "uint8")
        out[s.key] = StorageInfo(s.key, rec.name, dtype, s.nbytes, rec.data_offset,
                                 s.location, s.storage_type)
    return out


def _scan(src: ByteSource, rec: Record) -> tuple[PickleScan, tuple[Any, ...]]:
    return scan_torch_pickle(read_record_data(src, rec), path=src.name, record=rec.name,
                             data_offset=rec.data_offset, handlers=_HANDLERS)


def _entry(t: ScannedTensor, path: tuple[Any, ...], slot: str,
           storages: dict[str, StorageInfo], rel: str, key_prefix: str = "") -> TensorEntry:
    (entry,) = entries_from_logical([dataclasses.replace(t, path=path)], storages, rel)
    parts = entry.parts
    if key_prefix:
        parts = tuple(replace_record(p, storage_key=key_prefix + p.storage_key)
                      for p in parts)
    return dataclasses.replace(entry, parts=parts, extra=(*entry.extra, ("slot", slot)))


def model_torchscript(src: ByteSource, rel: str, zs: ZipScan) -> FileModel:
    """The file model of a TorchScript archive (see the module docstring)."""
    pkl = zs.record("data.pkl")
    if pkl is None:  # pragma: no cover - model_zip checked
        raise UnsupportedFormatError("TorchScript archive without data.pkl", path=src.name)
    scan, refs = _scan(src, pkl)
    by_ref: dict[int, ScannedTensor] = {}
    for ref, t in zip(refs, scan.logical):
        by_ref.setdefault(id(ref), t)
    storages = _storage_infos(src, zs, scan, "data", pkl)
    check_parts_inside(scan.logical, storages, src.name)
    classes = _Classes(src, zs)
    walk = _StateDictWalk(classes, by_ref, max(1 << 16, 8 * pkl.uncompressed_nbytes),
                          src.name)
    if isinstance(scan.root, Reduced) and walk.is_module(scan.root):
        walk.visit(scan.root, (), frozenset({id(scan.root)}))
    tensors: list[TensorEntry] = []
    listed = {id(t) for _, t, _ in walk.out}
    for path, t, slot in walk.out:
        tensors.append(_entry(t, path, slot, storages, rel))
    for ref, t in zip(refs, scan.logical):  # tensors outside the state dict, by attribute path
        if id(by_ref[id(ref)]) not in listed:
            tensors.append(_entry(t, t.path, "attribute", storages, rel))
    # values beside the tensors, less the modules themselves and their bookkeeping attributes
    infos = list(scan.tensors)
    objects = [(p, v) for p, v in scan.objects if not walk.is_module(v) and not (
        p and p[:-1] in walk.modules and p[-1] in _MODULE_BOOKKEEPING)]
    logical = list(scan.logical)
    all_storages = list(storages.values())
    consts_rec = zs.record("constants.pkl")
    if consts_rec is not None:
        consts, _ = _scan(src, consts_rec)
        cstorages = _storage_infos(src, zs, consts, "constants", consts_rec)
        check_parts_inside(consts.logical, cstorages, src.name)
        for t in consts.logical:
            path = _constant_path(t.path)
            tensors.append(_entry(t, path, "constant", cstorages, rel, "constants/"))
        for p, v in consts.objects:
            if p:
                objects.append((_constant_path(p), v))
            elif isinstance(v, (tuple, list)):  # constants without a tensor among them
                objects.extend((("CONSTANTS", f"c{i}"), x) for i, x in enumerate(v))
        logical.extend(consts.logical)
        infos.extend(replace_record(i, path=_constant_path(i.path),
                                         storage_key=f"constants/{i.storage_key}")
                     for i in consts.tensors)
        all_storages.extend(replace_record(s, key=f"constants/{s.key}")
                            for s in cstorages.values())
    notes: tuple[str, ...] = ()
    if classes.unknown:
        first = sorted(classes.unknown)[0]
        notes = (f"no code/ declaration for {len(classes.unknown)} classes (first {first}): "
                 "their tensors are listed as attributes, not parameters or buffers",)
    check_grad(tensors, src.name)
    version = zs.small(src, "version") or zs.small(src, ".data/version")
    layout = zip_layout(zs, src, "torchscript", tuple(all_storages), tuple(infos),
                        pickle_protocol=scan.protocol, logical=tuple(logical),
                        objects=tuple(objects),
                        metadata={"version": version.strip()} if version else None)
    entry = FileEntry(rel, "torchscript", src.nbytes, zs.segments, layout)
    return FileModel(entry, tensors, objects, "torchscript", notes)


def _constant_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(i, ...)`` in the constants tuple -> ``("CONSTANTS", "c<i>", ...)`` as the code says."""
    if path and type(path[0]) is int:
        return ("CONSTANTS", f"c{path[0]}", *path[1:])
    return ("CONSTANTS", *path)
