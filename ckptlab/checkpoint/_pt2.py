"""torch.export archives (``torch.export.save``, ``.pt2``): weights named from the JSON configs.

A ``.pt2`` is a zip written by torch's stream writer (``torch/export/pt2_archive/_package.py``)
with, under the archive name (the first record's directory):

- ``archive_format`` (``pt2``), ``archive_version``, ``.data/version``, ``byteorder``;
- ``models/<model>.json``: the serialized graph (not needed for the weights);
- ``data/weights/<model>_weights_config.json``: ``{"config": {fqn: PayloadMeta}}`` with
  ``PayloadMeta = {path_name, is_param, use_pickle, tensor_meta}`` and ``tensor_meta =
  {dtype (torch._export.serde.schema.ScalarType), sizes, strides, storage_offset ({"as_int":
  n} each), requires_grad, device, layout (7 = strided)}``;
- ``data/weights/weight_<i>``: the raw bytes of one whole untyped storage; every FQN whose meta
  names it views it with its sizes, strides and storage offset (tied weights share one record);
- ``data/constants/<model>_constants_config.json`` and ``data/constants/tensor_<i>`` (tensor
  constants, as weights), ``custom_obj_<i>`` (torchbind objects) and ``opaque_obj_<i>`` (a
  Python pickle: never interpreted here, listed as an object);
- ``data/sample_inputs/<model>.pt`` (a torch.save zip of the example inputs), ``extra/*``.

``use_pickle`` payloads (tensor subclasses) are a ``torch.save`` zip inside the record: it is
read whole and scanned as one (its pickle interpreted by ckptlab, nothing run), and its parts
point into the outer file. Early archives keep all weights in ``data/weights/<model>.pt`` (and
constants in ``data/constants/<model>.pt``), a ``torch.save`` of the dict, read the same way.
Nothing in the archive is unpickled.

Names are the FQNs of ``torch.export.load(f).state_dict`` and ``.constants``; an archive with
several models prefixes each name with its model name (``model`` alone is not prefixed). As
torch's loader does, each record is viewed with the dtype of the first FQN naming it, and a
non-parameter is ``requires_grad`` when that first FQN's meta says so.

torch 2.7 and earlier wrote another layout (:func:`model_pt2_legacy`): top-level records
``serialized_exported_program.json``, ``serialized_state_dict.pt``, ``serialized_constants.pt``,
``serialized_example_inputs.pt`` (each ``.pt`` the bytes of a whole ``torch.save`` archive) and
``version``. Each archive of weights is scanned in place through a window onto the file, so its
tensors' parts, and the segments of its zip structure, are at offsets in the outer file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ckptlab.checkpoint._legacy import check_grad, check_parts_inside
from ckptlab.checkpoint._tensors import entries_from_logical
from ckptlab.checkpoint._torchscript import ZipScan, zip_layout
from ckptlab.checkpoint.model import FileEntry, Part, TensorEntry, span_nbytes, tensor_name
from ckptlab.checkpoint.open import FileModel
from ckptlab.errors import CkptlabError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format._records import replace as replace_record
from ckptlab.format.archive import (
    fold_name,
    read_record_data,
    read_small_record,
    scan_torch_zip,
)
from ckptlab.format.layout import (
    ArchiveLayout,
    Record,
    Segment,
    SegmentKind,
    StorageInfo,
    TensorInfo,
)
from ckptlab.source._bytes import ByteSource
from ckptlab.source._window import FileWindow, PositionalFile

__all__ = ["SCALAR_TYPES", "is_legacy_pt2", "model_pt2", "model_pt2_legacy"]

# torch._export.serde.schema.ScalarType -> torch dtype name
SCALAR_TYPES: dict[int, str] = {
    1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32",
    8: "float64", 9: "complex32", 10: "complex64", 11: "complex128", 12: "bool",
    13: "bfloat16", 28: "uint16", 29: "float8_e4m3fn", 30: "float8_e5m2",
    31: "float8_e4m3fnuz", 32: "float8_e5m2fnuz", 33: "float8_e8m0fnu", 34: "uint32",
    35: "uint64",
}
STRIDED = 7  # torch._export.serde.schema.Layout.Strided

WEIGHTS = ("data/weights/", "{}_weights_config.json", "weight")
CONSTANTS = ("data/constants/", "{}_constants_config.json", "constant")


class _Bad(Exception):
    """A config value of the wrong shape (turned into a CorruptArchiveError with its place)."""


def _int(value: Any, what: str, *, low: int = 0) -> int:
    if isinstance(value, dict) and set(value) == {"as_int"}:
        value = value["as_int"]
    elif isinstance(value, dict) and "as_expr" in value:
        raise _Bad(f"{what} is symbolic ({str(value)[:60]})")
    if type(value) is not int or value < low:
        raise _Bad(f"{what} is not an int >= {low}: {str(value)[:60]}")
    return value


def _meta(meta: Any) -> tuple[str, tuple[int, ...], tuple[int, ...], int, bool]:
    """dtype, shape, stride, storage offset, requires_grad of a ``tensor_meta``."""
    if not isinstance(meta, dict):
        raise _Bad("tensor_meta is not an object")
    dtype = SCALAR_TYPES.get(meta.get("dtype")) if type(meta.get("dtype")) is int else None
    if dtype is None:
        raise _Bad(f"unknown dtype {str(meta.get('dtype'))[:20]}")
    sizes, strides = meta.get("sizes"), meta.get("strides")
    if not isinstance(sizes, list) or not isinstance(strides, list) or \
            len(sizes) != len(strides) or len(sizes) > 64:
        raise _Bad("sizes and strides are not two lists of the same length")
    shape = tuple(_int(v, "size") for v in sizes)
    stride = tuple(_int(v, "stride") for v in strides)
    offset = _int(meta.get("storage_offset", {"as_int": 0}), "storage offset")
    layout = meta.get("layout", STRIDED)
    if layout != STRIDED:
        raise _Bad(f"layout {str(layout)[:20]} is not strided")
    return dtype, shape, stride, offset, bool(meta.get("requires_grad", False))


def _device(meta: dict[str, Any]) -> str:
    """``{"type": "cuda", "index": 0}`` -> ``"cuda:0"`` (the device the weight was saved on)."""
    device = meta.get("device")
    if not isinstance(device, dict) or not isinstance(device.get("type"), str):
        return "cpu"
    index = device.get("index")
    return device["type"][:20] + (f":{index}" if type(index) is int else "")


def _config(src: ByteSource, rec: Record) -> dict[str, Any]:
    raw = read_record_data(src, rec)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"config is not UTF-8 JSON: {str(exc)[:120]}", path=src.name,
                                  record=rec.name, offset=rec.data_offset) from None
    config = value.get("config") if isinstance(value, dict) else None
    if not isinstance(config, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in config.items()):
        raise CorruptArchiveError("config is not {\"config\": {fqn: payload}}", path=src.name,
                                  record=rec.name, offset=rec.data_offset)
    return config


class _Pt2:
    def __init__(self, src: ByteSource, rel: str, zs: ZipScan) -> None:
        self.src = src
        self.rel = rel
        self.zs = zs
        self.tensors: list[TensorEntry] = []
        self.objects: list[tuple[tuple[Any, ...], Any]] = []
        self.storages: dict[str, StorageInfo] = {}
        self.notes: list[str] = []

    def bad(self, message: str, rec: Record, fqn: str) -> CorruptArchiveError:
        return CorruptArchiveError(f"{message} (payload {fqn!r})", path=self.src.name,
                                   record=rec.name, offset=rec.data_offset)

    def short(self, rec: Record) -> str:
        """A record's name under the archive name (``data/weights/weight_0``)."""
        return rec.name[len(self.zs.prefix) + 1:] if self.zs.prefix else rec.name

    def payloads(self, model: str, prefix: tuple[str, ...], kind: tuple[str, str, str]) -> None:
        directory, config_name, what = kind
        rec = self.zs.record(directory + config_name.format(model))
        if rec is None:
            legacy = self.zs.record(f"{directory}{model}.pt")  # before per-payload records
            if legacy is not None:
                self.nested(legacy, prefix, what)
                return
            if what == "weight":
                raise CorruptArchiveError(f"no {directory + config_name.format(model)} for "
                                          f"model {model!r}", path=self.src.name)
            return
        config = _config(self.src, rec)
        first_meta: dict[str, tuple[str, bool]] = {}  # record -> (dtype, requires_grad)
        for fqn, payload in config.items():
            try:
                self.payload(fqn, payload, directory, prefix, what, first_meta)
            except _Bad as exc:
                raise self.bad(str(exc), rec, fqn) from None

    def payload(self, fqn: str, payload: dict[str, Any], directory: str,
                prefix: tuple[str, ...], what: str,
                first_meta: dict[str, tuple[str, bool]]) -> None:
        path_name = payload.get("path_name")
        if not isinstance(path_name, str) or not path_name:
            raise _Bad("path_name is not a string")
        path = (*prefix, fqn)
        if what == "constant" and not path_name.startswith("tensor_"):
            rec = self.zs.record(directory + path_name)
            kind = "torchbind object" if path_name.startswith("custom_obj_") else \
                "pickled Python object (not interpreted)"
            self.objects.append((path, {"type": kind, "record": rec.name if rec else path_name,
                                        "nbytes": rec.uncompressed_nbytes if rec else None}))
            return
        rec = self.zs.record(directory + path_name)
        if rec is None:
            raise _Bad(f"no record {directory + path_name}")
        is_param = payload.get("is_param") is True
        slot = "parameter" if is_param else ("buffer" if what == "weight" else "constant")
        if payload.get("use_pickle") is True:
            self.nested(rec, path, slot, single=True)
            return
        dtype, shape, stride, offset, requires_grad = _meta(payload.get("tensor_meta"))
        view_dtype, first_grad = first_meta.setdefault(rec.name, (dtype, requires_grad))
        if view_dtype != dtype:
            self.notes.append(f"{tensor_name(path)} is {dtype} in its meta but torch.export.load "
                              f"views {rec.name} as {view_dtype}, and so does ckptlab")
        itemsize = DTYPE_ITEMSIZE[view_dtype]
        key = self.short(rec)
        grad = requires_grad if is_param else first_grad
        if rec.uncompressed_nbytes == 0 and math.prod(shape):
            self.notes.append(f"{tensor_name(path)}: {rec.name} is empty (saved from a fake "
                              "tensor); torch.export.load gives zeros, ckptlab a meta tensor")
            self.tensors.append(TensorEntry(tensor_name(path), path, view_dtype, shape, stride,
                                            "dense", (), requires_grad=grad,
                                            is_parameter=is_param, extra=(("slot", slot),)))
            return
        if rec.method != 0:
            raise UnsupportedFormatError("weight record is compressed: its bytes are not in the "
                                         "file as the tensor holds them", path=self.src.name,
                                         record=rec.name, offset=rec.header_offset)
        if rec.uncompressed_nbytes % itemsize:
            raise _Bad(f"{rec.name} holds {rec.uncompressed_nbytes} bytes, not a multiple of "
                       f"{view_dtype}'s {itemsize}")
        span = span_nbytes(shape, stride, itemsize)
        if span and offset * itemsize + span > rec.uncompressed_nbytes:
            raise _Bad(f"the view (offset {offset}, shape {shape}, stride {stride}) reaches past "
                       f"the {rec.uncompressed_nbytes} bytes of {rec.name}")
        self.storages.setdefault(key, StorageInfo(key, rec.name, view_dtype,
                                                  rec.uncompressed_nbytes, rec.data_offset,
                                                  _device(payload["tensor_meta"]),
                                                  "UntypedStorage"))
        part = Part("data", self.rel, rec.data_offset + offset * itemsize, span, view_dtype,
                    shape, stride, offset, key)
        self.tensors.append(TensorEntry(tensor_name(path), path, view_dtype, shape, stride,
                                        "dense", (part,), requires_grad=grad,
                                        is_parameter=is_param, extra=(("slot", slot),)))

    def nested(self, rec: Record, path: tuple[Any, ...], slot: str, *,
               single: bool = False) -> None:
        """A torch.save zip inside a record: its tensors, parts pointing into this file."""
        if rec.method != 0:
            raise UnsupportedFormatError("pickled payload record is compressed",
                                         path=self.src.name, record=rec.name,
                                         offset=rec.header_offset)
        raw = self.src.read(rec.data_offset, rec.data_nbytes, what="pickled payload",
                            record=rec.name)
        try:
            with ByteSource(raw) as inner:
                layout = scan_torch_zip(inner)
        except CkptlabError as exc:
            raise CorruptArchiveError(f"pickled payload is not a readable torch.save archive: "
                                      f"{exc}", path=self.src.name, record=rec.name,
                                      offset=rec.data_offset) from None
        storages = {s.key: replace_record(s, data_offset=s.data_offset + rec.data_offset)
                    for s in layout.storages}
        check_parts_inside(layout.logical, storages, self.src.name)
        short = self.short(rec)  # inner storage keys as "<record>:<key>"
        for t in entries_from_logical(layout.logical, storages, self.rel, prefix=path):
            parts = tuple(replace_record(p, storage_key=f"{short}:{p.storage_key}")
                          for p in t.parts)
            self.tensors.append(dataclasses.replace(t, parts=parts,
                                                    extra=(*t.extra, ("slot", slot))))
        for s in storages.values():
            key = f"{short}:{s.key}"
            self.storages[key] = replace_record(s, key=key)
        if not single:
            self.objects.extend(((*path, *p), v) for p, v in layout.objects)


