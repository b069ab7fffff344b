"""Immutable records (:mod:`ckptlab.format._records`): the compiled record types
(``_interp.record_type``) and the Python ones, one suite run against both."""

from __future__ import annotations

import copy
import gc
import os
import pickle
from typing import Any

import pytest

from ckptlab.format import _records
from ckptlab.format._records import record_type, replace

IMPLS = ["python", "c"]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "c" and _records._c_record_type is None:
        if os.environ.get("CI"):
            pytest.fail("ckptlab.format._interp is not built (pip install -e . with gcc)")
        pytest.skip("ckptlab.format._interp is not built")
    return request.param  # type: ignore[no-any-return]


def _size(self: Any) -> int:
    return self.a * 10


def make(impl: str) -> type:
    return record_type(f"{__name__}.Point", ("a", "b", "c"), (None, "z"),
                       {"size": property(_size), "__doc__": "A point."}, impl=impl)


def test_construction(impl: str) -> None:
    Point = make(impl)
    p = Point(1, 2, 3)
    assert (p.a, p.b, p.c) == (1, 2, 3)
    assert Point(1).b is None and Point(1).c == "z"
    assert Point(c=3, a=1) == Point(1, None, 3)
    assert Point(1, c=5).c == 5
    assert Point.__doc__ == "A point." and p.size == 10
    assert Point._fields == ("a", "b", "c") and Point.__match_args__ == ("a", "b", "c")
    assert Point.__name__ == "Point" and Point.__module__ == __name__


@pytest.mark.parametrize("args, kwargs, message", [
    ((), {}, "missing argument 'a'"),
    ((1, 2, 3, 4), {}, "takes 3 arguments, 4 given"),
    ((1,), {"d": 1}, "unexpected or repeated keyword argument 'd'"),
    ((1,), {"a": 2}, "unexpected or repeated keyword argument 'a'"),
])
def test_bad_construction(impl: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                          message: str) -> None:
    with pytest.raises(TypeError, match=message):
        make(impl)(*args, **kwargs)


def test_read_only(impl: str) -> None:
    p = make(impl)(1)
    with pytest.raises(AttributeError):
        p.a = 2
    with pytest.raises(AttributeError):
        del p.a
    with pytest.raises(AttributeError):
        p.other = 1


def test_equality_hash_repr(impl: str) -> None:
    Point = make(impl)
    Other = record_type(f"{__name__}.Other", ("a", "b", "c"), impl=impl)
    assert Point(1, 2, 3) == Point(1, 2, 3) and hash(Point(1, 2, 3)) == hash((1, 2, 3))
    assert Point(1, 2, 3) != Point(1, 2, 4)
    assert Point(1, 2, 3) != Other(1, 2, 3)  # equal only to the same class
    assert Point(1, 2, 3) != (1, 2, 3)
    assert repr(Point(1, "x")) == "Point(a=1, b='x', c='z')"
    assert len({Point(1), Point(1), Point(2)}) == 2


def test_pickle_copy_asdict_replace(impl: str) -> None:
    Point = make(impl)
    globals()["Point"] = Point  # (pickle finds the class by its qualified name)
    try:
        p = Point(1, (2, 3))
        assert pickle.loads(pickle.dumps(p)) == p
        assert copy.copy(p) == p and copy.deepcopy(p) == p
        assert p._asdict() == {"a": 1, "b": (2, 3), "c": "z"}
        q = replace(p, c="y")
        assert q == Point(1, (2, 3), "y") and p.c == "z"
        with pytest.raises(TypeError, match="no field 'd'"):
            replace(p, d=1)
    finally:
        del globals()["Point"]


def test_compiled_records_are_not_tracked_by_the_collector() -> None:
    if _records._c_record_type is None:
        pytest.skip("ckptlab.format._interp is not built")
    Point = make("c")
    p = Point(1, (2,), "x")
    assert not gc.is_tracked(p)  # never walked by the cyclic collector
    assert gc.is_tracked(make("python")(1))  # (the Python twin is an ordinary object)


def test_both_implementations_agree_on_every_case() -> None:
    if _records._c_record_type is None:
        pytest.skip("ckptlab.format._interp is not built")
    py, c = make("python"), make("c")
    for args, kwargs in [((1,), {}), ((1, 2), {"c": 3}), ((), {"a": [1]})]:
        a, b = py(*args, **kwargs), c(*args, **kwargs)
        assert a._asdict() == b._asdict()
        assert repr(a) == repr(b)
        if not kwargs.get("a"):
            assert hash(a) == hash(b)


def test_replace_of_a_field_named_like_its_argument(impl: str) -> None:
    Info = record_type(f"{__name__}.Info", ("key", "record", "obj"), impl=impl)
    assert replace(Info("k", "r", "o"), record="s", obj="p") == Info("k", "s", "p")
