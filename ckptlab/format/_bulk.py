"""Many objects at once: frozen dataclass instances column by column, with the collector paused.

A checkpoint of 100,000 tensors has half a million layout segments and a few hundred thousand
records, tensor infos and parts, each a frozen slotted dataclass. Its generated ``__init__``
sets every field with ``object.__setattr__`` in a Python frame of its own; :func:`build` makes
each object with a *twin* class's plain ``__init__`` (the same slots in the same order, so one
frame of fast slot stores) and then gives it its real class (``__class__`` assignment, which
CPython allows between classes of the same layout): about 1.5x faster than setting the fields
through their slot descriptors one column at a time (the fallback for a class whose layout a
twin cannot share), and 4-5x faster than ``cls(...)``. Where ckptlab was built with a C
compiler, ``_entries.slot_build`` does the same without a frame: it allocates each object and
stores its slots (about 3x faster again). The instances are ordinary ones: same class, every
field set, equal to what ``cls(...)`` makes, and as frozen.

:func:`gc_paused` holds off Python's cyclic garbage collector while a scan builds them: every
700 new containers it would walk the young ones, and now and then all of them, which costs a
scan of 100,000 tensors about as much again as building its objects. What a scan builds lives
until it returns (the memo of its pickle, then the layout). At the end of the pause the young
objects are handed to the oldest generation at once (``gc.freeze()`` then ``gc.unfreeze()``,
two list splices) instead of being walked by the first collection after it; a cycle among
them is collected by the next full collection, as any long-lived object's. When something is
frozen already (a server about to fork), the pause just ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import keyword
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any, Generic, SupportsIndex, TypeVar, overload

__all__ = ["BuiltOnce", "LazyTuple", "build", "gc_paused"]

try:  # the objects made in C, where ckptlab was built with a compiler (setup.py)
    from ckptlab.format._entries import slot_build as _slot_build
except ImportError:  # a twin class's __init__ (below)
    _slot_build = None

T = TypeVar("T")
V = TypeVar("V")


def _fields(cls: type) -> tuple[Any, ...]:
    if "__slots__" not in cls.__dict__ or not cls.__dataclass_params__.init:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} is not a slotted dataclass with an __init__")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__, which build() would skip")
    return dataclasses.fields(cls)  # type: ignore[arg-type]


def build(cls: type[T], count: int, *columns: Iterable[Any]) -> list[T]:
    """``count`` instances of the slotted dataclass ``cls``.

    ``columns`` holds one iterable per field, in field order, each with at least ``count``
    values (``itertools.repeat(value)`` for a constant); fields after the last column get
    their default values (plain defaults only).
    """
    fields = _fields(cls)
    if len(columns) > len(fields):
        raise TypeError(f"{cls.__name__} has {len(fields)} fields, got {len(columns)} columns")
    rest = fields[len(columns):]
    if any(f.default is dataclasses.MISSING for f in rest):
        raise TypeError(f"{cls.__name__}: no column for a field without a plain default")
    for column in columns:
        if isinstance(column, (list, tuple)) and len(column) < count:
            raise ValueError(f"a column of {len(column)} values for {count} {cls.__name__}")
    columns = (*columns, *(repeat(f.default) for f in rest))
    twin = _twin(cls)
    if twin is not None and _slot_build is not None:
        # each object allocated and its slots stored in C (ckptlab/format/_handlers.c)
        return _slot_build(cls, count, columns)  # type: ignore[no-any-return]
    if twin is not None:
        # each object made by the twin's plain __init__ (slot stores in one frame), then
        # given its real class: two C-level passes instead of one per field
        objects = list(map(twin, range(count), *columns))
        if len(objects) != count:
            raise ValueError(f"a column of fewer than {count} values for {cls.__name__}")
        deque(map(setattr, objects, repeat("__class__"), repeat(cls)), maxlen=0)
        return objects
    objects = list(map(object.__new__, repeat(cls, count)))
    for field, column in zip(fields, columns):
        setter = getattr(cls, field.name).__set__
        deque(map(setter, objects, column), maxlen=0)
    return objects


@functools.cache
def _twin(cls: type) -> type | None:
    """A plain class with the slots of ``cls`` in the same order and an ``__init__`` that
    stores every field (the first argument, a counter, is ignored): its instances can take
    ``cls`` as their ``__class__`` (same layout), becoming ordinary ``cls`` instances.
    None when ``cls`` has a layout the twin could not share (a base with slots, a weakref
    slot, a ``__dict__``)."""
    slots = cls.__dict__.get("__slots__")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if tuple(slots or ()) != tuple(names) or cls.__bases__ != (object,) or \
            not all(n.isidentifier() and not keyword.iskeyword(n) and n != "self"
                    and not n.startswith("_") for n in names):
        return None
    args = ", ".join(names)
    body = "".join(f"    self.{n} = {n}\n" for n in names)
    scope: dict[str, Any] = {}
    exec(f"def __init__(self, _, {args}):\n{body}", scope)  # field names, checked above
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": tuple(names),
                                               "__init__": scope["__init__"]})
    probe = twin(0, *([None] * len(names)))
    try:
        probe.__class__ = cls  # the layouts must agree, else the plain path
    except TypeError:
        return None
    return twin


class _Pause:
    """The collector's state across nested and concurrent :func:`gc_paused` blocks."""

    lock = threading.Lock()
    depth = 0
    resume = False  # whether the collector was on when the outermost block began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (as it was, after the last one).

    Nested and concurrent blocks share one pause: the collector is re-enabled when the last
    block ends, and only if it was enabled when the first began.
    """
    with _Pause.lock:
        if _Pause.depth == 0:
            _Pause.resume = gc.isenabled()
            gc.disable()
        _Pause.depth += 1
    try:
        yield
    finally:
        with _Pause.lock:
            _Pause.depth -= 1
            if _Pause.depth == 0 and _Pause.resume:
                if gc.get_freeze_count() == 0:  # nobody else's frozen objects to thaw
                    gc.freeze()  # young objects into the oldest generation, unwalked
                    gc.unfreeze()
                gc.enable()


class BuiltOnce(Generic[V]):
    """The base of stand-ins for a value made when first used: :meth:`value` returns what
    ``make()`` returns, made once (with the collector paused: :func:`gc_paused`), then
    ``make`` is dropped. Threads that race may each make it; the first made is the one every
    caller gets."""

    __slots__ = ("_make", "_value")

    def __init__(self, make: Callable[[], V]) -> None:
        self._make: Callable[[], V] | None = make
        self._value: V | None = None

    @property
    def built(self) -> bool:
        """Whether the value has been made."""
        return self._value is not None

    def value(self) -> V:
        """The value (made on the first call)."""
        value = self._value
        if value is None:
            make = self._make
            if make is None:  # another thread made it meanwhile (it sets _value first)
                return self._value  # type: ignore[return-value]
            with gc_paused():
                value = make()
            if self._value is None:  # the first one made is the one kept
                self._value = value
            self._make = None
        return self._value  # type: ignore[return-value]


class LazyTuple(BuiltOnce[tuple[T, ...]], Sequence[T]):
    """A tuple of ``count`` items made by ``make()`` when first used, standing in for it.

    ``len()`` is known before (unless ``count`` is None: then it builds the tuple too);
    anything else (items, slices, iteration, ``in``, equality,
    ordering, hashing, ``repr``, ``+``) builds the tuple once and answers as the tuple would:
    equal to a tuple of the same items (either way round), the same hash and ``repr``, and it
    pickles and copies as that tuple. A layout of half a million segments keeps the columns
    they come from instead of the objects until somebody looks at them.
    """

    __slots__ = ("_count",)

    def __init__(self, count: int | None, make: Callable[[], Iterable[T]]) -> None:
        def made() -> tuple[T, ...]:
            value = tuple(make())
            if count is not None and len(value) != count:
                raise RuntimeError(f"made {len(value)} items for a LazyTuple of {count}")
            return value

        super().__init__(made)
        self._count = count

    def __len__(self) -> int:
        count = self._count
        return len(self.value()) if count is None else count

    def __bool__(self) -> bool:
        return len(self) > 0

    @overload
    def __getitem__(self, index: SupportsIndex) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        return self.value()[index]

    def __iter__(self) -> Iterator[T]:
        return iter(self.value())

    def __reversed__(self) -> Iterator[T]:
        return reversed(self.value())

    def __contains__(self, item: object) -> bool:
        return item in self.value()

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        return self.value().index(value, start, len(self) if stop is None else stop)

    def count(self, value: Any) -> int:
        return self.value().count(value)

    @staticmethod
    def _plain(other: object) -> object:
        return other.value() if isinstance(other, LazyTuple) else other

    def __eq__(self, other: object) -> bool:
        other = self._plain(other)
        if not isinstance(other, tuple):
            return NotImplemented
        return len(other) == len(self) and self.value() == other

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __lt__(self, other: object) -> bool:
        return self.value() < self._plain(other)  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        return self.value() <= self._plain(other)  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        return self.value() > self._plain(other)  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        return self.value() >= self._plain(other)  # type: ignore[operator]

    def __hash__(self) -> int:
        return hash(self.value())

    def __add__(self, other: object) -> tuple[T, ...]:
        return self.value() + self._plain(other)  # type: ignore[operator]

    def __radd__(self, other: object) -> tuple[T, ...]:
        return self._plain(other) + self.value()  # type: ignore[operator]

    def __mul__(self, n: SupportsIndex) -> tuple[T, ...]:
        return self.value() * n

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self.value())

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self.value(),))  # pickles, copies and deep-copies as the tuple
