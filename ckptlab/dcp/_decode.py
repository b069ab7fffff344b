"""DCP's ``.metadata`` pickle, decoded by ckptlab's bounded interpreter and type-checked.

The pickle is interpreted by :mod:`ckptlab.format._unpickle` into inert records (nothing is
imported, called or ``setattr``'d). This module then turns the records of an allow-list of DCP
classes into the real torch objects, field by field: every field must have the type DCP
declares (``offset`` a non-negative int below 2**63, ``fqn`` a str, ``chunks`` a list of
chunks...), and the real constructors are only ever called with values that passed. Shared
records are converted once (a pickle can reference one record many times; converting it as a
tree would be exponential).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ckptlab._torch_compat import memory_format_encoding, storage_info_class
from ckptlab.format import _pickle
from ckptlab.format._unpickle import (
    PATH_CLASSES,
    Global,
    OpaqueKey,
    PickleBudgetError,
    PickleDataError,
    Reduced,
    failure_offset,
    interpreter,
    path_value,
)

__all__ = ["MetadataDecodeError", "decode_metadata", "foreign_global", "handlers", "record_state"]

_DCP = "torch.distributed.checkpoint"
_MD = f"{_DCP}.metadata"
_MAX_INDEX = (1 << 63) - 1
_MAX_PLAIN_DEPTH = 64

DTYPES = frozenset({
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "half", "float", "double",
    "long", "int", "short", "cfloat", "cdouble", "chalf",
})
LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
                     "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


class MetadataDecodeError(Exception):
    """``.metadata`` is not a DCP Metadata ckptlab accepts; ``.offset`` where known."""

    def __init__(self, message: str, offset: int | None = None, foreign: bool = False) -> None:
        super().__init__(message)
        self.offset = offset
        self.foreign = foreign  # names a class outside the allow-list


def _name(value: Any) -> str:
    if isinstance(value, Reduced):
        return value.func.qualname
    if isinstance(value, Global):
        return value.qualname
    return type(value).__name__


def _path(cls: str, *parts: Any) -> str:
    return path_value(cls, parts)


class Size(tuple):  # type: ignore[type-arg]
    """``torch.Size(...)`` as the pickle calls it: a validated tuple of ints."""

    __slots__ = ()

    @property
    def value(self) -> tuple[int, ...]:
        return tuple(self)


class Layout:
    """``torch.serialization._get_layout(name)``: one of :data:`LAYOUTS`, by name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_Size = Size


def handlers() -> dict[tuple[str, str], Any]:
    """The functions a DCP ``.metadata`` pickle may call, as ckptlab code (every other
    global builds an inert record): ``torch.Size``, ``_get_layout``, ``OrderedDict()`` and
    the ``pathlib`` path classes. Both readers of ``.metadata`` interpret it with these (the
    converter here and :mod:`ckptlab.dcp.columns`)."""

    ints = {int}

    def size(value: Any = ()) -> _Size:
        if type(value) not in (tuple, list) or len(value) > 64 or (value and not (
                set(map(type, value)) == ints and 0 <= min(value) and
                max(value) <= _MAX_INDEX)):
            raise PickleDataError("torch.Size of something other than non-negative ints")
        return _Size(value)

    def layout(value: Any = "") -> Layout:
        if value not in LAYOUTS:
            raise PickleDataError(f"_get_layout of {str(value)[:60]!r}")
        return Layout(value)

    def ordered_dict(items: Any = None) -> dict[Any, Any]:
        if items not in (None, (), []):
            raise PickleDataError("OrderedDict() with arguments")
        return {}

    table: dict[tuple[str, str], Any] = {("torch", "Size"): size,
                                         ("torch.serialization", "_get_layout"): layout,
                                         ("collections", "OrderedDict"): ordered_dict}
    for cls in PATH_CLASSES:
        table[("pathlib", cls)] = functools.partial(_path, cls)
    return table


