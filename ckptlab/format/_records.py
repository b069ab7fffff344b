"""Immutable records the cyclic garbage collector does not track.

:func:`record_type` makes a class of read-only fields, built by position or keyword (the last
``len(defaults)`` optional), ``==``/hash/repr those of the tuple of its fields (equal only to
the same class), pickled and copied as the class called with its fields. Its instances may
hold only values that cannot lead back to them (str, int, float, bool, None, tuples of those,
other records), so they can never be part of a reference cycle.

Where ckptlab's extension is built (:mod:`ckptlab.format._interp`), the class is a C heap type
made with ``PyType_FromSpec`` *without* ``Py_TPFLAGS_HAVE_GC``: a 100,000-tensor checkpoint's
records are never walked by the collector, and each is made by one C call. Elsewhere it is the
Python class below, of the same interface.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record_type", "replace"]


def _python_record_type(qualname: str, fields: tuple[str, ...],
                        defaults: tuple[Any, ...] = (),
                        namespace: dict[str, Any] | None = None) -> type:
    module, _, name = qualname.rpartition(".")
    required = len(fields) - len(defaults)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(fields):
            raise TypeError(f"{name}() takes {len(fields)} arguments, {len(args)} given")
        values = dict(zip(fields, args))
        for key, value in kwargs.items():
            if key not in fields or key in values:
                raise TypeError(f"{name}() got an unexpected or repeated keyword argument "
                                f"{key!r}")
            values[key] = value
        for i, field in enumerate(fields):
            if field not in values:
                if i < required:
                    raise TypeError(f"{name}() missing argument {field!r}")
                values[field] = defaults[i - required]
            object.__setattr__(self, field, values[field])

    def astuple(self: Any) -> tuple[Any, ...]:
        return tuple(object.__getattribute__(self, f) for f in fields)

    def __setattr__(self: Any, key: str, value: Any) -> None:
        raise AttributeError(f"{name}.{key} is read-only")

    def __delattr__(self: Any, key: str) -> None:
        raise AttributeError(f"{name}.{key} is read-only")

    def __eq__(self: Any, other: object) -> Any:
        return astuple(self) == astuple(other) if type(other) is type(self) else NotImplemented

    def __ne__(self: Any, other: object) -> Any:
        return astuple(self) != astuple(other) if type(other) is type(self) else NotImplemented

    def __hash__(self: Any) -> int:
        return hash(astuple(self))

    def __repr__(self: Any) -> str:
        return f"{name}({', '.join(f'{f}={v!r}' for f, v in zip(fields, astuple(self)))})"

    def __reduce__(self: Any) -> tuple[Any, ...]:
        return (type(self), astuple(self))

    body = {"__slots__": fields, "__init__": __init__, "__setattr__": __setattr__,
                 "__delattr__": __delattr__, "__eq__": __eq__, "__ne__": __ne__,
                 "__hash__": __hash__, "__repr__": __repr__, "__reduce__": __reduce__,
                 "_fields": fields, "_field_defaults": defaults, "__match_args__": fields,
                 "__module__": module, "__qualname__": name, **(namespace or {})}
    return type(name, (), body)


try:
    from ckptlab.format._interp import record_type as _c_record_type
except ImportError:
    _c_record_type = None


def _asdict(record: Any) -> dict[str, Any]:
    """The record's fields as a dict, in order (:func:`dataclasses.asdict` for a record)."""
    return dict(zip(type(record)._fields, record.__reduce__()[1]))


def record_type(qualname: str, fields: tuple[str, ...], defaults: tuple[Any, ...] = (),
                namespace: dict[str, Any] | None = None, *, impl: str | None = None) -> type:
    """An immutable record class named ``qualname`` (``"module.Name"``) with ``fields``,
    the last ``len(defaults)`` of them optional: the compiled one where it is built (or as
    ``impl`` says: ``"c"`` / ``"python"``); ``namespace``: more class attributes
    (properties, ``__doc__``). Every record has ``_asdict()``."""
    namespace = {"_asdict": _asdict, **(namespace or {})}
    if impl == "python" or (impl is None and _c_record_type is None):
        return _python_record_type(qualname, fields, defaults, namespace)
    if _c_record_type is None:
        raise ImportError("ckptlab.format._interp is not built")
    return _c_record_type(qualname, fields, defaults, namespace or {})  # type: ignore[no-any-return]


def replace(obj: Any, /, **changes: Any) -> Any:
    """A copy of the record ``obj`` with ``changes`` (:func:`dataclasses.replace` for a
    dataclass). ``obj`` is positional-only: a record may have a field named ``record``."""
    if not hasattr(type(obj), "_field_defaults"):
        import dataclasses

        return dataclasses.replace(obj, **changes)
    values = _asdict(obj)
    unknown = changes.keys() - values.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values.update(changes)
    return type(obj)(**values)
