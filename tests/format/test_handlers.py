"""The compiled rebuild handlers (``ckptlab/format/_handlers.c``, ``_entries.FastHandler``):
each gives what the Python method it stands for gives, on its common case and every other."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.format import _pickle
from ckptlab.format._pickle import StorageRef, _TensorRef, _TorchHandlers
from ckptlab.format._unpickle import Global, PickleDataError
from ckptlab.testing.compiled import require_compiled


@pytest.fixture(scope="module")
def fast_handler() -> Any:
    return require_compiled(_pickle._FastHandler)


def python_handlers() -> _TorchHandlers:
    """Handlers whose fused_v2 and rebuild_parameter are the Python methods."""
    handlers = _TorchHandlers()
    handlers.fused_v2 = _TorchHandlers.fused_v2.__get__(handlers)  # type: ignore[method-assign]
    handlers.rebuild_parameter = (  # type: ignore[method-assign]
        _TorchHandlers.rebuild_parameter.__get__(handlers))
    return handlers


def rendered(value: Any) -> Any:
    """A comparable rendering: tensor and storage records by their fields."""
    if isinstance(value, tuple):
        return tuple(rendered(v) for v in value)
    if isinstance(value, _TensorRef):
        return ("tensor", *(rendered(getattr(value, s)) for s in _TensorRef.__slots__))
    if isinstance(value, StorageRef):
        return ("storage", dataclasses.astuple(value))
    if isinstance(value, Global):
        return ("global", value.qualname)
    return value


def outcome(call: Any, *args: Any) -> Any:
    try:
        return ("ok", rendered(call(*args)))
    except Exception as exc:  # the same error both ways
        return ("error", type(exc).__name__, str(exc))


FLOAT = Global("torch", "FloatStorage")
HALF = Global("torch", "HalfStorage")
ODD = Global("torch", "NoSuchStorage")

pids = st.tuples(
    st.sampled_from(["storage", "storage", "storage", "other", 7]),
    st.sampled_from([FLOAT, FLOAT, HALF, ODD, "FloatStorage"]),
    st.sampled_from(["0", "1", "2", "3", 4, None]),
    st.sampled_from(["cpu", "cpu", "cuda:0", 0]),
    st.one_of(st.integers(-2, 40), st.sampled_from([True, 1 << 70, 2.0, "3"])),
) | st.sampled_from([(), ("storage", FLOAT, "0"), "storage", None])

calls = st.lists(st.tuples(pids, st.integers(0, 9), st.sampled_from([(2,), (3, 2), ()]),
                           st.booleans()), max_size=12)


@settings(max_examples=400, deadline=None)
@given(calls=calls)
def test_fused_v2_is_the_method(fast_handler: Any, calls: list[tuple[Any, ...]]) -> None:
    """The same (storage, tensor) or None or error, call by call, and the same storage table."""
    fast, slow = _TorchHandlers(), python_handlers()
    assert type(fast.fused_v2) is fast_handler
    for handlers in (fast, slow):  # two storage classes seen before (as persistent_load does)
        handlers.persistent_load(("storage", FLOAT, "seen", "cpu", 1))
        handlers.persistent_load(("storage", HALF, "seen-half", "cpu", 1))
    for pid, offset, size, grad in calls:
        stride = tuple(1 for _ in size)
        got = [outcome(h.fused_v2, pid, offset, size, stride, grad) for h in (fast, slow)]
        assert got[0] == got[1]
    assert [rendered(fast.storages[k]) for k in fast.storage_order] == \
        [rendered(slow.storages[k]) for k in slow.storage_order]


def test_fused_v2_makes_ordinary_objects(fast_handler: Any) -> None:
    handlers = _TorchHandlers()
    handlers.persistent_load(("storage", FLOAT, "0", "cpu", 4))
    ref, tensor = handlers.fused_v2(("storage", FLOAT, "1", "cpu", 6), 2, (2, 2), (2, 1), True)
    assert type(ref) is StorageRef and type(tensor) is _TensorRef
    assert ref == StorageRef("1", "FloatStorage", "float32", "cpu", 6, 24)
    assert hash(ref) == hash(StorageRef("1", "FloatStorage", "float32", "cpu", 6, 24))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.nbytes = 1  # type: ignore[misc]
    assert (tensor.storage, tensor.storage_offset, tensor.shape, tensor.stride) == \
        (ref, 2, (2, 2), (2, 1))
    assert (tensor.requires_grad, tensor.dtype, tensor.is_parameter, tensor.subclass,
            tensor.attrs, tensor.pending) == (True, "float32", False, None, None, False)
    assert handlers.storage_order == ["0", "1"] and handlers.storages["1"] is ref
    again, other = handlers.fused_v2(("storage", FLOAT, "1", "cpu", 6), 0, (6,), (1,), False)
    assert again is ref and other is not tensor
    # the same key with another size: None, nothing changed
    assert handlers.fused_v2(("storage", FLOAT, "1", "cpu", 7), 0, (7,), (1,), False) is None
    assert handlers.storage_order == ["0", "1"]


def test_rebuild_parameter_is_the_method(fast_handler: Any) -> None:
    fast, slow = _TorchHandlers(), python_handlers()
    assert type(fast.rebuild_parameter) is fast_handler and fast.rebuild_parameter.ckptlab_batchable
    state = {"note": 1}
    for args in [(True,), (False, {}), (True, {}, None), (True, {}, state), (1, {}), (None,),
                 ("yes", {}, state), (), (True, {}, None, 5)]:
        made = []
        for h in (fast, slow):
            tensor = _TensorRef(None, 0, (2,), (1,), False, "float32")
            made.append((outcome(h.rebuild_parameter, tensor, *args), rendered(tensor)))
        assert made[0] == made[1], args
    for data in [None, "x", 3, Global("a", "b")]:  # not a tensor: as it is
        assert fast.rebuild_parameter(data, True, {}) is data


def test_records_with_slots_unset_are_left_to_the_methods(fast_handler: Any) -> None:
    """Objects made without __init__ (slots unset): what the Python methods do with them."""
    fast, slow = _TorchHandlers(), python_handlers()
    made = []
    for h in (fast, slow):
        tensor = _TensorRef.__new__(_TensorRef)
        assert h.rebuild_parameter(tensor, True, {}, {"a": 1}) is tensor
        made.append((tensor.requires_grad, tensor.is_parameter, tensor.attrs))
        h.persistent_load(("storage", FLOAT, "k", "cpu", 4))
        StorageRef.nbytes.__delete__(h.storages["k"])  # type: ignore[attr-defined]
        made.append(outcome(h.fused_v2, ("storage", FLOAT, "k", "cpu", 4), 0, (4,), (1,),
                            False))
    assert made[:2] == made[2:] and made[0] == (True, True, {"a": 1})


def test_the_fallback_raises_what_the_method_raises(fast_handler: Any) -> None:
    fast = _TorchHandlers()
    with pytest.raises(ValueError):  # (unpacking a pid of the wrong length)
        fast.fused_v2(("storage", FLOAT), 0, (1,), (1,), False)
    with pytest.raises(TypeError):  # keywords go to the method, which takes none of these
        fast.fused_v2(pid=("storage", FLOAT, "0", "cpu", 1))
    assert fast.fused_v2.fallback.__func__ is _TorchHandlers.fused_v2
    with pytest.raises(PickleDataError):
        fast.persistent_load(("storage", ODD, "0", "cpu", 1))


class Plain:
    __slots__ = ("a", "b")


class WithDict:
    pass


class Aliased:
    """_TensorRef's slots, two names of one of them."""

    __slots__ = tuple(_TensorRef.__slots__)


