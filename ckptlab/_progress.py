"""Progress of long work, reported by the core and drawn by whoever listens.

The core (opening a checkpoint shard by shard, a DCP directory file by file, a report's
stages) says what it is doing through :func:`task`; it never draws anything. A front end
installs a listener with :func:`listening` for the duration of a call: the CLI draws a tqdm
bar on a terminal, the widgets a progress bar. With no listener a task costs one context
variable lookup.

    with task("reading shards", total=len(shards)) as t:
        for shard in shards:
            ...
            t.advance()
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Protocol


class Listener(Protocol):
    """What a front end implements to be told of progress.

    ``start`` is called once per task with its label and total (None when the amount of work
    is not known), ``advance`` with the units done since the last call, ``end`` once when the
    task finishes, also when it fails.
    """

    def start(self, label: str, total: int | None) -> None: ...

    def advance(self, done: int) -> None: ...

    def end(self) -> None: ...


_LISTENER: contextvars.ContextVar[Callable[[], Listener] | None] = contextvars.ContextVar(
    "ckptlab_progress", default=None)


class Task:
    """One unit of reported work; :meth:`advance` as parts of it are done."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Listener | None) -> None:
        self._listener = listener

    def advance(self, done: int = 1) -> None:
        """Report ``done`` more units of work finished."""
        if self._listener is not None:
            self._listener.advance(done)


@contextlib.contextmanager
def task(label: str, total: int | None = None) -> Iterator[Task]:
    """Report the work of the ``with`` block to the listener installed, if any.

    Parameters
    ----------
    label
        What is being done, in words ("reading shards").
    total
        How many units :meth:`Task.advance` will count, or None when not known.
    """
    make = _LISTENER.get()
    if make is None:
        yield Task(None)
        return
    listener = make()
    listener.start(label, total)
    try:
        yield Task(listener)
    finally:
        listener.end()


@contextlib.contextmanager
def listening(make: Callable[[], Listener]) -> Iterator[None]:
    """Install ``make`` (called once per task, returns its :class:`Listener`) for the block."""
    token = _LISTENER.set(make)
    try:
        yield
    finally:
        _LISTENER.reset(token)
