"""Deterministic measures of how much work a call does, for tests that would otherwise time it.

A wall-clock assertion ("parses in under 2 s") flakes on a loaded host and says nothing on a
fast one. These counters give the same number on every run of the same input, so a test can
bound the work a call does by the size of its input, or compare two inputs (nested and flat,
n and 2n items) and see a quadratic step as a ratio that grows with n.

What is counted, in the calling thread only:

- ``calls``: every Python function call and every call of a C function from Python code
  (``sys.setprofile``'s ``"call"`` and ``"c_call"`` events). Cheap (about 2x slower).
- ``lines``: every Python line executed (``sys.settrace``'s ``"line"`` events), only where
  asked for (``lines=True``; 10-30x slower): a loop that calls nothing is seen only here.

With a ``limit``, the count stops the call it measures once it passes the limit: a
:class:`WorkLimitExceeded` is raised inside the code being run, a ``BaseException`` so that
code which turns any ``Exception`` into its own error does not swallow it. A test that bounds
the work of a call so fails at the bound, naming the input, instead of hanging.

Neither sees work done inside one C function (a compiled loop, a copy of a long list): tests
that need that measured switch the compiled parts off, or bound memory with ``tracemalloc``.
Any profile or trace function already set (a coverage tracer) is restored afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Work", "WorkLimitExceeded", "counting", "work_of"]


class WorkLimitExceeded(BaseException):
    """Raised inside the counted code when its work passes :func:`counting`'s ``limit``."""


@dataclass
class Work:
    """The counts of one :func:`counting` block (see the module docstring)."""

    calls: int = 0
    lines: int = 0
    exceeded: bool = False  # the limit was passed (WorkLimitExceeded was raised)

    @property
    def total(self) -> int:
        return self.calls + self.lines


@contextmanager
def counting(lines: bool = False, limit: int | None = None) -> Iterator[Work]:
    """Count the calls (and with ``lines``, the lines) run in this thread inside the block.

    The :class:`Work` yielded is filled in when the block ends. With ``limit``, the code in
    the block is stopped by :class:`WorkLimitExceeded` once calls + lines pass it.
    """
    calls = [0]
    executed = [0]
    bound = float("inf") if limit is None else limit
    stop = [bound]  # set to infinity before the counters are taken off

    def over() -> WorkLimitExceeded:
        return WorkLimitExceeded(f"more than {limit:,} calls + lines")

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            calls[0] += 1
            if calls[0] + executed[0] > stop[0]:
                raise over()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            executed[0] += 1
            if calls[0] + executed[0] > stop[0]:
                raise over()
        return local

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return local

    work = Work()
    old_profile, old_trace = sys.getprofile(), sys.gettrace()
    if lines:
        sys.settrace(trace)
    sys.setprofile(profile)
    try:
        yield work
    finally:
        stop[0] = float("inf")
        sys.setprofile(old_profile)
        if lines:
            sys.settrace(old_trace)
        # the calls above are counted too; they are the same in every block
        work.calls, work.lines = calls[0], executed[0]
        work.exceeded = work.total > bound


def work_of(fn: Callable[..., Any], *args: Any, lines: bool = False, limit: int | None = None,
            catch: type[BaseException] | tuple[type[BaseException], ...] = ()
            ) -> tuple[Any, Work]:
    """``(fn(*args), work)``, counted by :func:`counting`; an exception of a ``catch`` type is
    returned in place of the result, anything else (:class:`WorkLimitExceeded` too)
    propagates."""
    with counting(lines, limit) as work:
        try:
            result = fn(*args)
        except catch as exc:
            result = exc
    return result, work
