"""torch's pickles read safely: which storages, which tensors, and what else the file holds.

The opcodes are interpreted by :mod:`ckptlab.format._unpickle` (bounded, never imports or runs
anything). This module gives that interpreter *handlers* for torch's rebuild functions, which
return inert records instead of tensors:

- dense tensors (``_rebuild_tensor``/``_v2``/``_v3``, Parameters, meta tensors, tensors with
  Python attributes or of a Tensor subclass, old ``Tensor.__setstate__`` pickles);
- sparse COO/CSR/CSC/BSR/BSC (``_rebuild_sparse_tensor``): their component tensors are parts;
- quantized (``_rebuild_qtensor``, per-tensor and per-channel): integer data plus scales;
- nested (``_rebuild_nested_tensor`` strided, ``_rebuild_njt`` jagged) and wrapper subclasses
  (``_rebuild_wrapper_subclass``), whose inner tensors are parts.

:func:`scan_pickle` walks the result and names every tensor by its path from the root object,
the way ``torch.load`` would reach it (``dd['k']`` for a ``defaultdict``), and collects the
non-tensor values beside them.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from ckptlab.errors import CorruptArchiveError
from ckptlab.format._bulk import LazyTuple, build, columns, fields
from ckptlab.format._dtypes import DTYPE_ITEMSIZE, STORAGE_DTYPE, canonical_dtype
from ckptlab.format._records import record_type, replace
from ckptlab.format._unpickle import (
    Global,
    OpaqueKey,
    PickleBudgetError,
    PickleDataError,
    Reduced,
    built_name,
    failure_offset,
    interpreter,
)
from ckptlab.format.layout import TensorInfo

__all__ = ["PickleScan", "ScannedTensor", "StorageRef", "path_key_text", "scan_pickle",
           "torch_handlers"]


# A storage named by a persistent id in the pickle: an immutable record the collector does not
# track (:mod:`ckptlab.format._records`; one per storage)
StorageRef = record_type("ckptlab.format._pickle.StorageRef",
                         ("key", "storage_type", "dtype", "location", "numel", "nbytes"))


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlevel = 4


def _short(value: Any) -> str:
    """A bounded repr for messages (the scanned objects can be huge or deeply nested)."""
    try:
        return _repr.repr(value)
    except Exception:  # a repr must never be what fails
        return f"<{type(value).__name__}>"


def _bad(message: str) -> PickleDataError:
    return PickleDataError(message)


# A dense tensor over one storage (or a meta tensor without one): an immutable record the
# collector does not track (one per tensor saved)
_TensorRef = record_type(
    "ckptlab.format._pickle._TensorRef",
    ("storage", "storage_offset", "shape", "stride", "requires_grad", "dtype", "is_parameter",
     "subclass", "attrs", "metadata"),
    (False, None, None, ()))

# what _rebuild_tensor_v2's ``metadata`` may set (torch's set_tensor_metadata): the
# conjugate and negative bits; torch.load's tensor is a view with the bit set
TENSOR_METADATA = ("conj", "neg")


class _PendingTensor:
    """A tensor made by ``copyreg._reconstructor`` and filled in by a later BUILD (old
    ``Tensor.__setstate__`` pickles): mutable until then, with :data:`_TensorRef`'s fields."""

    __slots__ = ("attrs", "dtype", "is_parameter", "pending", "requires_grad", "shape",
                 "storage", "storage_offset", "stride", "subclass")

    def __init__(self, is_parameter: bool) -> None:
        self.storage: StorageRef | None = None
        self.storage_offset = 0
        self.shape: tuple[int, ...] = ()
        self.stride: tuple[int, ...] = ()
        self.requires_grad = False
        self.dtype = "float32"
        self.is_parameter = is_parameter
        self.subclass: str | None = None
        self.attrs: Any = None
        self.pending = True

    def ckptlab_build(self, state: Any) -> None:
        """``torch.Tensor.__setstate__``."""
        if not self.pending:
            raise _bad("BUILD applied to a rebuilt tensor")
        if isinstance(state, tuple) and len(state) == 4:  # legacy (storage, offset, size, stride)
            ref = _dense(state[0], state[1], state[2], state[3], False, None)
        elif isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], _DENSE):
            ref = state[0]  # legacy Variable: (data, ?, ?, requires_grad, hooks)
            self.requires_grad = bool(state[3])
        elif isinstance(state, tuple) and len(state) == 3:
            self.requires_grad = bool(state[0])
            return
        else:
            raise _bad(f"Tensor state of an unknown form: {_short(state)}")
        for name in ("storage", "storage_offset", "shape", "stride", "dtype"):
            setattr(self, name, getattr(ref, name))
        self.pending = False


def _with(ref: Any, **changes: Any) -> Any:
    """``ref`` with ``changes``: a tensor record anew (records are immutable; a handler that
    wraps a tensor gets a fresh one from the pickle), anything else changed in place."""
    if type(ref) is _TensorRef:
        return replace(ref, **changes)
    for name, value in changes.items():
        setattr(ref, name, value)
    return ref


class _CompositeRef:
    """A tensor made of several tensors: sparse, quantized, nested, wrapper subclass."""

    __slots__ = ("dtype", "extra", "kind", "layout", "parts", "requires_grad", "shape",
                 "stride", "subclass")

    def __init__(self, kind: str, dtype: str, shape: tuple[int, ...] | None,
                 parts: list[tuple[str, _TensorRef]], *, layout: str = "strided",
                 stride: tuple[int, ...] | None = None, extra: dict[str, Any] | None = None,
                 requires_grad: bool = False, subclass: str | None = None) -> None:
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.parts = parts
        self.layout = layout
        self.stride = stride
        self.extra = extra or {}
        self.requires_grad = requires_grad
        self.subclass = subclass


_DENSE = (_TensorRef, _PendingTensor)
_TENSOR_REFS = (_TensorRef, _PendingTensor, _CompositeRef)