def _models(zs: ZipScan) -> list[str]:
    names = []
    for short in zs.by_short:  # case-folded names; a model's name is read from its record
        if short.startswith("models/") and short.endswith(".json") and short.count("/") == 1:
            names.append(zs.by_short[short].name.rsplit("/", 1)[1][:-len(".json")])
    if not names:
        for short in zs.by_short:
            if short.startswith(WEIGHTS[0]) and short.endswith("_weights_config.json"):
                names.append(zs.by_short[short].name.rsplit("/", 1)[1]
                             [:-len("_weights_config.json")])
    return list(dict.fromkeys(names))  # in file order


def model_pt2(src: ByteSource, rel: str, zs: ZipScan) -> FileModel:
    """The file model of a torch.export archive (see the module docstring)."""
    models = _models(zs)
    if not models:
        raise UnsupportedFormatError("a .pt2 archive without models/*.json or weight configs "
                                     "(an AOTInductor package?): ckptlab reads exported "
                                     "programs' weights", path=src.name)
    pt2 = _Pt2(src, rel, zs)
    for model in models:
        prefix = () if models == ["model"] else (model,)
        pt2.payloads(model, prefix, WEIGHTS)
        pt2.payloads(model, prefix, CONSTANTS)
    check_grad(pt2.tensors, src.name)
    version = zs.small(src, "archive_version")
    infos = tuple(TensorInfo(t.path, p.storage_key, p.dtype, p.shape, p.stride,
                             p.storage_offset, t.requires_grad, t.is_parameter)
                  for t in pt2.tensors for p in t.parts)
    layout = zip_layout(zs, src, "pt2", tuple(pt2.storages.values()), infos,
                        objects=tuple(pt2.objects),
                        metadata={"archive_version": version.strip()} if version else None)
    entry = FileEntry(rel, "pt2", src.nbytes, zs.segments, layout)
    return FileModel(entry, pt2.tensors, pt2.objects, "pt2", tuple(dict.fromkeys(pt2.notes)))


