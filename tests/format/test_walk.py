"""The object walk (``_pickle_walk.walk_tensors``): the compiled one (``_walk.c``) against the
Python one, on every shape of tree the interpreter builds and on scans of real pickles (whose
paths tests/format/test_interp.py and test_pickle_scan.py check against torch.load)."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.format import _pickle, _pickle_walk
from ckptlab.format._pickle import scan_pickle
from ckptlab.format._pickle_walk import MAX_DEPTH, _walk, walk_tensors
from ckptlab.format._tensor_refs import _CompositeRef, _PendingTensor, _TensorRef
from ckptlab.format._unpickle import Global, OpaqueKey, PickleDataError, Reduced


def compiled(root: Any, children: Any = _pickle_walk._children, max_depth: int = MAX_DEPTH,
             pending: type = _PendingTensor) -> Any:
    """The compiled walk with the rules passed in (the ones walk_tensors passes, or others)."""
    from ckptlab.format._interp import walk_tensors as c_walk

    return c_walk(root, _pickle_walk._WALK_KIND, _pickle_walk._walk_kind, pending, Reduced,
                  children, _pickle_walk._path_key, max_depth, _pickle_walk._too_deep)


@pytest.fixture
def c_walk() -> Any:
    pytest.importorskip("ckptlab.format._interp", reason="ckptlab built without C")
    return compiled


def _walk_python(root: Any) -> Any:
    return walk_tensors(root, "python")


def both(root: Any, c_walk: Any) -> Any:
    """The first pass both ways: equal found lists (the same tensor objects, equal paths)
    and the same container ids; or the same error."""
    def run(fn: Any) -> Any:
        try:
            found, holds = fn(root)
        except PickleDataError as exc:
            return ("error", str(exc))
        return ([(p, id(v)) for p, v in found], holds)

    c = run(lambda r: walk_tensors(r, "c"))
    python = run(_walk_python)
    assert c == python
    if c[0] != "error":  # paths of the same types too (True is not 1)
        c_paths = [tuple(map(type, p)) for p, _ in c[0]]
        assert c_paths == [tuple(map(type, p)) for p, _ in python[0]]
    return c


def tensor(pending: bool = False) -> Any:
    if pending:
        return _PendingTensor(False)
    return _TensorRef(None, 0, (2,), (1,), False, "float32")


def reduced(state: Any = None, args: tuple = (), pairs: Any = (), items: Any = ()) -> Reduced:
    obj = Reduced(Global("m", "C"), args)
    obj.state = state
    obj.pairs = list(pairs) or ()
    obj.items = list(items) or ()
    return obj


_keys = st.one_of(st.text(max_size=3), st.integers(-3, 3), st.integers(1 << 64, 1 << 70),
                  st.booleans(), st.none(), st.floats(allow_nan=False, width=16),
                  st.tuples(st.integers(0, 2)).map(OpaqueKey))


def _containers(inner: Any) -> Any:
    dicts = st.lists(st.tuples(_keys, inner), max_size=4).map(
        lambda kv: {(k.value if isinstance(k, OpaqueKey) else k): v for k, v in kv
                    if not isinstance(k, float) or k == k})
    return st.one_of(
        dicts, st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.lists(st.integers(0, 5), max_size=3).map(set),
        st.builds(reduced, state=st.one_of(st.none(), dicts, inner,
                                           st.tuples(dicts, dicts), st.tuples(inner, dicts)),
                  args=st.lists(inner, max_size=2).map(tuple),
                  pairs=st.lists(st.tuples(_keys, inner), max_size=2),
                  items=st.lists(inner, max_size=2)),
        st.builds(reduced, state=dicts))  # a module: its __dict__ alone


_trees = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3),
              st.builds(tensor, st.booleans()),
              st.builds(lambda: _CompositeRef("sparse_coo", "float32", (2,), []))),
    _containers, max_leaves=25)


@pytest.mark.slow  # 12 s (400 examples)
@settings(max_examples=400, deadline=None)
@given(root=_containers(_trees), share=st.booleans())
def test_the_compiled_walk_is_the_python_walk(c_walk: Any, root: Any, share: bool) -> None:
    if share:  # containers reachable twice: listed under their first path only
        root = [root, {"again": root}, (root,)]
    both(root, c_walk)


def test_shared_containers_cycles_and_pending_tensors(c_walk: Any) -> None:
    t, p = tensor(), tensor(pending=True)
    inner = {"w": t, "p": p}
    cyc: list[Any] = [inner]
    cyc.append(cyc)
    root = {"a": inner, "b": [inner, {"x": t}], "c": cyc, 5: (t,), (1 << 70): [t],
            True: {"t": t}, None: reduced({"k": t}, args=(t,))}
    found, holds = both(root, c_walk)
    assert [p for p, _ in found] == [("a", "w"), ("b", 1, "x"), (5, 0), (str(1 << 70), 0),
                                     (True, "t"), (None, "k"), (None, "args[0]")]
    assert id(root) in holds and id(cyc) not in holds


def test_nesting_past_the_limit_is_the_same_error(c_walk: Any) -> None:
    for depth, error in ((MAX_DEPTH - 1, False), (MAX_DEPTH, True), (3 * MAX_DEPTH, True)):
        root: Any = [tensor()]
        for _ in range(depth):
            root = [root]
        got = both(root, c_walk)
        assert (got[0] == "error") == error and (not error or "nested deeper" in got[1])


def test_records_read_through_their_attributes(c_walk: Any) -> None:
    """The walk reads a Reduced's and a pending tensor's attributes as Python does: a
    subclass's properties give what the Python walk gives."""
    class Odd(Reduced):
        __slots__ = ()

        @property  # type: ignore[misc]
        def state(self) -> Any:  # (a property of the subclass, not the slot)
            return {"hidden": tensor()}

        @state.setter
        def state(self, value: Any) -> None:
            pass

    odd = Odd(Global("m", "C"), ())
    done = _PendingTensor(False)
    done.pending = False  # a pending tensor BUILD filled: listed
    assert [p for p, _ in both([odd, tensor(pending=True), done], c_walk)[0]] \
        == [(0, "hidden"), (2,)]
    bare = object.__new__(Reduced)  # every slot unset: AttributeError both ways
    for walk in (_walk_python, compiled):
        with pytest.raises(AttributeError):
            walk([{"x": bare}])


