"""What a scan makes on first use is what it made at once: segments, tensor infos, scanned
tensors (``LazyTuple``) and a torch.save file's ``Checkpoint.tensors`` (``LazyTensors``).

Each lazy structure is compared with the eager build of the same thing (the record-by-record
segments, ``_scanned`` of every tensor found, ``entries_from_logical`` + ``unique_names``) on
hypothesis-generated state dicts and on damaged files; lazy access must not read the file or
scan the pickle again.
"""

from __future__ import annotations

import copy
import io
import pickle
import random
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ckptlab
from ckptlab.checkpoint._tensors import LazyEntries, entries_from_logical, unique_names
from ckptlab.checkpoint.model import LazyTensors
from ckptlab.errors import ArchiveError
from ckptlab.format import _pickle, _zip
from ckptlab.format._bulk import LazyTuple
from ckptlab.format._pickle import _scanned
from ckptlab.source import _tree
from ckptlab.source._bytes import ByteSource
from ckptlab.testing.strategies import state_dicts


def save(obj: Any) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf)
    return buf.getvalue()


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", fn(*args))
    except ArchiveError as exc:
        return ("error", type(exc).__name__, str(exc), exc.offset, exc.record)


# --------------------------------------------------------------------------------------------
# LazyTuple
# --------------------------------------------------------------------------------------------


def test_lazy_tuple_answers_as_the_tuple() -> None:
    calls = []

    def make() -> list[int]:
        calls.append(1)
        return [3, 1, 2, 1]

    lazy = LazyTuple(4, make)
    assert len(lazy) == 4 and bool(lazy) and not lazy.built and calls == []
    plain = (3, 1, 2, 1)
    assert lazy == plain and plain == lazy and not (lazy != plain) and not (plain != lazy)
    assert lazy != (3, 1, 2) and (3, 1, 2) != lazy and lazy != [3, 1, 2, 1]
    assert lazy.built and calls == [1]
    assert hash(lazy) == hash(plain) and repr(lazy) == repr(plain) and str(lazy) == str(plain)
    assert lazy[0] == 3 and lazy[-1] == 1 and lazy[1:3] == (1, 2) and type(lazy[1:3]) is tuple
    assert list(lazy) == list(plain) and list(reversed(lazy)) == list(reversed(plain))
    assert 2 in lazy and 7 not in lazy and lazy.index(1) == 1 and lazy.count(1) == 2
    assert lazy + (9,) == plain + (9,) and (9,) + lazy == (9,) + plain and lazy * 2 == plain * 2
    assert (lazy < (4,)) and (lazy <= plain) and (lazy > (3,)) and (lazy >= plain)
    assert LazyTuple(4, make) == lazy  # two lazy ones compare by their items
    for copied in (pickle.loads(pickle.dumps(lazy)), copy.copy(lazy), copy.deepcopy(lazy)):
        assert copied == plain
    assert type(pickle.loads(pickle.dumps(lazy))) is tuple
    assert {lazy: 1}[plain] == 1
    assert calls == [1, 1]  # each LazyTuple made its items once
    empty = LazyTuple(0, list)
    assert not empty and empty == () and len(empty) == 0


def test_lazy_tuple_refuses_a_maker_of_another_length() -> None:
    with pytest.raises(RuntimeError, match="made 2 items"):
        LazyTuple(3, lambda: [1, 2]).value()


# --------------------------------------------------------------------------------------------
# layouts: lazy against eager
# --------------------------------------------------------------------------------------------


def eager_logical(data: bytes) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``_scanned`` of every tensor the scan finds, and the storage-backed infos among their
    parts, made one by one (the path the dense columns stand in for)."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        raw = z.read(pkl)
    _, found = _pickle._scan(raw, "<bytes>", pkl, 0, None, None)
    logical = tuple(_scanned(p, ref) for p, ref in found)
    infos = tuple(info for t in logical for _, info in t.parts
                  if info.storage_key or t.kind == "dense")
    return logical, infos


def eager_tensors(layout: Any, rel: str) -> dict[str, Any]:
    storages = {s.key: s for s in layout.storages}
    return unique_names(entries_from_logical(list(layout.logical), storages, rel))