@dataclass(frozen=True, slots=True)
class ScannedTensor:
    """One tensor as a user knows it, with the storage-backed tensors it is made of.

    ``parts`` pairs a role (``"data"`` for a dense tensor; ``"indices"``/``"values"``,
    ``"crow_indices"``, ``"scales"``, ``"buffer"``, an attribute name, ...) with a
    :class:`TensorInfo` whose ``path`` is this tensor's path plus the role for composites.
    """

    path: tuple[Any, ...]
    kind: str  # dense | sparse | quantized | nested | subclass
    dtype: str
    shape: tuple[int, ...] | None  # None where only the bytes know it (strided nested)
    stride: tuple[int, ...] | None
    requires_grad: bool
    is_parameter: bool
    layout: str  # torch layout name without prefix: strided, sparse_coo, sparse_csr, jagged...
    parts: tuple[tuple[str, TensorInfo], ...]
    subclass: str | None = None  # qualified name of a Tensor subclass
    extra: tuple[tuple[str, Any], ...] = ()  # qscheme, scale, zero_point, axis, ragged_idx...


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        for v in value:  # a loop, not all(...): this runs twice per tensor
            if type(v) is not int or v < 0:
                break
        else:
            if len(value) > 64:
                raise _bad(f"tensor {what} has {len(value)} dimensions")
            return value
    raise _bad(f"tensor {what} is not a tuple of non-negative ints: {_short(value)}")


def _check_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _bad(f"tensor {what} is not a non-negative int: {_short(value)}")
    return value


def _dtype_of(value: Any, what: str) -> str:
    if isinstance(value, Global) and value.module == "torch":
        name = canonical_dtype(value.name)
        if name is not None:
            return name
    raise _bad(f"{what} is not a torch dtype: {_short(value)}")


def _dense(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
           dtype: str | None) -> _TensorRef:
    if not isinstance(storage, StorageRef):
        raise _bad(f"tensor rebuilt from a non-storage {_short(storage)}")
    shape = _int_tuple(size, "shape")
    strides = _int_tuple(stride, "stride")
    if len(shape) != len(strides):
        raise _bad(f"tensor shape {shape} and stride {strides} differ in length")
    if type(offset) is not int or offset < 0:
        _check_int(offset, "storage offset")
    return _TensorRef(storage, offset, shape, strides, requires_grad is True or (
        requires_grad is not False and bool(requires_grad)), dtype or storage.dtype)


def _tensor_metadata(metadata: Any) -> tuple[tuple[str, bool], ...]:
    """``_rebuild_tensor_v2``'s metadata as sorted ``(key, bool)`` pairs; what ckptlab cannot
    apply when reading is refused rather than silently dropped."""
    if not (isinstance(metadata, dict) and all(
            k in TENSOR_METADATA and type(v) is bool for k, v in metadata.items())):
        raise _bad(f"tensor metadata ckptlab does not know: {_short(metadata)} (it knows "
                   f"{', '.join(TENSOR_METADATA)})")
    return tuple(sorted((k, v) for k, v in metadata.items() if v))


def _is_dense(value: Any) -> bool:
    """Whether ``value`` is a dense tensor record (an old pickle's, once BUILD filled it)."""
    return type(value) is _TensorRef or (type(value) is _PendingTensor and not value.pending)


def _layout_name(value: Any) -> str:
    if isinstance(value, str) and value.startswith("torch."):
        return value[len("torch."):]
    if isinstance(value, Global) and value.module == "torch":
        return value.name
    raise _bad(f"not a torch layout: {_short(value)}")