# -- torch.export.save of torch 2.7 and earlier: the legacy layout ----------------------------
LEGACY_PROGRAM = "serialized_exported_program.json"
LEGACY_STATE_DICT = "serialized_state_dict.pt"
LEGACY_CONSTANTS = "serialized_constants.pt"
LEGACY_INPUTS = "serialized_example_inputs.pt"
# fields of the exported program JSON listed as objects (the graph itself is not)
_PROGRAM_FIELDS = ("schema_version", "torch_version", "opset_version", "verifiers")


def is_legacy_pt2(zs: ZipScan) -> bool:
    """Whether a zip's records are those of a ``.pt2`` of torch 2.7 or earlier.

    Parameters
    ----------
    zs
        The zip's records (:func:`~ckptlab.checkpoint._torchscript.scan_zip`).

    Returns
    -------
    bool
        True when it has top-level ``serialized_exported_program.json`` and
        ``serialized_state_dict.pt`` records (names matched exactly, wherever they are in the
        file, as that torch's loader reads them with :mod:`zipfile`).
    """
    names = {r.name for r in zs.records}
    return LEGACY_PROGRAM in names and LEGACY_STATE_DICT in names


def _inner_layout(src: ByteSource, rec: Record) -> ArchiveLayout:
    """The torch.save archive stored as record ``rec``, scanned in place (offsets relative to
    the record's first byte; nothing but its zip structure and pickle is read)."""
    if rec.method != 0:
        raise UnsupportedFormatError(
            "the record holding a torch.save archive is compressed (zip method "
            f"{rec.method}): its tensors' bytes are not in the file as they are stored; "
            "ckptlab reads stored records only (save the program again, or rezip it without "
            "compression)", path=src.name, record=rec.name, offset=rec.header_offset,
            expected="zip method 0 (stored)", actual=f"zip method {rec.method}")
    window = FileWindow(PositionalFile(src, what="nested archive"),  # type: ignore[arg-type]
                        rec.data_offset, rec.data_nbytes,
                        name=f"{src.name}:{rec.name}")
    try:
        with ByteSource(window) as inner:
            return scan_torch_zip(inner)
    except UnsupportedFormatError as exc:
        raise UnsupportedFormatError(f"the torch.save archive inside is not one ckptlab "
                                     f"reads: {exc}", path=src.name, record=rec.name,
                                     offset=rec.data_offset) from None
    except CkptlabError as exc:
        raise CorruptArchiveError(f"record is not a readable torch.save archive: {exc}",
                                  path=src.name, record=rec.name,
                                  offset=rec.data_offset) from None