Aliased.shape = Aliased.__dict__["storage"]  # type: ignore[attr-defined]


class Base:
    __slots__ = ()


class Derived(Base):
    __slots__ = tuple(_TensorRef.__slots__)


@pytest.mark.parametrize(("args", "error"), [
    (("nothing", print, _TensorRef), ValueError),
    (("rebuild_parameter", 3, _TensorRef), TypeError),
    (("rebuild_parameter", print, Plain), TypeError),
    (("rebuild_parameter", print, WithDict), TypeError),
    (("rebuild_parameter", print, Derived), TypeError),
    (("rebuild_parameter", print, 5), TypeError),
    (("fused_v2", print, _TensorRef), TypeError),
    (("fused_v2", print, _TensorRef, _TensorRef, {}, {}, []), TypeError),
    (("fused_v2", print, _TensorRef, StorageRef, {}, [], []), TypeError),
    (("rebuild_parameter", print, Aliased), TypeError),
])
def test_bad_arguments_are_refused(fast_handler: Any, args: tuple[Any, ...],
                                   error: type[Exception]) -> None:
    with pytest.raises(error):
        fast_handler(*args)


def test_a_handler_and_its_handlers_are_collected(fast_handler: Any) -> None:
    """The handler refers to its handlers (its fallback), which refer to it: a cycle the
    collector frees."""
    handlers = _TorchHandlers()
    handlers.persistent_load(("storage", FLOAT, "0", "cpu", 1))
    gone = weakref.ref(handlers)
    del handlers
    gc.collect()
    assert gone() is None


# --------------------------------------------------------------------------------------------
# slot_build / slot_columns: many records at once (ckptlab.format._bulk.build, fields_of)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slots() -> Any:
    require_compiled(_pickle._slot_columns)
    from ckptlab.format import _entries

    return _entries