class _TorchHandlers:
    """Handlers for one scan: they share its storage table.

    With ``compiled``, the hot four (:meth:`persistent_load`, :meth:`rebuild_v2`,
    :meth:`rebuild_parameter`, :meth:`ordered_dict`) are :attr:`core`'s
    (:class:`ckptlab.format._interp.TorchCore`): the same results in C, over this object's
    storage table, with these methods as its fallback for anything off their common path.
    """

    def __init__(self, compiled: bool = False) -> None:
        self.storages: dict[str, StorageRef] = {}
        self.storage_order: list[str] = []
        self.storage_types: dict[int, tuple[Global, str, int]] = {}  # id -> (it, dtype, size)
        # what BUILD gave a dict (an OrderedDict's ``_metadata``): {id: (dict, state)}
        self.dict_attrs: dict[int, tuple[dict[Any, Any], dict[str, Any]]] = {}
        self.core = _TorchCore(self, StorageRef, _TensorRef, _STORAGE_DTYPES) \
            if compiled and _TorchCore is not None else None
        # the persistent-id reader to give the interpreter: the core's where there is one
        self.load_pid = self.core.persistent_load if self.core else self.persistent_load

    def table(self) -> dict[tuple[str, str], Any]:
        hot = self.core or self  # (the compiled four, or these methods)
        dense_v2 = hot.rebuild_v2
        parameter = hot.rebuild_parameter
        from_type = self.rebuild_from_type
        table: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): dense_v2,
            ("torch._utils", "_rebuild_tensor"): self.rebuild_v1,
            ("torch._utils", "_rebuild_tensor_v3"): self.rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): parameter,
            ("torch._utils", "_rebuild_from_type_v2"): from_type,
            ("torch._utils", "_rebuild_from_type"): from_type,
            ("torch._tensor", "_rebuild_from_type_v2"): from_type,
            ("torch._tensor", "_rebuild_from_type"): from_type,
            ("torch._utils", "_rebuild_meta_tensor_no_storage"): self.rebuild_meta,
            ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): self.rebuild_device,
            ("torch._utils", "_rebuild_sparse_tensor"): self.rebuild_sparse,
            ("torch._utils", "_rebuild_qtensor"): self.rebuild_qtensor,
            ("torch._utils", "_rebuild_nested_tensor"): self.rebuild_nested,
            ("torch._utils", "_rebuild_wrapper_subclass"): self.rebuild_wrapper_subclass,
            ("torch.nested._internal.nested_tensor", "_rebuild_njt"): self.rebuild_njt,
            ("torch", "Size"): self.size,
            ("torch", "device"): self.device,
            ("torch.serialization", "_get_layout"): self.layout,
            ("collections", "OrderedDict"): hot.ordered_dict,
            ("builtins", "set"): hot.make_set,
            ("__builtin__", "set"): hot.make_set,
            ("builtins", "frozenset"): hot.make_frozenset,
            ("__builtin__", "frozenset"): hot.make_frozenset,
            ("builtins", "complex"): self.complex,
            ("__builtin__", "complex"): self.complex,
            ("_codecs", "encode"): self.encode,
            ("torch", "Tensor"): self.new_tensor("torch"),
            ("torch._tensor", "Tensor"): self.new_tensor("torch._tensor"),
            ("copyreg", "_reconstructor"): self.reconstructor,
            ("copy_reg", "_reconstructor"): self.reconstructor,
        }
        self.dispatch = table
        return table

    # -- storages -----------------------------------------------------------------------
    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _bad(f"unexpected persistent id {_short(pid)}")
        _, storage_type, key, location, numel = pid
        # storage classes seen before, by identity (the interpreter makes one Global per name)
        known = self.storage_types.get(id(storage_type))
        if known is None or known[0] is not storage_type:
            if not (isinstance(storage_type, Global) and storage_type.module in (
                    "torch", "torch.storage") and storage_type.name in STORAGE_DTYPE):
                raise _bad(f"persistent id names a non-storage type {_short(storage_type)}")
            dtype = STORAGE_DTYPE[storage_type.name]
            known = self.storage_types[id(storage_type)] = (storage_type, dtype,
                                                             DTYPE_ITEMSIZE[dtype])
        if not isinstance(key, str) or not isinstance(location, str):
            raise _bad(f"persistent id key/location are not strings: {_short(pid)}")
        if type(numel) is not int or numel < 0:
            _check_int(numel, "storage numel")
        dtype = known[1]
        nbytes = numel * known[2]
        ref = self.storages.get(key)
        if ref is None:
            ref = StorageRef(key, storage_type.name, dtype, location, numel, nbytes)
            self.storages[key] = ref
            self.storage_order.append(key)
        elif ref.nbytes != nbytes:
            # torch may pickle one storage under two classes (a float8 weight and its uint8
            # view); only the byte size has to agree
            raise _bad(f"storage {_short(key)} declared twice with different sizes: "
                       f"{ref.storage_type}[{ref.numel}] and {storage_type.name}[{numel}]")
        return ref

    # -- dense --------------------------------------------------------------------------
    def rebuild_v1(self, storage: Any = None, offset: Any = None, size: Any = None,
                   stride: Any = None, *rest: Any) -> _TensorRef:
        return _dense(storage, offset, size, stride, False, None)

    def rebuild_v2(self, storage: Any = None, offset: Any = None, size: Any = None,
                   stride: Any = None, requires_grad: Any = False, hooks: Any = None,
                   metadata: Any = None, *rest: Any) -> _TensorRef:
        if metadata:  # the conjugate / negative bits (torch.save of .conj(), _neg_view())
            ref = _dense(storage, offset, size, stride, requires_grad, None)
            return replace(ref, metadata=_tensor_metadata(metadata))
        # what _dense checks, inline for the common case (one call per tensor saved)
        if type(storage) is StorageRef and type(size) is tuple and type(stride) is tuple \
                and len(size) == len(stride) <= 64 and type(offset) is int and offset >= 0 \
                and (requires_grad is False or requires_grad is True):
            for v in size:
                if type(v) is not int or v < 0:
                    break
            else:
                for v in stride:
                    if type(v) is not int or v < 0:
                        break
                else:
                    return _TensorRef(storage, offset, size, stride, requires_grad,
                                      storage.dtype)
        return _dense(storage, offset, size, stride, requires_grad, None)

    def rebuild_v3(self, storage: Any = None, offset: Any = None, size: Any = None,
                   stride: Any = None, requires_grad: Any = False, hooks: Any = None,
                   dtype: Any = None, *rest: Any) -> _TensorRef:
        return _dense(storage, offset, size, stride, requires_grad,
                      _dtype_of(dtype, "_rebuild_tensor_v3's dtype"))

    def rebuild_parameter(self, data: Any = None, requires_grad: Any = False, hooks: Any = None,
                          state: Any = None, *rest: Any) -> Any:
        if isinstance(data, _DENSE):
            return _with(data, requires_grad=bool(requires_grad), is_parameter=True,
                         **({} if state is None else {"attrs": state}))
        if isinstance(data, _CompositeRef):
            data.requires_grad = bool(requires_grad)
        return data

    def rebuild_meta(self, dtype: Any = None, size: Any = None, stride: Any = None,
                     requires_grad: Any = False, *rest: Any) -> _TensorRef:
        shape = _int_tuple(size, "shape")
        return _TensorRef(None, 0, shape, _int_tuple(stride, "stride"), bool(requires_grad),
                          _dtype_of(dtype, "meta tensor dtype"))

    def rebuild_device(self, data: Any = None, dtype: Any = None, device: Any = None,
                       requires_grad: Any = False, *rest: Any) -> Any:
        if isinstance(data, _DENSE):
            return _with(data, requires_grad=bool(requires_grad))
        return data

    def rebuild_from_type(self, func: Any = None, new_type: Any = None, args: Any = (),
                          state: Any = None) -> Any:
        handler = self.dispatch.get((func.module, func.name)) if isinstance(func, Global) \
            else None
        if handler is None or not isinstance(args, tuple):
            raise _bad(f"_rebuild_from_type with an uninterpreted function {_short(func)}")
        result = handler(*args)
        if not isinstance(result, _TENSOR_REFS):
            raise _bad(f"_rebuild_from_type of {_short(func)} gave no tensor")
        if isinstance(new_type, Global):
            qualname = new_type.qualname
            if qualname in ("torch.nn.parameter.Parameter", "torch.nn.Parameter") and \
                    isinstance(result, _DENSE):
                result = _with(result, is_parameter=True)
            elif qualname not in ("torch.Tensor", "torch._tensor.Tensor"):
                result = _with(result, subclass=qualname)
        if isinstance(result, _CompositeRef) and result.kind == "subclass":
            result.parts.extend(_state_tensors(state))
        elif isinstance(result, _DENSE) and state not in (None, {}):
            result = _with(result, attrs=state)
        return result

    @staticmethod
    def new_tensor(module: str) -> Callable[..., Any]:
        """``torch.Tensor()``, which a later BUILD fills (``Tensor.__setstate__``: a
        ``__reduce__`` of ``(torch.Tensor, (), (storage, offset, size, stride))``, as torch's
        backward-compatibility tests write); called with arguments, an inert Reduced as
        before."""
        def call(*args: Any) -> Any:
            return Reduced(Global(module, "Tensor"), args) if args else _PendingTensor(False)
        return call

    def reconstructor(self, cls: Any = None, base: Any = None, state: Any = None) -> Any:
        if isinstance(cls, Global) and cls.qualname in (
                "torch.Tensor", "torch._tensor.Tensor", "torch.nn.parameter.Parameter"):
            return _PendingTensor(cls.name == "Parameter")
        if not isinstance(cls, Global):
            raise _bad(f"copyreg._reconstructor of {_short(cls)}")
        return Reduced(cls, ())

    # -- composite ----------------------------------------------------------------------
    def rebuild_sparse(self, layout: Any = None, data: Any = None) -> _CompositeRef:
        name = _layout_name(layout)
        if not isinstance(data, tuple):
            raise _bad("sparse tensor data is not a tuple")
        if name == "sparse_coo":
            if len(data) == 3:
                indices, values, size = data
                coalesced = None
            elif len(data) == 4:
                indices, values, size, coalesced = data
            else:
                raise _bad(f"sparse COO data of {len(data)} items")
            parts = [("indices", indices), ("values", values)]
            extra = {"is_coalesced": coalesced}
        elif name in ("sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"):
            if len(data) != 4:
                raise _bad(f"sparse compressed data of {len(data)} items")
            compressed, plain, values, size = data
            row = name in ("sparse_csr", "sparse_bsr")
            parts = [("crow_indices" if row else "ccol_indices", compressed),
                     ("col_indices" if row else "row_indices", plain), ("values", values)]
            extra = {}
        else:
            raise _bad(f"sparse layout {name!r} is not one torch saves")
        for role, part in parts:
            if not _is_dense(part):
                raise _bad(f"sparse {role} is not a tensor: {_short(part)}")
        values_ref = parts[-1][1]
        return _CompositeRef("sparse", values_ref.dtype, _int_tuple(size, "size"), parts,
                             layout=name, extra=extra)

    def rebuild_qtensor(self, storage: Any = None, offset: Any = None, size: Any = None,
                        stride: Any = None, qparams: Any = None, requires_grad: Any = False,
                        *rest: Any) -> _CompositeRef:
        data = _dense(storage, offset, size, stride, requires_grad, None)
        if not (isinstance(qparams, tuple) and qparams and isinstance(qparams[0], Global)):
            raise _bad(f"quantizer parameters of an unknown form: {_short(qparams)}")
        scheme = qparams[0].name
        parts: list[tuple[str, _TensorRef]] = [("data", data)]
        extra: dict[str, Any] = {"qscheme": scheme}
        if scheme == "per_tensor_affine" and len(qparams) == 3:
            scale, zero_point = qparams[1], qparams[2]
            if type(scale) is not float or type(zero_point) is not int:
                raise _bad("per-tensor scale/zero point are not float/int")
            extra.update(scale=scale, zero_point=zero_point)
        elif scheme in ("per_channel_affine", "per_channel_affine_float_qparams") and \
                len(qparams) == 4:
            scales, zero_points, axis = qparams[1], qparams[2], qparams[3]
            if type(axis) is not int or not 0 <= axis < len(data.shape):
                raise _bad(f"per-channel axis {_short(axis)} out of range")
            for role, value in (("scales", scales), ("zero_points", zero_points)):
                if isinstance(value, _DENSE):
                    parts.append((role, value))
                elif isinstance(value, list) and all(type(v) in (int, float) for v in value):
                    extra[role] = tuple(value)
                else:
                    raise _bad(f"per-channel {role} is not a tensor or a list of numbers")
            extra["axis"] = axis
        else:
            raise _bad(f"quantization scheme {scheme!r} with {len(qparams)} parameters")
        return _CompositeRef("quantized", data.dtype, data.shape, parts, stride=data.stride,
                             extra=extra, requires_grad=bool(requires_grad))

    def rebuild_nested(self, buffer: Any = None, sizes: Any = None, strides: Any = None,
                       offsets: Any = None) -> _CompositeRef:
        parts = [("buffer", buffer), ("nested_sizes", sizes), ("nested_strides", strides),
                 ("storage_offsets", offsets)]
        for role, part in parts:
            if not isinstance(part, _DENSE):
                raise _bad(f"nested tensor {role} is not a tensor: {_short(part)}")
        if sizes.dtype != "int64" or len(sizes.shape) != 2:
            raise _bad("nested tensor sizes are not a 2-D int64 tensor")
        return _CompositeRef("nested", buffer.dtype, None, parts, layout="strided",
                             extra={"ntensors": sizes.shape[0]})

    def rebuild_njt(self, kwargs: Any = None) -> _CompositeRef:
        if not isinstance(kwargs, dict):
            raise _bad("_rebuild_njt without keyword arguments")
        values, offsets = kwargs.get("values"), kwargs.get("offsets")
        if not (isinstance(values, _DENSE) and isinstance(offsets, _DENSE)):
            raise _bad("jagged nested tensor without values/offsets tensors")
        parts = [("values", values), ("offsets", offsets)]
        lengths = kwargs.get("lengths")
        if isinstance(lengths, _DENSE):
            parts.append(("lengths", lengths))
        ragged = kwargs.get("_ragged_idx", 1)
        if type(ragged) is not int or not 1 <= ragged <= len(values.shape):
            raise _bad(f"jagged nested tensor ragged index {_short(ragged)}")
        cache = kwargs.get("_metadata_cache")
        if isinstance(cache, dict):
            for key in ("min_seqlen", "max_seqlen"):
                if isinstance(cache.get(key), _DENSE):
                    parts.append((key, cache[key]))
        if len(offsets.shape) != 1 or offsets.shape[0] < 1:
            raise _bad("jagged nested tensor offsets are not 1-D")
        batch = offsets.shape[0] - 1
        # the ragged dimension has no fixed size: reported as -1, as torch prints 'j1'
        shape = (batch, *values.shape[:ragged - 1], -1, *values.shape[ragged:])
        return _CompositeRef("nested", values.dtype, shape, parts, layout="jagged",
                             extra={"ragged_idx": ragged},
                             subclass="torch.nested._internal.nested_tensor.NestedTensor")

    def rebuild_wrapper_subclass(self, cls: Any = None, dtype: Any = None, size: Any = None,
                                 stride: Any = None, storage_offset: Any = 0,
                                 layout: Any = None, device: Any = None,
                                 requires_grad: Any = False, *rest: Any) -> _CompositeRef:
        if not isinstance(cls, Global):
            raise _bad(f"wrapper subclass of {_short(cls)}")
        return _CompositeRef("subclass", _dtype_of(dtype, "wrapper subclass dtype"),
                             _int_tuple(size, "size"), [], stride=_int_tuple(stride, "stride"),
                             layout=_layout_name(layout) if layout is not None else "strided",
                             requires_grad=bool(requires_grad), subclass=cls.qualname,
                             extra={"storage_offset": storage_offset,
                                    "device": device if isinstance(device, str) else None})

    # -- plain values -------------------------------------------------------------------
    @staticmethod
    def size(value: Any = ()) -> tuple[int, ...]:
        return _int_tuple(value, "size")

    @staticmethod
    def device(value: Any = "cpu", index: Any = None) -> str:
        if not isinstance(value, str) or (index is not None and type(index) is not int):
            raise _bad(f"torch.device({_short(value)})")
        return value if index is None else f"{value}:{index}"

    @staticmethod
    def layout(value: Any = "") -> str:
        if not isinstance(value, str) or not value.startswith("torch."):
            raise _bad(f"_get_layout({_short(value)})")
        return value

    @staticmethod
    def ordered_dict(items: Any = None) -> dict[Any, Any]:
        """``OrderedDict()``, as a dict (the same keys in the same order; an empty dict is not
        tracked by the collector: a module pickled whole holds a dozen per submodule)."""
        if items not in (None, (), []):
            raise _bad("OrderedDict() with arguments")
        return {}

    def build(self, target: Any, state: Any) -> None:
        """BUILD on anything but a :class:`Reduced`: a tensor of an old pickle filled in, a
        dict's attributes (``state_dict()._metadata``) kept beside it in :attr:`dict_attrs`
        as inert data; anything else refused."""
        if type(target) is dict:
            if id(target) in self.dict_attrs:
                raise _bad("BUILD applied twice to an OrderedDict")
            if not (isinstance(state, dict) and all(type(k) is str for k in state)):
                raise _bad(f"OrderedDict state of an unknown form: {_short(state)}")
            self.dict_attrs[id(target)] = (target, state)
        elif type(target) is _PendingTensor:
            target.ckptlab_build(state)
        elif isinstance(target, _TENSOR_REFS):
            raise _bad("BUILD applied to a rebuilt tensor")
        else:
            raise _bad(f"BUILD applied to {built_name(target)}, which ckptlab never builds")

    @staticmethod
    def _set_of(kind: type, items: Any) -> Any:
        if not isinstance(items, (list, tuple)):
            raise _bad(f"{kind.__name__}() of a {type(items).__name__}")
        return kind(i if type(i) in (str, int, float, bool, bytes) else OpaqueKey(i)
                    for i in items)

    def make_set(self, items: Any = ()) -> set[Any]:
        """``set(items)``: plain members as they are, others as :class:`OpaqueKey`."""
        return self._set_of(set, items)  # type: ignore[no-any-return]

    def make_frozenset(self, items: Any = ()) -> frozenset[Any]:
        """``frozenset(items)``, as :meth:`make_set`."""
        return self._set_of(frozenset, items)  # type: ignore[no-any-return]

    @staticmethod
    def complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
        if not all(type(v) in (int, float) for v in (real, imag)):
            raise _bad("complex() of non-numbers")
        return complex(real, imag)

    @staticmethod
    def encode(text: Any = "", encoding: Any = "latin1") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise _bad("_codecs.encode other than str -> latin1")
        try:
            return text.encode("latin1")
        except UnicodeEncodeError:
            raise _bad("_codecs.encode of text outside latin-1") from None