def record_state(value: Any) -> Any:
    """A dataclass record's state as pickle gives it: a dict of fields, None (no fields),
    or a slotted dataclass's ``(None, slots)``; anything else as it is (for the caller to
    refuse)."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] is None:
        value = value[1]
    return {} if value is None else value


def foreign_global(globals_: list[str]) -> str | None:
    """The first global a ``.metadata`` pickle names that is not one of DCP's metadata
    classes, torch's (``torch.*``), a ``pathlib`` path or ``OrderedDict``; None if none."""
    for qualname in globals_:
        module = qualname.rsplit(".", 1)[0]
        if not (module.startswith(_DCP) or qualname.startswith(("torch.", "pathlib.")) or
                qualname == "collections.OrderedDict"):
            return qualname
    return None


class _Converter:
    """Inert records -> real DCP objects, checked field by field."""

    def __init__(self) -> None:
        import torch
        import torch.distributed.checkpoint.filesystem as fs
        import torch.distributed.checkpoint.metadata as md

        self.torch, self.md, self.fs = torch, md, fs
        self.done: dict[int, Any] = {}
        self.keep: list[Any] = []  # keeps converted sources alive so ids stay unique
        self.extras: dict[int, dict[str, Any]] = {}  # record id -> fields beyond its class's

    def fail(self, message: str, foreign: bool = False) -> MetadataDecodeError:
        return MetadataDecodeError(message, foreign=foreign)

    # -- leaves -------------------------------------------------------------------------
    def int_(self, value: Any, what: str, *, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if type(value) is not int or not 0 <= value <= _MAX_INDEX:
            raise self.fail(f"{what} must be a non-negative int below 2**63, got "
                            f"{_name(value)}")
        return value

    def str_(self, value: Any, what: str, *, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if type(value) is not str:
            raise self.fail(f"{what} must be a str, got {_name(value)}")
        return value

    def bool_(self, value: Any, what: str) -> bool:
        if type(value) is not bool:
            raise self.fail(f"{what} must be a bool, got {_name(value)}")
        return value

    def size(self, value: Any, what: str, *, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, _Size):
            return self.torch.Size(value.value)
        raise self.fail(f"{what} must be a torch.Size, got {_name(value)}")

    def dtype(self, value: Any, what: str) -> Any:
        if isinstance(value, Global) and value.module == "torch" and value.name in DTYPES:
            return getattr(self.torch, value.name)
        raise self.fail(f"{what} must be a torch dtype, got {_name(value)}")

    # -- records ------------------------------------------------------------------------
    def fields(self, value: Any, cls: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        """The state of a record of class ``cls`` as a dict of allowed field names."""
        if not isinstance(value, Reduced) or value.func.qualname != cls:
            raise self.fail(f"expected a {cls}, got {_name(value)}",
                            foreign=isinstance(value, Reduced))
        if value.args or value.kwargs or value.items or value.pairs:
            raise self.fail(f"{cls} built with arguments or items")
        state = record_state(value.state)
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            raise self.fail(f"{cls} state is not a dict of field names")
        extra = {k: v for k, v in state.items() if k not in allowed}
        if extra:  # attributes a writer added (Megatron-Core: Metadata.all_local_plans)
            self.extras[id(value)] = extra
        return state

    def attach(self, obj: Any, value: Any) -> Any:
        """``obj`` (converted from the record ``value``) with the attributes its writer added
        beyond the class's fields, as pickle would set them, but each an inert rendering
        (:func:`ckptlab.checkpoint.model.plain_value`: nothing built, nothing run)."""
        extra = self.extras.pop(id(value), None)
        if extra:
            from ckptlab.format._plain import plain_value

            if not hasattr(obj, "__dict__"):
                raise self.fail(f"{type(obj).__name__} has unknown fields "
                                f"{sorted(extra)[:5]} and no room for them")
            vars(obj).update({k: plain_value(v) for k, v in extra.items()})
        return obj

    def memo(self, value: Any, build: Any) -> Any:
        hit = self.done.get(id(value))
        if hit is None:
            hit = self.attach(build(value), value)
            self.done[id(value)] = hit
            self.keep.append(value)
        return hit

    def metadata(self, value: Any) -> Any:
        names = tuple(f.name for f in dataclasses.fields(self.md.Metadata))
        state = self.fields(value, f"{_MD}.Metadata", names)
        sdm = state.get("state_dict_metadata")
        if not isinstance(sdm, dict):
            raise self.fail("Metadata.state_dict_metadata must be a dict")
        entries = {}
        for key, item in sdm.items():
            entries[self.str_(key, "a state_dict_metadata key")] = self.memo(item, self.storage)
        storage_data = state.get("storage_data")
        if storage_data is not None:
            if not isinstance(storage_data, dict):
                raise self.fail("Metadata.storage_data must be a dict")
            converted = {}
            for key, info in storage_data.items():
                if isinstance(key, OpaqueKey):  # records are dict keys by identity
                    key = key.value
                converted[self.memo(key, self.index)] = self.memo(info, self.storage_info)
            storage_data = converted
        meta = state.get("storage_meta")
        kwargs = {"state_dict_metadata": entries, "planner_data": self.plain(
                      state.get("planner_data"), "Metadata.planner_data"),
                  "storage_data": storage_data,
                  "storage_meta": None if meta is None else self.attach(
                      self.storage_meta(meta), meta)}
        if "version" in names:
            kwargs["version"] = self.str_(state.get("version"), "Metadata.version",
                                          optional=True)
        return self.attach(self.md.Metadata(**kwargs), value)

    def storage(self, value: Any) -> Any:
        qualname = _name(value)
        if qualname == f"{_MD}.BytesStorageMetadata":
            self.fields(value, qualname, ())
            return self.md.BytesStorageMetadata()
        state = self.fields(value, f"{_MD}.TensorStorageMetadata",
                            ("properties", "size", "chunks"))
        chunks = state.get("chunks")
        if not isinstance(chunks, list):
            raise self.fail("TensorStorageMetadata.chunks must be a list")
        return self.md.TensorStorageMetadata(
            properties=self.memo(state.get("properties"), self.properties),
            size=self.size(state.get("size"), "TensorStorageMetadata.size"),
            chunks=[self.memo(c, self.chunk) for c in chunks])

    def chunk(self, value: Any) -> Any:
        state = self.fields(value, f"{_MD}.ChunkStorageMetadata", ("offsets", "sizes"))
        offsets = self.size(state.get("offsets"), "ChunkStorageMetadata.offsets")
        sizes = self.size(state.get("sizes"), "ChunkStorageMetadata.sizes")
        if len(offsets) != len(sizes):
            raise self.fail("a chunk's offsets and sizes differ in length")
        return self.md.ChunkStorageMetadata(offsets=offsets, sizes=sizes)

    def properties(self, value: Any) -> Any:
        cls = f"{_MD}.TensorProperties"
        if not isinstance(value, Reduced) or value.func.qualname != cls or value.args or \
                value.items or value.pairs:
            raise self.fail(f"expected a {cls}, got {_name(value)}")
        state = value.state
        if not (isinstance(state, tuple) and len(state) == 5):
            raise self.fail("TensorProperties state is not a 5-tuple")
        dtype, layout, requires_grad, fmt, pin = state
        if not (isinstance(fmt, Reduced) and fmt.func.qualname == f"{_MD}._MEM_FORMAT_ENCODING"
                and len(fmt.args) == 1 and type(fmt.args[0]) is int):
            raise self.fail("TensorProperties.memory_format is not a _MEM_FORMAT_ENCODING")
        try:
            encoding = memory_format_encoding()(fmt.args[0])
        except ValueError:
            raise self.fail(f"unknown memory format code {fmt.args[0]}") from None
        if not isinstance(layout, Layout):
            raise self.fail(f"TensorProperties.layout must be a layout, got {_name(layout)}")
        props = object.__new__(self.md.TensorProperties)
        props.__setstate__((self.dtype(dtype, "TensorProperties.dtype"),
                            getattr(self.torch, layout.name.removeprefix("torch.")),
                            self.bool_(requires_grad, "TensorProperties.requires_grad"),
                            encoding, self.bool_(pin, "TensorProperties.pin_memory")))
        return props

    def index(self, value: Any) -> Any:
        state = self.fields(value, f"{_MD}.MetadataIndex", ("fqn", "offset", "index"))
        return self.md.MetadataIndex(
            fqn=self.str_(state.get("fqn"), "MetadataIndex.fqn"),
            offset=self.size(state.get("offset"), "MetadataIndex.offset", optional=True),
            index=self.int_(state.get("index"), "MetadataIndex.index", optional=True))

    def storage_info(self, value: Any) -> Any:
        names = tuple(f.name for f in dataclasses.fields(storage_info_class()))
        state = self.fields(value, f"{_DCP}.filesystem._StorageInfo", names)
        kwargs: dict[str, Any] = {
            "relative_path": self.str_(state.get("relative_path"), "_StorageInfo.relative_path"),
            "offset": self.int_(state.get("offset"), "_StorageInfo.offset"),
            "length": self.int_(state.get("length"), "_StorageInfo.length")}
        descriptors = state.get("transform_descriptors")
        if descriptors is not None:
            if not (isinstance(descriptors, (list, tuple)) and
                    all(type(d) is str for d in descriptors)):
                raise self.fail("_StorageInfo.transform_descriptors must be strings")
            kwargs["transform_descriptors"] = list(descriptors)
        return storage_info_class()(**kwargs)

    def storage_meta(self, value: Any) -> Any:
        state = self.fields(value, f"{_MD}.StorageMeta",
                            ("checkpoint_id", "save_id", "load_id", "modules"))
        modules = state.get("modules") or []
        if not (isinstance(modules, list) and all(type(m) is str for m in modules)):
            raise self.fail("StorageMeta.modules must be a list of str")
        return self.md.StorageMeta(
            checkpoint_id=self.str_(state.get("checkpoint_id"), "StorageMeta.checkpoint_id",
                                    optional=True),
            save_id=self.str_(state.get("save_id"), "StorageMeta.save_id", optional=True),
            load_id=self.str_(state.get("load_id"), "StorageMeta.load_id", optional=True),
            modules=list(modules))

    def plain(self, value: Any, what: str, depth: int = 0) -> Any:
        """Plain data (planner_data): str/int/float/bool/None/bytes in lists, tuples, dicts.

        Depth is bounded (so the recursion is) and shared values are converted once.
        """
        kind = type(value)
        if kind in (str, int, float, bool, bytes) or value is None:
            return value
        if isinstance(value, _Size):
            return self.torch.Size(value.value)
        if depth >= _MAX_PLAIN_DEPTH:
            raise self.fail(f"{what} nested deeper than {_MAX_PLAIN_DEPTH} levels")
        if kind in (list, tuple):
            return self.memo(value, lambda v: kind(self.plain(x, what, depth + 1) for x in v))
        if kind is dict:
            for k in value:
                if type(k) not in (str, int, bool, float, bytes, tuple) or (
                        type(k) is tuple and not all(type(e) in (str, int) for e in k)):
                    raise self.fail(f"{what} has a key of type {_name(k)}")
            return self.memo(value, lambda v: {k: self.plain(x, what, depth + 1)
                                               for k, x in v.items()})
        raise self.fail(f"{what} holds a {_name(value)}", foreign=isinstance(value, Reduced))


def decode_metadata(data: bytes) -> Any:
    """``.metadata`` bytes -> ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises
    ------
    MetadataDecodeError
        With ``.offset`` (in the pickle) for interpretation failures and ``.foreign`` set when
        the pickle names a class outside DCP's metadata classes.
    """
    try:
        result = interpreter(_pickle._IMPL)(data, handlers=handlers())
    except PickleDataError as exc:
        kind = "over ckptlab's budget" if isinstance(exc, PickleBudgetError) else "malformed"
        raise MetadataDecodeError(f"not a readable pickle ({kind}): {exc}",
                                  failure_offset(exc)) from None
    if result.end != len(data):
        raise MetadataDecodeError("bytes after the pickle's STOP opcode", result.end)
    qualname = foreign_global(result.globals)
    if qualname is not None:
        raise MetadataDecodeError(
            f"names {qualname}, which is not a DCP metadata class; refusing it (loading it "
            "with pickle would run it)", foreign=True)
    return _Converter().metadata(result.root)