def _program_objects(src: ByteSource, rec: Record) -> list[tuple[tuple[Any, ...], Any]]:
    """The exported program JSON's version fields, as ``("exported_program", field)``."""
    raw = read_record_data(src, rec)
    try:
        program = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"exported program is not UTF-8 JSON: {str(exc)[:120]}",
                                  path=src.name, record=rec.name,
                                  offset=rec.data_offset) from None
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise CorruptArchiveError("exported program is not a JSON object with a graph_module",
                                  path=src.name, record=rec.name, offset=rec.data_offset,
                                  actual=raw[:40].decode("utf-8", "replace"))
    out: list[tuple[tuple[Any, ...], Any]] = []
    for field in _PROGRAM_FIELDS:
        value = program.get(field)
        if field == "schema_version" and isinstance(value, dict):
            major, minor = value.get("major"), value.get("minor")
            value = f"{major}.{minor}" if type(major) is int and type(minor) is int else None
        if isinstance(value, str):
            value = value[:200]
        elif isinstance(value, dict):
            value = {str(k)[:200]: v for k, v in value.items() if type(v) is int}
        elif isinstance(value, list):
            value = [str(v)[:200] for v in value]
        else:
            continue
        out.append((("exported_program", field), value))
    return out


def model_pt2_legacy(src: ByteSource, rel: str, zs: ZipScan) -> FileModel:
    """The file model of a ``.pt2`` written by ``torch.export.save`` in torch 2.7 and before.

    Such an archive (written by Python's :mod:`zipfile`, no archive name) holds the records
    ``serialized_exported_program.json`` (the program: graph, signature, schema version),
    ``serialized_state_dict.pt``, ``serialized_constants.pt`` and
    ``serialized_example_inputs.pt`` (each the bytes of a whole ``torch.save`` archive of a
    dict, a dict and an ``(args, kwargs)`` tuple, empty for None) and ``version`` (the schema
    version, ``major.minor``), plus ``extra_files/*``.

    Each ``.pt`` record of weights is scanned in place as a torch.save archive (through a
    window onto this file, its pickle interpreted by ckptlab, nothing unpickled): its tensors
    are this checkpoint's, named by their keys (``ep.state_dict`` then ``ep.constants``, as
    torch.export.load gives them), with parts at offsets in this file, and its zip structure
    replaces the record's one data segment in the byte segments. The example inputs are not
    read (as the newer layout's ``data/sample_inputs`` are not): an object says where they
    are. The program's ``schema_version``, ``torch_version``, ``opset_version`` and
    ``verifiers`` are objects under ``exported_program``.

    Parameters
    ----------
    src
        The archive's bytes.
    rel
        The file's path relative to the opened checkpoint (the parts' ``file``).
    zs
        Its records and segments (:func:`~ckptlab.checkpoint._torchscript.scan_zip`).

    Returns
    -------
    FileModel
        The file entry (format ``"pt2"``), the tensors, the objects and notes.

    Raises
    ------
    UnsupportedFormatError
        A compressed state-dict or constants record, or one holding an archive ckptlab does
        not read.
    CorruptArchiveError
        Damaged JSON, a missing record, or a record that is not a readable torch.save archive.
    """
    # top-level names, whatever directory the first record is in (no archive name here)
    by_name = {r.name: r for r in zs.records}
    zs = dataclasses.replace(zs, prefix="", by_short={fold_name(n): r
                                                      for n, r in by_name.items()})
    program = by_name.get(LEGACY_PROGRAM)
    if program is None:  # pragma: no cover - model_zip checked
        raise UnsupportedFormatError(f"no {LEGACY_PROGRAM} record", path=src.name)
    objects = _program_objects(src, program)
    version_rec = by_name.get("version")
    version = None if version_rec is None else read_small_record(src, version_rec)
    if version is None:
        raise CorruptArchiveError("a legacy .pt2 archive without its version record "
                                  "(torch.export.load refuses it)", path=src.name,
                                  expected="a record 'version' (e.g. 8.7)",
                                  actual=", ".join(r.name for r in zs.records)[:200])
    notes = ["written by torch.export.save of torch 2.7 or earlier (serialized_*.pt records, "
             "each a torch.save archive read in place)"]
    tensors: list[TensorEntry] = []
    storages: dict[str, StorageInfo] = {}
    inner_segments: dict[str, tuple[Segment, ...]] = {}  # outer record -> its inner segments
    for short, slot in ((LEGACY_STATE_DICT, "buffer"), (LEGACY_CONSTANTS, "constant")):
        rec = by_name.get(short)
        if rec is None:
            if short == LEGACY_STATE_DICT:  # pragma: no cover - is_legacy_pt2 checked
                raise CorruptArchiveError(f"no {short} record", path=src.name)
            notes.append(f"no {short} record (torch.export.load refuses such an archive)")
            continue
        if rec.data_nbytes == 0 and rec.uncompressed_nbytes == 0:
            continue  # torch wrote None as no bytes: an empty dict
        layout = _inner_layout(src, rec)
        shifted = {s.key: replace_record(s, data_offset=s.data_offset + rec.data_offset,
                                              record=f"{rec.name}:{s.record}")
                   for s in layout.storages}
        check_parts_inside(layout.logical, shifted, src.name)
        for t in entries_from_logical(layout.logical, shifted, rel):
            parts = tuple(replace_record(p, storage_key=f"{rec.name}:{p.storage_key}")
                          for p in t.parts)
            kind = "parameter" if t.is_parameter else slot
            tensors.append(dataclasses.replace(t, parts=parts, extra=(*t.extra, ("slot", kind))))
        for s in shifted.values():
            storages[f"{rec.name}:{s.key}"] = replace_record(s, key=f"{rec.name}:{s.key}")
        # values beside the tensors (an empty dict of constants is no value of its own)
        objects.extend((p, v) for p, v in layout.objects if p or v not in ({}, ()))
        inner_segments[rec.name] = tuple(
            Segment(seg.kind, seg.offset + rec.data_offset, seg.nbytes,
                    f"{rec.name}:{seg.record}" if seg.record else rec.name)
            for seg in layout.segments)
    inputs = by_name.get(LEGACY_INPUTS)
    if inputs is not None:
        objects.append((("example_inputs",), {
            "type": "example inputs: a torch.save archive of (args, kwargs), not read",
            "record": inputs.name, "nbytes": inputs.uncompressed_nbytes}))
    check_grad(tensors, src.name)
    segments: list[Segment] = []
    for seg in zs.segments:
        if seg.kind is SegmentKind.DATA and seg.record in inner_segments:
            segments.extend(inner_segments[seg.record])
        else:
            segments.append(seg)
    zs = dataclasses.replace(zs, segments=tuple(segments))
    infos = tuple(TensorInfo(t.path, p.storage_key, p.dtype, p.shape, p.stride,
                             p.storage_offset, t.requires_grad, t.is_parameter)
                  for t in tensors for p in t.parts)
    layout = zip_layout(zs, src, "pt2", tuple(storages.values()), infos,
                        objects=tuple(objects), metadata={"version": version.strip()})
    entry = FileEntry(rel, "pt2", src.nbytes, zs.segments, layout)
    return FileModel(entry, tensors, objects, "pt2", tuple(notes))