def torch_handlers(impl: str | None = None
                   ) -> tuple[_TorchHandlers, dict[tuple[str, str], Any]]:
    """A fresh handler set (storage table included) for one torch pickle, and its table.

    ``impl`` as :func:`ckptlab.format._unpickle.interpreter` takes it: ``"python"`` (the
    methods of :class:`_TorchHandlers`), ``"c"`` (the hot ones compiled,
    :class:`ckptlab.format._interp.TorchCore`; ImportError where ckptlab was built without
    a C compiler) or None (compiled where built). Give the interpreter
    ``handlers.load_pid`` as its ``persistent_load``.
    """
    if impl not in ("c", "python", None):
        raise ValueError(f"impl is 'python', 'c' or None, not {impl!r}")
    if impl == "c" and _TorchCore is None:
        raise ImportError("ckptlab.format._interp is not built")
    handlers = _TorchHandlers(compiled=impl != "python")
    return handlers, handlers.table()


try:
    from ckptlab.format._interp import TorchCore as _TorchCore
except ImportError:  # built without a C compiler (or an extension older than TorchCore)
    _TorchCore = None
# {storage class name: (dtype, itemsize)}, what TorchCore reads persistent ids with
_STORAGE_DTYPES = {name: (dtype, DTYPE_ITEMSIZE[dtype]) for name, dtype in STORAGE_DTYPE.items()}