def check_layout(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_zip, "VECTOR_MIN_ENTRIES", 0)
    monkeypatch.setattr(_zip, "VECTOR_ALWAYS_ENTRIES", 0)
    layout = ckptlab.inspect(data)
    monkeypatch.setattr(_zip, "VECTOR_MIN_ENTRIES", 1 << 60)
    monkeypatch.setattr(_zip, "VECTOR_ALWAYS_ENTRIES", 1 << 60)
    one_by_one = ckptlab.inspect(data)
    assert type(one_by_one.segments) is tuple
    logical, infos = eager_logical(data)
    # nothing made yet when the columns stand in for them (the tensor infos may have been
    # made by the scan itself: storages whose records need their views' dtypes)
    if isinstance(layout.segments, LazyTuple):
        assert not layout.segments.built
    assert layout.logical == logical and layout.tensors == infos
    assert layout.segments == one_by_one.segments and one_by_one.segments == layout.segments
    assert hash(layout) == hash(one_by_one) and layout == one_by_one
    assert repr(layout) == repr(one_by_one) and layout.to_dict() == one_by_one.to_dict()
    for t in layout.logical:  # the scanned tensors hold the layout's own infos
        for _, info in t.parts:
            if info.storage_key and not t.subclass:
                assert any(info is i for i in layout.tensors)


