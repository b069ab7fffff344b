"""ckptlab.testing.work: the counters the hostile-input tests bound work with, in place of
timing it."""

from __future__ import annotations

import sys

import pytest

from ckptlab.testing.work import WorkLimitExceeded, counting, work_of


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _calls(n: int) -> None:
    for _ in range(n):
        len("x")


def test_the_counts_are_the_same_every_run_and_grow_with_the_work() -> None:
    runs = [work_of(_loop, 1000, lines=True)[1] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    small, large = runs[0], work_of(_loop, 2000, lines=True)[1]
    assert large.lines - small.lines == 2 * 1000  # two lines per i: the for and the +=
    assert work_of(_calls, 2000)[1].calls - work_of(_calls, 1000)[1].calls == 1000


def test_a_loop_that_calls_nothing_is_seen_only_in_lines() -> None:
    result, work = work_of(_loop, 10_000)
    assert result == sum(range(10_000)) and work.calls < 10 and work.lines == 0


def test_the_limit_stops_the_call_even_where_it_catches_exceptions() -> None:
    def swallowing() -> str:
        try:
            _calls(10**9)
        except Exception:
            return "swallowed"
        return "finished"

    with pytest.raises(WorkLimitExceeded, match="more than 5,000"):
        work_of(swallowing, limit=5_000)
    with counting(limit=5_000) as work, pytest.raises(WorkLimitExceeded):
        _calls(10**9)
    assert work.exceeded and 5_000 < work.calls < 5_010


def test_an_exception_is_returned_only_where_asked() -> None:
    result, _ = work_of(int, "x", catch=ValueError)
    assert isinstance(result, ValueError)
    with pytest.raises(ValueError):
        work_of(int, "x")


def test_earlier_profile_and_trace_functions_are_put_back() -> None:
    def profile(frame, event, arg):
        return None

    def trace(frame, event, arg):
        return None

    old_profile, old_trace = sys.getprofile(), sys.gettrace()
    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        work_of(_loop, 10, lines=True)
        with pytest.raises(WorkLimitExceeded):
            work_of(_calls, 10**6, lines=True, limit=100)
        assert sys.getprofile() is profile and sys.gettrace() is trace
    finally:
        sys.setprofile(old_profile)
        sys.settrace(old_trace)
