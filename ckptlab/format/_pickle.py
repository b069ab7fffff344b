"""A safe scanner for torch.save's ``data.pkl``: it interprets the pickle, never runs it.

The scanner is the pure-Python unpickler from the standard library with ``find_class`` replaced:
every global the pickle names resolves to an inert stand-in built by this module (a recorder of
arguments), to one of a handful of harmless constructors (``OrderedDict``, ``set``,
``frozenset``, ``complex``, latin-1 ``_codecs.encode``), and nothing is ever imported.
Storages come from ``persistent_load`` and tensors from stand-ins of torch's rebuild functions.

Why the pure-Python unpickler and not the C one: on Python 3.11 the C unpickler sizes its memo
array from the index of a ``LONG_BINPUT``/``PUT`` (16 bytes x index) and preallocates
``BINBYTES`` payloads from their declared length, so a corrupt or hostile file can make it
allocate gigabytes. The pure-Python unpickler keeps the memo in a dict and reads payloads from
the data it has, so memory stays proportional to the pickle.
"""

from __future__ import annotations

import collections
import io
import pickle
import reprlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptlab.errors import CorruptArchiveError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE, STORAGE_DTYPE, canonical_dtype
from ckptlab.format.layout import TensorInfo

__all__ = ["PickleScan", "scan_pickle"]



class _Opaque:
    """An object the pickle builds from a global ckptlab does not interpret."""

    __slots__ = ("__weakref__", "args", "items", "state")
    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        self = object.__new__(cls)
        self.args = args
        self.state = None
        self.items: list[Any] = []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def __repr__(self) -> str:
        return f"<opaque {self.global_name}>"


@dataclass(frozen=True, slots=True)
class _StorageType:
    name: str  # "FloatStorage", "UntypedStorage"