def test_children_that_are_not_pairs_are_refused(c_walk: Any) -> None:
    with pytest.raises(TypeError, match="pairs"):
        compiled([{1, 2}], children=lambda obj: iter([1, 2]))
    with pytest.raises(PickleDataError, match="nested deeper"):
        compiled([], max_depth=0)
    from ckptlab.format._interp import walk_tensors as c_walk_raw

    with pytest.raises(TypeError):
        c_walk_raw([], _pickle_walk._WALK_KIND)
    with pytest.raises(TypeError):
        compiled([], pending=None)  # type: ignore[arg-type]


def _data_pkl(obj: Any, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=protocol)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("which", ["module", "optimizer", "mixed"])
def test_scans_of_real_pickles_agree(c_walk: Any, which: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Sequential(torch.nn.LayerNorm(3)))
    if which == "module":
        obj: Any = model
    elif which == "optimizer":
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
        obj = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    else:
        base = torch.arange(12.0)
        obj = {"views": [base[:4], base[4:]], "sparse": torch.eye(3).to_sparse(),
               "params": {i: torch.nn.Parameter(torch.ones(2)) for i in range(3)},
               "nested": ({"deep": [[base]]},), "set": {1, 2}}
    data = _data_pkl(obj)
    monkeypatch.setattr(_pickle, "_IMPL", "c")
    c = scan_pickle(data)
    monkeypatch.setattr(_pickle, "_IMPL", "python")
    python = scan_pickle(data)
    assert c.tensors == python.tensors and c.logical == python.logical
    assert list(c.objects) == list(python.objects)
    assert _walk(c.root)[0] and len(c.tensors) > 3
