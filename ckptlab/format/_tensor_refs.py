"""What torch's rebuild functions make in a scan: inert tensor records, and their checks.

The handlers of :mod:`ckptlab.format._torch_handlers` make one of these, never a tensor, for
each call of a torch rebuild function in a pickle; the walk (:mod:`ckptlab.format._pickle_walk`)
finds them in the object tree, and the scan (:mod:`ckptlab.format._pickle`) turns them into
:class:`~ckptlab.format._pickle.ScannedTensor` and :class:`~ckptlab.format.layout.TensorInfo`:

- :data:`StorageRef`, a storage a persistent id names;
- :data:`_TensorRef`, a dense tensor over one storage (or a meta tensor without one);
- :class:`_PendingTensor`, a tensor of an old ``Tensor.__setstate__`` pickle, which a later
  BUILD fills in;
- :class:`_CompositeRef`, a tensor made of several: sparse, quantized, nested, wrapper subclass.

StorageRef and _TensorRef are immutable records the cyclic collector does not track
(:mod:`ckptlab.format._records`; one per storage, one per tensor saved). :func:`_dense` checks
a dense tensor's arguments as the pickle gives them: a bad one is a
:class:`~ckptlab.errors.PickleDataError` that shows it by a bounded repr (:func:`_short`).
"""

from __future__ import annotations

import reprlib
from typing import Any

from ckptlab.errors import PickleDataError
from ckptlab.format._records import record_type, replace

__all__ = ["TENSOR_METADATA", "StorageRef"]


# A storage named by a persistent id in the pickle: an immutable record the collector does not
# track (:mod:`ckptlab.format._records`; one per storage)
StorageRef = record_type("ckptlab.format._tensor_refs.StorageRef",
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
    "ckptlab.format._tensor_refs._TensorRef",
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