def _state_tensors(state: Any) -> list[tuple[str, _TensorRef]]:
    """The inner tensors of a wrapper subclass's state, by attribute name."""
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if not isinstance(state, dict):
        return []
    return [(str(k), v) for k, v in state.items()
            if isinstance(k, str) and isinstance(v, _DENSE)]


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What a scan of a torch pickle found."""

    storages: tuple[StorageRef, ...]  # in first-encounter (pickle) order
    tensors: tuple[TensorInfo, ...]  # storage-backed tensors (composites' parts too), walk order
    protocol: int
    globals: tuple[str, ...]  # every global the pickle named, in order (module.name)
    root: Any  # the scanned object tree: containers, inert records, plain values
    logical: tuple[ScannedTensor, ...] = ()  # every tensor as a user knows it, walk order
    objects: tuple[tuple[tuple[Any, ...], Any], ...] = ()  # (path, value) of non-tensor values


MAX_DEPTH = 256  # object nesting the walk follows; real checkpoints stay under ~20
_CONTAINERS = (dict, list, tuple, set, frozenset, Reduced)


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(obj, dict):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    if isinstance(obj, (set, frozenset)):
        return enumerate(v.value if isinstance(v, OpaqueKey) else v for v in obj)
    if type(obj.state) is dict and not (obj.pairs or obj.args or obj.items):
        return iter(obj.state.items())  # an object built from its __dict__: a module
    return _reduced_children(obj)


# what the walk does with a value of each type: 0 nothing (a plain value), 1 list it (a
# tensor), 2 walk into it when it is not empty (a container); filled in as types are met
_LEAF, _TENSOR, _CONTAINER = 0, 1, 2
_WALK_KIND: dict[type, int] = {}


def _walk_kind(kind: type) -> int:
    found = _TENSOR if issubclass(kind, _TENSOR_REFS) else \
        _CONTAINER if issubclass(kind, _CONTAINERS) else _LEAF
    _WALK_KIND[kind] = found
    return found


def _reduced_children(obj: Reduced) -> Iterator[tuple[Any, Any]]:
    """Mapping items (as torch would index them), attributes, constructor args, list items."""
    yield from obj.pairs
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if isinstance(state, dict):
        yield from state.items()
    elif state is not None:
        yield "state", state
    if not obj.pairs:  # a defaultdict's factory is not part of what users index
        for i, v in enumerate(obj.args):
            yield f"args[{i}]", v
    for i, v in enumerate(obj.items):
        yield i, v


def _path_key(key: Any) -> Any:
    """A path element that prints and serialises safely: plain keys as they are, others as a
    bounded repr (a key can be any object, even a deep tuple)."""
    if isinstance(key, OpaqueKey):
        key = key.value
    kind = type(key)
    if kind is str or kind is bool or kind is float or key is None:
        return key
    if kind is int:
        return key if -(1 << 64) < key < (1 << 64) else _short(key)
    return _short(key)


def path_key_text(key: Any) -> str:
    """A path element as text: str keys as they are, anything else as a bounded repr."""
    key = _path_key(key)
    return key if isinstance(key, str) else str(key)


def _walk(root: Any) -> tuple[list[tuple[tuple[Any, ...], Any]],
                              Sequence[tuple[tuple[Any, ...], Any]]]:
    """Every tensor reachable from root with its path, and the non-tensor values beside them.

    Depth first in container order; each container is entered once (one reachable twice is
    listed under its first path), so the walk is linear in the object graph. The values are
    the children of tensor-holding containers that are not tensors and hold none: a container
    without tensors is one value (``config``, ``betas``), never walked into for the list.
    The values are listed when first looked at (:func:`_values`): a whole ``nn.Module``
    pickled holds a dozen per module (flags, hook dicts), which opening it need not list.
    """
    if isinstance(root, _TENSOR_REFS):
        return [((), root)], []
    if not isinstance(root, _CONTAINERS):
        return [], [((), root)]
    found, holds_tensor = walk_tensors(root)
    if id(root) not in holds_tensor:
        return found, [((), root)]
    return found, LazyTuple(None, lambda: _values(root, holds_tensor))


def _too_deep() -> PickleDataError:
    return _bad(f"objects nested deeper than {MAX_DEPTH} levels")


def _walk_tensors(root: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """:func:`_walk`'s first pass: the tensors with their paths, and the ids of the
    containers that hold one."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    holds_tensor: set[int] = set()
    seen = {id(root)}
    path: list[Any] = []  # keys from the root to the container on top of the stack
    ids = [id(root)]
    marked = 0  # how many of ids (from the root) are known to be in holds_tensor
    stack = [_children(root)]
    kinds = _WALK_KIND
    while stack:
        for key, value in stack[-1]:
            kind = kinds.get(type(value))
            if kind is None:
                kind = _walk_kind(type(value))
            if not kind:  # _LEAF
                continue
            if kind == _TENSOR:
                if not (type(value) is _PendingTensor and value.pending):
                    found.append(((*path, key if type(key) is str else _path_key(key)), value))
                    if marked < len(ids):
                        holds_tensor.update(ids[marked:])
                        marked = len(ids)
                continue
            # (an empty container holds no tensor: a module's many hook dicts)
            if value and id(value) not in seen:
                seen.add(id(value))
                if len(stack) >= MAX_DEPTH:
                    raise _too_deep()
                path.append(_path_key(key))
                ids.append(id(value))
                stack.append(_children(value))
                break
        else:
            stack.pop()
            ids.pop()
            marked = min(marked, len(ids))
            if path:
                path.pop()
    return found, holds_tensor


