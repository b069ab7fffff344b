"""Many objects at once: frozen dataclass instances column by column, with the collector paused.

A checkpoint of 100,000 tensors has half a million layout segments and a few hundred thousand
records, tensor infos and parts, each a frozen slotted dataclass. Its generated ``__init__``
sets every field with ``object.__setattr__`` in a Python frame of its own; :func:`build` does
the same assignments through the fields' slot descriptors with ``map``, one field at a time
over all instances, without a Python frame per object (about three times faster). The
instances are ordinary ones: same class, every field set, equal to what ``cls(...)`` makes.

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
import gc
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import repeat
from typing import Any, TypeVar

__all__ = ["build", "gc_paused"]

T = TypeVar("T")


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
    columns = (*columns, *(repeat(f.default) for f in rest))
    objects = list(map(object.__new__, repeat(cls, count)))
    for field, column in zip(fields, columns):
        setter = getattr(cls, field.name).__set__
        if isinstance(column, (list, tuple)) and len(column) < count:
            raise ValueError(f"a column of {len(column)} values for {count} {cls.__name__}")
        deque(map(setter, objects, column), maxlen=0)
    return objects


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
