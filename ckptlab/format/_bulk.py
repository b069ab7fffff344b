"""Many objects at once, and tuples made when first used.

:func:`build` makes ``count`` instances of a class from columns of field values, each by an
ordinary call of the class (its ``__init__`` runs). :class:`LazyTuple` stands in for a tuple
of objects nobody may ask for (a layout of half a million segments keeps the columns they come
from instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from operator import attrgetter, itemgetter
from typing import Any, Generic, SupportsIndex, TypeVar, overload

__all__ = ["BuiltOnce", "LazyTuple", "build", "columns", "fields"]

T = TypeVar("T")
V = TypeVar("V")


def build(cls: Callable[..., T], count: int, *columns: Iterable[Any]) -> list[T]:
    """``[cls(*fields) for fields in zip(*columns)]``, ``count`` of them.

    ``columns`` holds one iterable per leading parameter of ``cls``, in order, each with at
    least ``count`` values (``itertools.repeat(value)`` for a constant); the parameters after
    the last column take their defaults.
    """
    objects = list(islice(map(cls, *columns), count))
    if len(objects) != count:
        raise ValueError(f"a column of fewer than {count} values for {cls!r}")
    return objects


def columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """``zip(*rows)`` as ``width`` lists. Not ``zip(*rows)`` itself: that holds an iterator
    per row at once, 100,000 objects the collector walks for a 100,000-row transpose."""
    return [list(map(itemgetter(i), rows)) for i in range(width)]


def fields(objects: Sequence[Any], names: Sequence[str]) -> list[list[Any]]:
    """``[o.name for o in objects]`` for each of ``names``: objects' fields as columns."""
    return [list(map(attrgetter(name), objects)) for name in names]


class BuiltOnce(Generic[V]):
    """The base of stand-ins for a value made when first used: :meth:`value` returns what
    ``make()`` returns, made once, then
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
