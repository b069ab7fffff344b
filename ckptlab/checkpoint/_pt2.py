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
from ckptlab.format._source import ByteSource
from ckptlab.format.archive import read_record_data, scan_torch_zip
from ckptlab.format.layout import Record, StorageInfo, TensorInfo

__all__ = ["SCALAR_TYPES", "model_pt2"]

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
        storages = {s.key: dataclasses.replace(s, data_offset=s.data_offset + rec.data_offset)
                    for s in layout.storages}
        check_parts_inside(layout.logical, storages, self.src.name)
        short = self.short(rec)  # inner storage keys as "<record>:<key>"
        for t in entries_from_logical(layout.logical, storages, self.rel, prefix=path):
            parts = tuple(dataclasses.replace(p, storage_key=f"{short}:{p.storage_key}")
                          for p in t.parts)
            self.tensors.append(dataclasses.replace(t, parts=parts,
                                                    extra=(*t.extra, ("slot", slot))))
        for s in storages.values():
            key = f"{short}:{s.key}"
            self.storages[key] = dataclasses.replace(s, key=key)
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