def _walk_tensors_c(root: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """:func:`_walk_tensors` compiled (:mod:`ckptlab.format._interp`, ``_walk.c``): the
    rules it needs (a type's kind, a rare container's children, a path element, the depth
    error) are this module's, passed in."""
    return _c_walk(root, _WALK_KIND, _walk_kind, _PendingTensor, Reduced,  # type: ignore[no-any-return]
                   _children, _path_key, MAX_DEPTH, _too_deep)


def walk_tensors(root: Any, impl: str | None = None
                 ) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """Every tensor reachable from the container ``root`` with its path, and the ids of the
    containers that hold one: by ``impl`` (``"python"``, ``"c"``, or None: :data:`_IMPL`,
    the compiled walk where it is built)."""
    impl = _IMPL if impl is None else impl
    if impl == "python" or (impl is None and _c_walk is None):
        return _walk_tensors(root)
    if _c_walk is None:
        raise ImportError("ckptlab.format._interp is not built")
    return _walk_tensors_c(root)


try:
    from ckptlab.format._interp import walk_tensors as _c_walk
except ImportError:  # built without a C compiler
    _c_walk = None


def _values(root: Any, holds_tensor: set[int]) -> list[tuple[tuple[Any, ...], Any]]:
    """:func:`_walk`'s second pass: the non-tensor children of the containers that hold
    tensors (ids in ``holds_tensor``, all reachable through each other from ``root``)."""
    objects: list[tuple[tuple[Any, ...], Any]] = []
    entered = {id(root)}
    todo = [((), root)]
    while todo:  # only through containers that hold tensors
        prefix, container = todo.pop()
        children = []
        for key, value in _children(container):
            if isinstance(value, _TENSOR_REFS):
                continue
            vpath = (*prefix, _path_key(key))
            if id(value) in holds_tensor:
                if id(value) not in entered:
                    entered.add(id(value))
                    children.append((vpath, value))
            else:
                objects.append((vpath, value))
        todo.extend(reversed(children))
    return objects


def _info(path: tuple[Any, ...], t: _TensorRef) -> TensorInfo:
    return TensorInfo(path, t.storage.key if t.storage is not None else "", t.dtype, t.shape,
                      t.stride, t.storage_offset, t.requires_grad, t.is_parameter)


def _scanned(path: tuple[Any, ...], ref: Any) -> ScannedTensor:
    if isinstance(ref, _DENSE):
        return ScannedTensor(path, "subclass" if ref.subclass else "dense", ref.dtype, ref.shape,
                             ref.stride, ref.requires_grad, ref.is_parameter, "strided",
                             (("data", _info(path, ref)),), ref.subclass,
                             getattr(ref, "metadata", ()))
    parts = tuple((role, _info((*path, role), p)) for role, p in ref.parts)
    return ScannedTensor(path, ref.kind, ref.dtype, ref.shape, ref.stride, ref.requires_grad,
                         False, ref.layout, parts, ref.subclass, tuple(ref.extra.items()))


_DENSE_NAMES = ("storage", "dtype", "shape", "stride", "storage_offset", "requires_grad",
                "is_parameter", "subclass")


_METADATA = attrgetter("metadata")


def _logical(found: list[tuple[tuple[Any, ...], Any]]
             ) -> tuple[tuple[ScannedTensor, ...], tuple[TensorInfo, ...]]:
    """:func:`_scanned` of every tensor found, and the storage-backed tensors among their parts.

    Dense tensors (most checkpoints hold nothing else) are built all at once, field by field
    (:func:`ckptlab.format._bulk.build`); anything else one by one.
    """
    if not found or set(map(type, map(itemgetter(1), found))) != {_TensorRef} or \
            any(map(_METADATA, map(itemgetter(1), found))):
        logical = tuple(_scanned(p, ref) for p, ref in found)
        return logical, tuple(info for t in logical for _, info in t.parts
                              if info.storage_key or t.kind == "dense")
    count = len(found)
    paths, refs = columns(found, 2)
    (storages, dtypes, shapes, strides, offsets, grads, params,
     subclasses) = fields(refs, _DENSE_NAMES)
    keys = [s.key if s is not None else "" for s in storages]
    cols = DenseColumns(paths, keys, dtypes, shapes, strides, offsets, grads, params,
                        subclasses)
    plain = not any(subclasses)
    kept = count if plain else sum(1 for k, s in zip(keys, subclasses) if k or not s)

    def make_infos() -> list[TensorInfo]:
        return build(TensorInfo, count, paths, keys, dtypes, shapes, strides, offsets, grads,
                     params)

    every_info = LazyTuple(count, make_infos)

    def make_logical() -> list[ScannedTensor]:
        kinds = repeat("dense") if plain else ["subclass" if s else "dense" for s in subclasses]
        return build(ScannedTensor, count, paths, kinds, dtypes, shapes, strides, grads,
                     params, repeat("strided"),
                     [(("data", info),) for info in every_info.value()], subclasses, repeat(()))

    def make_kept() -> tuple[TensorInfo, ...]:
        return tuple(info for info, s in zip(every_info.value(), subclasses)
                     if info.storage_key or not s)

    # made when first looked at (the layout of 100,000 tensors need not hold 200,000 objects
    # nobody asked for); the scanned tensors hold the same TensorInfo objects as the tensors
    logical = DenseLogical(count, make_logical, cols)
    return logical, every_info if plain else LazyTuple(kept, make_kept)  # type: ignore[return-value]


class DenseColumns:
    """The fields of dense tensors found by a scan, one list per field, in walk order (what
    :class:`ScannedTensor` and :class:`TensorInfo` objects are made from)."""

    __slots__ = ("dtypes", "grads", "keys", "offsets", "params", "paths", "shapes", "strides",
                 "subclasses")

    def __init__(self, paths: Sequence[Any], keys: list[str], dtypes: Sequence[str],
                 shapes: Sequence[Any], strides: Sequence[Any], offsets: Sequence[int],
                 grads: Sequence[bool], params: Sequence[bool],
                 subclasses: Sequence[str | None]) -> None:
        self.paths = paths
        self.keys = keys
        self.dtypes = dtypes
        self.shapes = shapes
        self.strides = strides
        self.offsets = offsets
        self.grads = grads
        self.params = params
        self.subclasses = subclasses


class DenseLogical(LazyTuple[ScannedTensor]):
    """``PickleScan.logical`` of dense tensors: the :class:`ScannedTensor` objects made when
    first used, and their fields as columns (:attr:`columns`) before that."""

    __slots__ = ("columns",)

    def __init__(self, count: int, make: Callable[[], Any], columns: DenseColumns) -> None:
        super().__init__(count, make)
        self.columns = columns


PersistentLoad = Callable[[Any], Any]


def scan_pickle(data: bytes, *, path: str = "<bytes>", record: str = "data.pkl",
                data_offset: int = 0,
                persistent_load: Callable[[Any], PersistentLoad] | None = None,
                handlers: dict[tuple[str, str], Any] | None = None) -> PickleScan:
    """Interpret a torch pickle without importing or calling anything it names.

    Parameters
    ----------
    data
        The bytes of ``data.pkl`` (or any torch pickle whose storages are persistent ids).
    path, record, data_offset
        Where the bytes came from, for error messages (offsets are reported in the file).
    persistent_load
        Makes the persistent-id reader from the scan's handler state (its storage table):
        ``persistent_load(state) -> (pid -> object)``. Default: torch.save's
        ``('storage', cls, key, location, numel)`` ids. Legacy files use six fields.
    handlers
        Global handlers ``{(module, name): callable}`` added to (or replacing) torch's, e.g.
        TorchScript's ``restore_type_tag``.

    Returns
    -------
    PickleScan
        Storages in pickle order, tensors with their paths from the root object.

    Raises
    ------
    CorruptArchiveError
        The pickle is malformed, truncated, over budget, or rebuilds tensors from nonsense.
    """
    return _scan(data, path, record, data_offset, persistent_load, handlers)[0]


def scan_pickle_refs(data: bytes, *, path: str, record: str, data_offset: int,
                     persistent_load: Callable[[Any], PersistentLoad] | None = None,
                     handlers: dict[tuple[str, str], Any] | None = None
                     ) -> tuple[PickleScan, tuple[Any, ...]]:
    """:func:`scan_pickle`, and the tensor record behind each ``scan.logical`` entry (the
    objects in ``scan.root``), so a caller that walks the root itself can find the entry of
    each tensor it meets (legacy, TorchScript and pt2 readers)."""
    scan, found = _scan(data, path, record, data_offset, persistent_load, handlers)
    return scan, tuple(ref for _, ref in found)


def _interpret(data: bytes, persistent_load: Callable[[Any], PersistentLoad] | None,
               extra_handlers: dict[tuple[str, str], Any] | None
               ) -> tuple[_TorchHandlers, Any]:
    """The interpreter (:func:`ckptlab.format._unpickle.interpreter`) with new torch handlers
    (:func:`torch_handlers`; and ``extra_handlers``), both of the implementation :data:`_IMPL`
    names."""
    impl = _IMPL
    handlers, table = torch_handlers(impl)
    if extra_handlers:
        table.update(extra_handlers)
    load = handlers.load_pid if persistent_load is None else persistent_load(handlers)
    return handlers, interpreter(impl)(data, handlers=table, persistent_load=load,
                                       build=handlers.build)


# Which implementation scans use, of the interpreter and the torch handlers alike: "python",
# "c" or None (the compiled ones where ckptlab's extension is built). One switch, for tests.
_IMPL: str | None = None


def _scan(data: bytes, path: str, record: str, data_offset: int,
          persistent_load: Callable[[Any], PersistentLoad] | None,
          extra_handlers: dict[tuple[str, str], Any] | None
          ) -> tuple[PickleScan, list[tuple[tuple[Any, ...], Any]]]:
    try:
        handlers, result = _interpret(data, persistent_load, extra_handlers)
        found, values = _walk(result.root)
    except PickleDataError as exc:
        kind = "is over ckptlab's budget" if isinstance(exc, PickleBudgetError) \
            else "cannot be interpreted"
        raise CorruptArchiveError(f"the pickle {kind}: {exc}", path=path, record=record,
                                  offset=data_offset + failure_offset(exc)) from None
    except TypeError as exc:  # a persistent-id reader called with arguments it does not take
        raise CorruptArchiveError(f"the pickle calls a torch function with arguments it does "
                                  f"not take: {str(exc)[:120]}", path=path, record=record,
                                  offset=data_offset) from None
    if result.end != len(data):
        raise CorruptArchiveError("bytes after the pickle's STOP opcode", path=path,
                                  record=record, offset=data_offset + result.end,
                                  expected=f"{len(data)} bytes of pickle",
                                  actual=f"STOP at byte {result.end}")
    logical, tensors = _logical(found)
    storages = tuple(map(handlers.storages.__getitem__, handlers.storage_order))
    if not isinstance(values, LazyTuple):  # (a module's are listed when first looked at)
        values = tuple(values)
    return PickleScan(storages, tensors, result.protocol, tuple(result.globals), result.root,
                      logical, values), found