@dataclass(frozen=True, slots=True)
class _Dtype:
    name: str  # canonical dtype name


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage named by a persistent id in the pickle."""

    key: str
    storage_type: str
    dtype: str
    location: str
    numel: int
    nbytes: int


class _TensorRef:
    __slots__ = (
        "dtype",
        "is_parameter",
        "requires_grad",
        "shape",
        "storage",
        "storage_offset",
        "stride",
    )

    def __init__(self, storage: StorageRef | None, storage_offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...], requires_grad: bool, dtype: str) -> None:
        self.storage = storage
        self.storage_offset = storage_offset
        self.shape = shape
        self.stride = stride
        self.requires_grad = requires_grad
        self.dtype = dtype
        self.is_parameter = False

    def __setstate__(self, state: Any) -> None:  # torch never BUILDs a rebuilt tensor
        raise _ScanError("BUILD applied to a rebuilt tensor")


class _Call:
    """A callable stand-in for one interpreted global; refuses BUILD and NEWOBJ."""

    __slots__ = ("fn", "name")

    def __init__(self, fn: Any, name: str) -> None:
        self.fn = fn
        self.name = name

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"BUILD applied to the global {self.name}")


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _short(value: Any) -> str:
    """A bounded repr for messages (the scanned objects can be huge or deeply nested)."""
    return _repr.repr(value)


class _ScanError(Exception):
    """Raised inside the scan; turned into CorruptArchiveError with the position."""


def _as_int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, tuple) and all(type(v) is int for v in value):
        return value
    if isinstance(value, _Opaque) and value.args and isinstance(value.args[0], tuple):
        return _as_int_tuple(value.args[0], what)  # torch.Size((...)) under some protocols
    raise _ScanError(f"tensor {what} is not a tuple of ints: {_short(value)}")


def _check_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _ScanError(f"tensor {what} is not a non-negative int: {_short(value)}")
    return value


class _Unpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The interpreter. One instance scans one pickle."""

    def __init__(self, data: bytes) -> None:
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self.storages: dict[str, StorageRef] = {}
        self.storage_order: list[str] = []
        self.globals_seen: list[str] = []
        self._classes: dict[str, type] = {}
        self._stand_ins = {
            ("torch._utils", "_rebuild_tensor_v2"): _Call(self._rebuild_v2, "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_tensor"): _Call(self._rebuild_v2, "_rebuild_tensor"),
            ("torch._utils", "_rebuild_tensor_v3"): _Call(self._rebuild_v3, "_rebuild_tensor_v3"),
            ("torch._utils", "_rebuild_parameter"): _Call(self._rebuild_parameter, "_rebuild_parameter"),
            ("torch._utils", "_rebuild_parameter_with_state"): _Call(
                self._rebuild_parameter, "_rebuild_parameter_with_state"),
            ("torch._utils", "_rebuild_from_type_v2"): _Call(self._rebuild_from_type, "_rebuild_from_type_v2"),
            ("torch._utils", "_rebuild_from_type"): _Call(self._rebuild_from_type, "_rebuild_from_type"),
            # tensors with Python attributes and Tensor subclasses reduce through torch._tensor
            ("torch._tensor", "_rebuild_from_type_v2"): _Call(self._rebuild_from_type,
                                                              "_rebuild_from_type_v2"),
            ("torch._tensor", "_rebuild_from_type"): _Call(self._rebuild_from_type,
                                                           "_rebuild_from_type"),
            ("torch._utils", "_rebuild_meta_tensor_no_storage"): _Call(
                self._rebuild_meta, "_rebuild_meta_tensor_no_storage"),
            ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _Call(
                self._rebuild_device_from_cpu, "_rebuild_device_tensor_from_cpu_tensor"),
            ("torch", "Size"): _Call(self._size, "Size"),
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("builtins", "set"): _Call(self._set(set), "set"),
            ("builtins", "frozenset"): _Call(self._set(frozenset), "frozenset"),
            ("builtins", "complex"): _Call(self._complex, "complex"),
            ("_codecs", "encode"): _Call(self._encode, "encode"),
        }

    # -- pickle hooks -------------------------------------------------------------------
    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        self.globals_seen.append(qualname)
        found = self._stand_ins.get((module, name))
        if found is not None:
            return found
        if module in ("torch", "torch.storage") and name in STORAGE_DTYPE:
            return _StorageType(name)  # v3 tensors pickle torch.storage.UntypedStorage
        if module == "torch":
            dtype = canonical_dtype(name)
            if dtype is not None:
                return _Dtype(dtype)
        cls = self._classes.get(qualname)
        if cls is None:
            cls = type(name if name.isidentifier() else "global", (_Opaque,),
                       {"__slots__": (), "global_name": qualname})
            self._classes[qualname] = cls
        return cls

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _ScanError(f"unexpected persistent id {_short(pid)}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise _ScanError(f"persistent id names a non-storage type {_short(storage_type)}")
        if not isinstance(key, str) or not isinstance(location, str):
            raise _ScanError(f"persistent id key/location are not strings: {_short(pid)}")
        numel = _check_int(numel, "storage numel")
        dtype = STORAGE_DTYPE[storage_type.name]
        ref = self.storages.get(key)
        if ref is None:
            ref = StorageRef(key, storage_type.name, dtype, location, numel,
                             numel * DTYPE_ITEMSIZE[dtype])
            self.storages[key] = ref
            self.storage_order.append(key)
        elif ref.nbytes != numel * DTYPE_ITEMSIZE[dtype]:
            # torch may pickle one storage under two classes (a float8 weight and its uint8
            # view); only the byte size has to agree
            raise _ScanError(
                f"storage {_short(key)} declared twice with different sizes: "
                f"{ref.storage_type}[{ref.numel}] and {storage_type.name}[{numel}]")
        return ref

    def _load_frame(self) -> None:
        # FRAME (protocol 4+) only tells the reader how much to buffer; the framed bytes are
        # the same opcodes, so reading straight through is exact. Only the length is checked.
        (frame_nbytes,) = struct.unpack("<Q", self.read(8))
        remaining = len(self._stream.getbuffer()) - self._stream.tell()
        if frame_nbytes > remaining:
            raise _ScanError(f"FRAME of {frame_nbytes} bytes with {remaining} bytes left")

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.FRAME[0]] = _load_frame

    def load(self) -> Any:  # the stdlib loop, reading the stream directly (see _load_frame)
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        self.read = read = self._stream.read
        self.readline = self._stream.readline
        self.readinto = self._stream.readinto
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stopinst:  # type: ignore[attr-defined]
            return stopinst.value

    # -- stand-ins ----------------------------------------------------------------------
    def _tensor(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                dtype: str | None) -> _TensorRef:
        if not isinstance(storage, StorageRef):
            raise _ScanError(f"tensor rebuilt from a non-storage {_short(storage)}")
        shape = _as_int_tuple(size, "shape")
        strides = _as_int_tuple(stride, "stride")
        if len(shape) != len(strides):
            raise _ScanError(f"tensor shape {shape} and stride {strides} differ in length")
        return _TensorRef(storage, _check_int(offset, "storage offset"), shape, strides,
                          bool(requires_grad), dtype or storage.dtype)

    def _rebuild_v2(self, storage: Any = None, offset: Any = None, size: Any = None,
                    stride: Any = None, requires_grad: Any = False, *rest: Any) -> _TensorRef:
        return self._tensor(storage, offset, size, stride, requires_grad, None)

    def _rebuild_v3(self, storage: Any = None, offset: Any = None, size: Any = None,
                    stride: Any = None, requires_grad: Any = False, hooks: Any = None,
                    dtype: Any = None, *rest: Any) -> _TensorRef:
        if not isinstance(dtype, _Dtype):
            raise _ScanError(f"_rebuild_tensor_v3 without a dtype: {_short(dtype)}")
        return self._tensor(storage, offset, size, stride, requires_grad, dtype.name)

    def _rebuild_parameter(self, data: Any = None, requires_grad: Any = False,
                           *rest: Any) -> Any:
        if isinstance(data, _TensorRef):
            data.requires_grad = bool(requires_grad)
            data.is_parameter = True
        return data

    def _rebuild_from_type(self, func: Any = None, new_type: Any = None, args: Any = (),
                           state: Any = None) -> Any:
        if isinstance(func, _Call) and isinstance(args, tuple):
            return func(*args)
        raise _ScanError(f"_rebuild_from_type with an uninterpreted function {_short(func)}")

    def _rebuild_meta(self, dtype: Any = None, size: Any = None, stride: Any = None,
                      requires_grad: Any = False, *rest: Any) -> _TensorRef:
        if not isinstance(dtype, _Dtype):
            raise _ScanError(f"meta tensor without a dtype: {_short(dtype)}")
        shape = _as_int_tuple(size, "shape")
        return _TensorRef(None, 0, shape, _as_int_tuple(stride, "stride"), bool(requires_grad),
                          dtype.name)

    def _rebuild_device_from_cpu(self, data: Any = None, *rest: Any) -> Any:
        return data

    @staticmethod
    def _size(value: Any = ()) -> tuple[int, ...]:
        return _as_int_tuple(tuple(value) if isinstance(value, list) else value, "size")

    @staticmethod
    def _set(kind: type) -> Any:
        def build(items: Any = ()) -> Any:
            if not isinstance(items, (list, tuple)):
                raise _ScanError(f"{kind.__name__}() of a {type(items).__name__}")
            return kind(items)
        return build

    @staticmethod
    def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
        if not all(type(v) in (int, float) for v in (real, imag)):
            raise _ScanError("complex() of non-numbers")
        return complex(real, imag)

    @staticmethod
    def _encode(text: Any = "", encoding: Any = "latin1") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise _ScanError("_codecs.encode other than str -> latin1")
        return text.encode("latin1")


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What a scan of data.pkl found."""

    storages: tuple[StorageRef, ...]  # in first-encounter (pickle) order
    tensors: tuple[TensorInfo, ...]  # in tree-walk order from the root
    protocol: int
    globals: tuple[str, ...]  # every global the pickle named, in order (module.name)
    root: Any  # the scanned object tree: containers, stand-ins, plain values


MAX_DEPTH = 256  # object nesting the scanner follows; real checkpoints stay under ~20
_CONTAINERS = (dict, list, tuple, set, frozenset, _Opaque)


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(obj, dict):
        return iter(obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return enumerate(obj)
    return _opaque_children(obj)


def _opaque_children(obj: _Opaque) -> Iterator[tuple[Any, Any]]:
    """Constructor args, then state (attribute names when it is a dict), then appended items."""
    for i, v in enumerate(obj.args):
        yield f"args[{i}]", v
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if isinstance(state, dict):
        yield from state.items()
    elif state is not None:
        yield "state", state
    for i, v in enumerate(obj.items):
        yield f"items[{i}]", v


def _walk(root: Any) -> list[tuple[tuple[Any, ...], _TensorRef]]:
    """Every tensor reachable from root with its path, depth first in container order.

    Each container is entered once (a container reachable twice is listed under its first
    path), so the walk is linear in the size of the object graph; paths are only built for
    tensors.
    """
    if isinstance(root, _TensorRef):
        return [((), root)]
    if not isinstance(root, _CONTAINERS):
        return []
    found: list[tuple[tuple[Any, ...], _TensorRef]] = []
    seen = {id(root)}
    path: list[Any] = []  # keys from the root to the container on top of the stack
    stack = [_children(root)]
    while stack:
        for key, value in stack[-1]:
            if isinstance(value, _TensorRef):
                found.append(((*path, key), value))
            elif isinstance(value, _CONTAINERS) and id(value) not in seen:
                seen.add(id(value))
                if len(stack) >= MAX_DEPTH:
                    raise _ScanError(f"objects nested deeper than {MAX_DEPTH} levels")
                path.append(key)
                stack.append(_children(value))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return found


def scan_pickle(data: bytes, *, path: str = "<bytes>", record: str = "data.pkl",
                data_offset: int = 0) -> PickleScan:
    """Interpret a torch.save pickle without importing or calling anything it names.

    Parameters
    ----------
    data
        The bytes of ``data.pkl``.
    path, record, data_offset
        Where the bytes came from, for error messages (offsets are reported in the file).

    Returns
    -------
    PickleScan
        Storages in pickle order, tensors with their paths from the root object.

    Raises
    ------
    CorruptArchiveError
        The pickle is malformed, truncated, or rebuilds tensors from nonsense.
    """
    unpickler = _Unpickler(data)
    try:
        root = unpickler.load()
        end = unpickler._stream.tell()
        tensors = [TensorInfo(tpath, t.storage.key if t.storage is not None else "", t.dtype,
                              t.shape, t.stride, t.storage_offset, t.requires_grad,
                              t.is_parameter) for tpath, t in _walk(root)]
    except Exception as exc:  # nothing from the file runs, so any failure means bad data
        where = unpickler._stream.tell()
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, EOFError):
            reason = "pickle ends without a STOP opcode"
        raise CorruptArchiveError(f"cannot interpret the pickle: {reason}", path=path,
                                  record=record, offset=data_offset + where) from None
    if end != len(data):
        raise CorruptArchiveError("bytes after the pickle's STOP opcode", path=path,
                                  record=record, offset=data_offset + end,
                                  expected=f"{len(data)} bytes of pickle",
                                  actual=f"STOP at byte {end}")
    storages = tuple(unpickler.storages[k] for k in unpickler.storage_order)
    return PickleScan(storages, tuple(tensors), unpickler.proto,
                      tuple(unpickler.globals_seen), root)