def check_open(data: bytes) -> None:
    ck = ckptlab.open(data)
    layout = ckptlab.inspect(data)
    want = eager_tensors(layout, ck.files[0].path)
    if isinstance(ck.tensors, LazyTensors):
        assert ck.tensors.built == 0
        names = list(ck.tensors)
        assert names == list(want) and len(ck.tensors) == len(want)
        assert all(n in ck.tensors for n in names) and "no such tensor" not in ck.tensors
        picked = names[::3]
        singles = {n: ck.tensors[n] for n in picked}
        assert ck.tensors.built == len(picked)
        for n in picked:
            assert singles[n] == want[n] and ck.tensors[n] is singles[n]
        with pytest.raises(KeyError):
            ck.tensors["no such tensor"]
        assert ck.tensors == want and want == ck.tensors and repr(ck.tensors) == repr(want)
        for n in picked:  # the full build keeps the entries made before
            assert ck.tensors[n] is singles[n]
    assert dict(ck.tensors.items()) == want and list(ck.tensors.values()) == list(want.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(obj=state_dicts())
def test_lazy_layouts_and_tensors_equal_eager_builds(obj: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    data = save(obj)
    with monkeypatch.context() as m:
        check_layout(data, m)
    check_open(data)


def test_large_plain_and_mixed_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    base = torch.arange(16.0)
    mix: dict[str, Any] = {"model": {}, "step": 3, "opt": {"betas": (0.9, 0.99)}}
    for i in range(300):
        mix["model"][f"l.{i}.w"] = torch.nn.Parameter(torch.zeros(2, 2))
        mix["model"][f"l.{i}.v"] = base[i % 5:i % 5 + 3]
        mix["model"][f"l.{i}.b"] = torch.zeros(3, dtype=torch.bfloat16)
    for obj in ({f"layer.{i}.weight": torch.empty(2) for i in range(1500)}, mix):
        data = save(obj)
        with monkeypatch.context() as m:
            check_layout(data, m)
        check_open(data)
        ck = ckptlab.open(data)
        assert isinstance(ck.tensors, LazyTensors)
        layout = ckptlab.inspect(data)
        for lazy in (layout.segments, layout.tensors, layout.logical):
            assert isinstance(lazy, LazyTuple) and not lazy.built


def test_names_that_collide_are_renamed_as_before() -> None:
    data = save({"a.b": torch.zeros(2), "a": {"b": torch.ones(3)}, 1: torch.zeros(1)})
    ck = ckptlab.open(data)
    assert not isinstance(ck.tensors, LazyTensors)  # unique_names renames: the eager path
    assert list(ck.tensors) == ["a.b", "a.b#2", "1"]
    assert ck.tensors == eager_tensors(ckptlab.inspect(data), ck.files[0].path)


def test_entries_from_columns_equal_entries_from_scanned_tensors() -> None:
    """LazyEntries.entry from the scan's columns against the same from ScannedTensor objects,
    subclass, parameter, requires_grad and views included."""
    base = torch.arange(10.0)
    obj = {"p": torch.nn.Parameter(torch.zeros(2, 3)), "g": torch.ones(2).requires_grad_(),
           "v": base[2:7], "t": base[1:9].view(2, 4).t(), ("k", 1): torch.zeros(1),
           "h": torch.zeros(3, dtype=torch.float16)}
    data = save(obj)
    layout = ckptlab.inspect(data)
    assert layout.logical.columns is not None and not layout.logical.built
    storages = {s.key: s for s in layout.storages}
    lazy = LazyEntries(layout.logical, storages, "f.pt")
    assert lazy.deferrable() and not layout.logical.built
    singles = [lazy.entry(i) for i in range(len(lazy))]
    assert not layout.logical.built
    every = lazy.value()  # from the columns too: the scanned objects are still not made
    assert not layout.logical.built
    plain = LazyEntries(list(layout.logical), storages, "f.pt")
    assert plain.deferrable()
    assert singles == [plain.entry(i) for i in range(len(plain))] == every == \
        entries_from_logical(layout.logical, storages, "f.pt")
    assert lazy.names() == plain.names() == [e.name for e in singles]


@pytest.mark.parametrize(("field", "bad"), [
    ("keys", "no-such-storage"), ("keys", ""), ("offsets", 1.0), ("dtypes", "float99"),
    ("shapes", [2]), ("strides", (1, "1")), ("shapes", ([1],)),
])
def test_columns_that_entries_cannot_be_made_from_are_not_deferred(field: str,
                                                                     bad: Any) -> None:
    """Each column check of LazyEntries.deferrable: one bad value in one column, and the
    entries are made at open (where making them raises, it raises there)."""
    layout = ckptlab.inspect(save({"a": torch.zeros(2), "b": torch.ones(3)}))
    storages = {s.key: s for s in layout.storages}
    assert LazyEntries(layout.logical, storages, "f.pt").deferrable()
    cols = layout.logical.columns
    column = list(getattr(cols, field))
    column[1] = bad
    setattr(cols, field, column)
    assert not LazyEntries(layout.logical, storages, "f.pt").deferrable()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=state_dicts())
def test_every_entry_from_columns_equals_the_scanned_tensors_entries(obj: Any) -> None:
    layout = ckptlab.inspect(save(obj))
    storages = {s.key: s for s in layout.storages}
    lazy = LazyEntries(layout.logical, storages, "f.pt", prefix=("model",))
    if lazy.deferrable():
        assert lazy.value() == entries_from_logical(
            ckptlab.inspect(save(obj)).logical, storages, "f.pt", prefix=("model",))


# --------------------------------------------------------------------------------------------
# damaged files: the same errors, at open
# --------------------------------------------------------------------------------------------


def eager_open(data: bytes) -> Any:
    """``ckptlab.open`` as it was before the lazy entries: every entry made at once."""
    ck = ckptlab.open(data)
    return list(ck.tensors.items()), ck.objects


def test_damaged_archives_raise_the_same_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    data = save({f"layer.{i}.weight": torch.zeros(i % 3 + 1) for i in range(200)})
    rng = random.Random(5)
    seen_errors = 0
    for _ in range(150):
        mutated = bytearray(data)
        at = rng.randrange(len(mutated))
        mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, 0xFF))
        lazy = outcome(eager_open, bytes(mutated))
        # the reference: entries_from_logical and unique_names at once, as open did
        with monkeypatch.context() as m:
            m.setattr(LazyEntries, "deferrable", lambda self: False)
            eager = outcome(eager_open, bytes(mutated))
        assert lazy == eager
        if lazy[0] == "error":
            seen_errors += 1
            # and an error is raised by open itself, never later by a lookup
            assert outcome(ckptlab.open, bytes(mutated))[0] == "error"
    assert seen_errors > 10


def test_lazy_access_reads_and_scans_nothing(tmp_path: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.pt"
    path.write_bytes(save({f"layer.{i}.weight": torch.zeros(2) for i in range(2000)}))
    ck = ckptlab.open(path)
    layout = ckptlab.inspect(path)
    assert isinstance(ck.tensors, LazyTensors) and isinstance(layout.segments, LazyTuple)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read or scanned again")

    monkeypatch.setattr(ByteSource, "read", refuse)
    monkeypatch.setattr(_pickle, "_scan", refuse)
    monkeypatch.setattr(_pickle, "_interpret", refuse)
    monkeypatch.setattr(_tree.os, "pread", refuse)  # (where ck.read preads)
    assert ck.tensors["layer.7.weight"].parts[0].nbytes == 8
    assert len(list(ck.tensors.values())) == 2000
    assert len(ck.files[0].segments) == len(layout.segments) > 2000
    assert layout.segments[0].offset == 0 and len(layout.tensors) == len(layout.logical) == 2000
    assert ck.to_dict()["tensors"][5]["name"] == "layer.5.weight"
