"""torch's rebuild functions as handlers for ckptlab's pickle interpreter: records, not tensors.

The opcodes are interpreted by :mod:`ckptlab.format._unpickle` (bounded, never imports or runs
anything). This module gives that interpreter *handlers* for torch's rebuild functions, which
return inert records (:mod:`ckptlab.format._tensor_refs`) instead of tensors:

- dense tensors (``_rebuild_tensor``/``_v2``/``_v3``, Parameters, meta tensors, tensors with
  Python attributes or of a Tensor subclass, old ``Tensor.__setstate__`` pickles);
- sparse COO/CSR/CSC/BSR/BSC (``_rebuild_sparse_tensor``): their component tensors are parts;
- quantized (``_rebuild_qtensor``, per-tensor and per-channel): integer data plus scales;
- nested (``_rebuild_nested_tensor`` strided, ``_rebuild_njt`` jagged) and wrapper subclasses
  (``_rebuild_wrapper_subclass``), whose inner tensors are parts.

Beside them: the persistent-id reader (the scan's storage table), handlers for the plain
values torch pickles call (``torch.Size``, ``torch.device``, ``OrderedDict``, ``set``,
``complex``, ``_codecs.encode``), and the BUILD hook (an ``OrderedDict``'s ``_metadata``, an
old pickle's tensor). :func:`torch_handlers` makes one set per scan, in Python
(:class:`_TorchHandlers`) or with the hot ones compiled (:mod:`ckptlab.format._interp`'s
``TorchCore``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptlab.format._dtypes import DTYPE_ITEMSIZE, STORAGE_DTYPE, canonical_dtype
from ckptlab.format._records import replace
from ckptlab.format._tensor_refs import (
    _DENSE,
    _TENSOR_REFS,
    TENSOR_METADATA,
    StorageRef,
    _bad,
    _check_int,
    _CompositeRef,
    _dense,
    _int_tuple,
    _PendingTensor,
    _short,
    _TensorRef,
    _with,
)
from ckptlab.format._unpickle import Global, OpaqueKey, Reduced, built_name

__all__ = ["torch_handlers"]


def _dtype_of(value: Any, what: str) -> str:
    if isinstance(value, Global) and value.module == "torch":
        name = canonical_dtype(value.name)
        if name is not None:
            return name
    raise _bad(f"{what} is not a torch dtype: {_short(value)}")


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