def test_slot_build_makes_what_the_class_makes(slots: Any) -> None:
    from itertools import repeat

    from ckptlab.format.layout import StorageInfo, TensorInfo

    made = slots.slot_build(StorageInfo, 3, (["a", "b", "c"], ("n1", "n2", "n3"),
                                             repeat("float32"), [4, 8, 12], iter([0, 64, 128]),
                                             repeat("cpu"), repeat("FloatStorage")))
    want = [StorageInfo(k, n, "float32", b, o, "cpu", "FloatStorage")
            for k, n, b, o in zip("abc", ("n1", "n2", "n3"), (4, 8, 12), (0, 64, 128))]
    assert made == want and [hash(m) for m in made] == [hash(w) for w in want]
    assert all(type(m) is StorageInfo for m in made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].nbytes = 0  # type: ignore[misc]
    fields = [f.name for f in dataclasses.fields(TensorInfo)]
    assert slots.slot_build(TensorInfo, 0, tuple([] for _ in fields)) == []
    # the columns back, in __slots__ order
    assert slots.slot_columns(made, StorageInfo) == tuple(
        [getattr(m, name) for m in made] for name in StorageInfo.__slots__)


def test_slot_build_refuses_what_it_cannot_make(slots: Any) -> None:
    from itertools import repeat

    from ckptlab.format.layout import StorageInfo

    seven = (["a"], ["n"], ["f"], [1], [2], ["cpu"], ["t"])
    with pytest.raises(ValueError):  # a list too short
        slots.slot_build(StorageInfo, 2, seven)
    with pytest.raises(ValueError):  # an iterator too short
        slots.slot_build(StorageInfo, 2, (*seven[:6], iter(["t"])))
    with pytest.raises(TypeError):  # a column missing
        slots.slot_build(StorageInfo, 1, seven[:6])
    with pytest.raises(ValueError):
        slots.slot_build(StorageInfo, -1, seven)
    with pytest.raises(TypeError):  # not a plain slotted class
        slots.slot_build(WithDict, 1, ())
    with pytest.raises(TypeError):
        slots.slot_build(Derived, 1, tuple(repeat(None, 10)))

    def failing() -> Any:
        yield 1
        raise KeyError("from the column")

    with pytest.raises(KeyError):
        slots.slot_build(StorageInfo, 2, (*(c * 2 for c in seven[:6]), failing()))


def test_slot_columns_refuses_other_objects(slots: Any) -> None:
    tensor = _TensorRef(None, 0, (1,), (1,), False, "float32")
    columns = slots.slot_columns([tensor, tensor], _TensorRef)
    assert dict(zip(_TensorRef.__slots__, columns))["shape"] == [(1,), (1,)]
    with pytest.raises(TypeError):
        slots.slot_columns([tensor, "x"], _TensorRef)
    with pytest.raises(TypeError):
        slots.slot_columns(iter([tensor]), _TensorRef)
    with pytest.raises(AttributeError):  # a slot never set
        slots.slot_columns([object.__new__(_TensorRef)], _TensorRef)
    # fields_of: the same columns, through attrgetter where the classes differ
    assert _pickle.fields_of([tensor], _TensorRef, ("dtype", "shape")) == [["float32"], [(1,)]]
    other = Plain()
    other.a, other.b = 1, 2
    assert _pickle.fields_of([other], _TensorRef, ("a", "b")) == [[1], [2]]


def test_fields_of_without_the_compiled_part(monkeypatch) -> None:
    """The attrgetter path gives the C path's columns, one name or several (a single name
    is not a tuple of one: the keys '10' and '2' must not come back as '1' and '2')."""
    from ckptlab.format.layout import StorageInfo

    infos = [StorageInfo(str(i), f"r{i}", "float32", 4 * i, 64 * i, "cpu") for i in (10, 2, 33)]
    got = {}
    for built in (True, False):
        if not built:
            monkeypatch.setattr(_pickle, "_slot_columns", None)
        got[built] = (list(map(list, _pickle.fields_of(infos, StorageInfo, ("key",)))),
                      list(map(list, _pickle.fields_of(infos, StorageInfo, ("nbytes", "key")))))
    assert got[False] == ([["10", "2", "33"]], [[40, 8, 132], ["10", "2", "33"]])
    if _pickle._FastHandler is not None:  # (the compiled part is built)
        assert got[True] == got[False]


def test_slot_columns_holds_its_objects_while_a_collection_runs(slots: Any) -> None:
    """A finalizer run by a collection inside the call empties the list it was given: the
    columns are of the objects the list held when the call began."""
    import gc

    from ckptlab.format.layout import StorageInfo

    objects = [StorageInfo(str(i), "r", "float32", 4, 0, "cpu") for i in range(2000)]

    class Trap:
        other: Any = None

        def __del__(self) -> None:
            objects.clear()

    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        a, b = Trap(), Trap()
        a.other, b.other = b, a
        del a, b
        columns = slots.slot_columns(objects, StorageInfo)
    finally:
        gc.set_threshold(*threshold)
    assert columns[0] == [str(i) for i in range(2000)]
