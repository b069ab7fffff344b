"""The fast paths give what the one-by-one paths give: results, errors, offsets, budgets.

Large checkpoints are read by paths that do many records or tensors at once:

- the pickle interpreter takes torch's tensor rebuild (~28 opcodes) in one step
  (``_Machine.tensor_v2``; ``interpret(..., fast_paths=False)`` turns it off);
- the central directory, local headers, data descriptors and segments of archives with many
  records are parsed with numpy (``_zip.vectorise``; the thresholds are patched here to force
  either way);
- storage offsets use the numpy columns; tensor infos, records, segments and tensor entries
  are built column by column (``ckptlab.format._bulk.build``).

Each test runs the same input both ways, intact and mutated (flipped bytes, truncations,
memory budgets that run out at every point), and requires the same outcome: equal results,
or the same error type, message and offset.
"""

from __future__ import annotations

import dataclasses
import io
import random
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab import _torch_compat as tc
from ckptlab.errors import ArchiveError
from ckptlab.format import _pickle, _unpickle, _zip
from ckptlab.format._bulk import build, gc_paused
from ckptlab.format._pickle import _BUILDABLE, StateDict, torch_handlers
from ckptlab.format._unpickle import (
    Global,
    OpaqueKey,
    PickleDataError,
    Reduced,
    SharedEmptyChanged,
    interpret,
)
from ckptlab.format.layout import Segment, SegmentKind
from ckptlab.testing.compiled import require_compiled


def save(obj: Any, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def state(n: int) -> dict[str, Any]:
    """Dense tensors of every shape the template knows, views, Parameters, shared storages."""
    torch.manual_seed(0)
    base = torch.arange(64.0)
    out: dict[str, Any] = {}
    for i in range(n):
        kind = i % 8
        if kind == 0:
            out[f"layer.{i}.weight"] = torch.empty(2)
        elif kind == 1:
            out[f"layer.{i}.view"] = base[i % 7: i % 7 + 5]
        elif kind == 2:
            out[f"layer.{i}.param"] = torch.nn.Parameter(torch.zeros(3, 2))
        elif kind == 3:
            out[f"layer.{i}.scalar"] = torch.tensor(float(i))
        elif kind == 4:
            out[f"layer.{i}.big"] = torch.zeros(300, 2, dtype=torch.bfloat16)
        elif kind == 5:
            out[f"layer.{i}.nd"] = torch.zeros(1, 2, 1, 3, 1)
        elif kind == 6:
            out[f"layer.{i}.grad"] = torch.zeros(4, requires_grad=True)
        else:
            out[f"layer.{i}.t"] = base.view(8, 8).t()[:, i % 8]
    out["step"] = 7
    return out


def data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


# --------------------------------------------------------------------------------------------
# the pickle interpreter
# --------------------------------------------------------------------------------------------


def canon(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """A comparable rendering of an interpretation (shared objects and cycles by number)."""
    seen = {} if seen is None else seen
    if isinstance(obj, (str, bytes, int, float, bool, type(None), complex)):
        return obj
    if type(obj) is StateDict and not obj and getattr(obj, "attrs", None) is None:
        return ("StateDict", [], None)  # (the fast paths share those: interpret's shared_empty)
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    seen[id(obj)] = len(seen)
    kind = type(obj).__name__
    if isinstance(obj, Global):
        return ("global", obj.qualname)
    if isinstance(obj, OpaqueKey):
        return ("key", canon(obj.value, seen))
    if isinstance(obj, dict):
        items = [(canon(k, seen), canon(v, seen)) for k, v in obj.items()]
        return (kind, items, canon(getattr(obj, "attrs", None), seen))
    if isinstance(obj, (list, tuple)):
        return (kind, [canon(v, seen) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return (kind, sorted(repr(canon(v, seen)) for v in obj))
    if isinstance(obj, Reduced):
        return ("reduced", obj.func.qualname, canon(obj.args, seen), canon(obj.kwargs, seen),
                canon(obj.state, seen), canon(obj.items, seen), canon(obj.pairs, seen))
    if dataclasses.is_dataclass(obj):
        return (kind, [canon(getattr(obj, f.name), seen) for f in dataclasses.fields(obj)])
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
    return (kind, [(s, canon(getattr(obj, s, None), seen)) for s in slots if s != "__weakref__"])


def outcome(data: bytes, fast: bool, **kw: Any) -> Any:
    """The interpretation of ``data`` (or its error and offset), with the fast paths and
    torch's fused tensor handler as a scan uses them, or without any."""
    return outcome_batched(data, "fused" if fast else "slow", **kw)


def scan_like(data: bytes, fast: bool, kw: dict[str, Any], fused: bool = True,
              batch: bool = False) -> tuple[Any, Any]:
    """``interpret`` as ``_pickle._scan`` calls it (with ``fast``: the fused handlers and a
    shared empty OrderedDict, again without it where the pickle changes it): handlers and
    result."""
    for share in (True, False) if fast else (False,):
        handlers, table = torch_handlers()
        given = dict(kw)
        if fast and fused:
            given.setdefault("fused_tensor_v2", handlers.fused_v2)
        if fast and batch:
            given.setdefault("fused_tensor_v2_batch", handlers.fused_v2_batch)
        if share:
            given.setdefault("shared_empty", StateDict())
        try:
            return handlers, interpret(data, handlers=table,
                                       persistent_load=handlers.persistent_load,
                                       buildable=_BUILDABLE, fast_paths=fast, **given)
        except SharedEmptyChanged:
            assert share
    raise AssertionError("unreachable")


def both(data: bytes, **kw: Any) -> Any:
    fast, slow = outcome(data, True, **kw), outcome(data, False, **kw)
    assert fast == slow
    return fast


@pytest.fixture(scope="module")
def pickles() -> dict[str, bytes]:
    out = {f"p{p}": data_pkl(save(state(400), p)) for p in (2, 3, 4)}
    out["small"] = data_pkl(save(state(24)))  # memo indices below 256: BINPUT/BINGET
    out["params"] = data_pkl(save({"m": torch.nn.Linear(3, 2).state_dict(),
                                   "p": [torch.nn.Parameter(torch.ones(2))] * 3}))
    return out


def test_intact_pickles_agree_and_take_the_fast_path(pickles, monkeypatch) -> None:
    calls = {"fast": 0}
    original = _unpickle._Machine.tensor_v2

    def counted(self: Any, *args: Any) -> Any:
        done = original(self, *args)
        calls["fast"] += done is not None
        return done

    monkeypatch.setattr(_unpickle._Machine, "tensor_v2", counted)
    for name, data in pickles.items():
        assert both(data)[0] != "error", name
    assert calls["fast"] > 700  # most tensors of protocols 2 and 3 went through it


@pytest.mark.slow  # 23 s (durations, 2 busy cores)
def test_flipped_bytes_agree(pickles) -> None:
    rng = random.Random(1)
    for name in ("p2", "small"):
        data = pickles[name]
        for _ in range(400):
            mutated = bytearray(data)
            for _ in range(rng.choice((1, 1, 2, 3))):
                at = rng.randrange(len(mutated))
                mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, 0x71, 0x72,
                                          0x68, 0x6A, 0x4B, 0x4D, 0x4A, 0x28, 0x74, 0x52))
            both(bytes(mutated))


def test_truncations_agree(pickles) -> None:
    data = pickles["p2"]
    for cut in range(0, len(data), max(1, len(data) // 300)):
        assert both(data[:cut])[0] == "error"


def budget_errors(data: bytes, agree: Any, monkeypatch: pytest.MonkeyPatch, stop: int,
                  step: int) -> set[int]:
    """The offsets where memory budgets (the floor alone, 0 to ``stop``) run out, each
    outcome agreeing all ways (``agree``); every error is a budget error."""
    errors = set()
    for budget in range(0, stop, step):
        monkeypatch.setattr(_unpickle, "MEMORY_FLOOR", budget)
        got = agree(data, memory_per_byte=0)
        if got[0] == "error":
            assert got[1] == "PickleBudgetError", got
            errors.add(got[3])
    return errors


def test_budgets_running_out_anywhere_agree(pickles, monkeypatch) -> None:
    """Budgets (the floor alone) that run out at a different opcode each: inside a tensor, the
    fast path must leave it to the loop to say where, and leave the same budget after it."""
    assert len(budget_errors(pickles["p2"], both, monkeypatch, 700_000, 2_999)) > 150


@pytest.mark.slow  # 17 s
def test_memo_games_agree() -> None:
    """BINGETs of indices the template itself stores, and BINPUTs out of order or over old
    entries, are left to the loop."""
    data = bytearray(data_pkl(save({f"k{i}": torch.zeros(2) for i in range(300)})))
    rng = random.Random(2)
    puts = [i for i in range(len(data) - 5) if data[i] == 0x72 and i > len(data) // 2]
    for _ in range(200):
        mutated = bytearray(data)
        at = rng.choice(puts)
        index = int.from_bytes(mutated[at + 1:at + 5], "little")
        mutated[at + 1:at + 5] = max(0, index + rng.choice((-9, -2, -1, 1, 2, 5000))).to_bytes(
            4, "little")
        both(bytes(mutated))


def module_pickle(protocol: int = 2) -> bytes:
    """A whole ``nn.Module`` pickled (``torch.save(model)``): a dozen empty hook
    ``OrderedDict()`` calls per module, Parameters, a module-level ``set()``."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
                                  for _ in range(6)])
    return data_pkl(save(model, protocol))


def count_identical(root: Any, target: Any) -> int:
    """How many times ``target`` itself is a value in the containers and records under root."""
    count, todo, seen = 0, [root], set()
    while todo:
        obj = todo.pop()
        if obj is target:
            count += 1
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, Reduced):
            todo.extend((obj.args, obj.state, obj.items, obj.pairs))
        elif isinstance(obj, _pickle._TensorRef):
            todo.append(obj.attrs)
    return count


@pytest.mark.slow  # 11 s
def test_module_pickles_agree_and_take_the_hook_dict_path(monkeypatch) -> None:
    """``OrderedDict()`` (BINGET of the global, EMPTY_TUPLE, REDUCE) is taken at once: the
    same objects, memo, budget and error offsets as one opcode at a time. The empty hook
    dicts are all the shared one (interpret's ``shared_empty``); the dicts filled at once
    (``_parameters``: a MARK after the BINPUT) are new."""
    from ckptlab.format._pickle import _TorchHandlers

    calls = {"n": 0}

    def counted() -> Any:
        calls["n"] += 1
        return StateDict()

    monkeypatch.setattr(_TorchHandlers.ordered_dict, "ckptlab_no_args", counted)
    for protocol in (2, 4):
        data = module_pickle(protocol)
        assert both(data)[0] != "error"
        shared = StateDict()
        calls["n"] = 0
        _, result = scan_like(data, True, {"shared_empty": shared})
        assert count_identical(result.root, shared) >= 6 * 3 * 10  # 18 modules' hook dicts
        assert calls["n"] == 0  # (torch pickles _parameters, _buffers, _modules as dicts)
        assert not shared and getattr(shared, "attrs", None) is None
        # a state dict's _metadata OrderedDict gets its item by SETITEM: the shared one is
        # copied then (a new one made), and stays empty
        data = data_pkl(save(torch.nn.Linear(2, 3).state_dict(), protocol))
        assert both(data)[0] != "error"
        calls["n"] = 0
        _, result = scan_like(data, True, {"shared_empty": shared})
        assert calls["n"] == 1 and type(result.root) is StateDict and len(result.root) == 2
        assert list(result.root.attrs["_metadata"]) == [""] and not shared
    data = module_pickle()
    rng = random.Random(5)
    for _ in range(300):
        mutated = bytearray(data)
        at = rng.randrange(len(mutated))
        mutated[at] = rng.choice((rng.randrange(256), 0x29, 0x52, 0x68, 0x71, 0x2E))
        both(bytes(mutated))
    for cut in range(0, len(data), max(1, len(data) // 200)):
        assert both(data[:cut])[0] == "error"
    assert len(budget_errors(data, both, monkeypatch, 400_000, 997)) > 100


# the plain opcodes many at a time (ckptlab.format._entries.opcodes): what run() leaves to it


@pytest.fixture(params=["compiled", "none"])
def plain_opcodes(request: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The compiled plain-opcode runner, counting the opcodes it did (``"none"``: a build
    without it, every opcode one at a time in run())."""
    if request.param == "none":
        monkeypatch.setattr(_unpickle, "_c_opcodes", None)
        return None
    runner = require_compiled(_unpickle._c_opcodes)
    done = {"calls": 0, "advanced": 0, "bytes": 0}

    def counted(data: Any, pos: int, *args: Any) -> Any:
        got = runner(data, pos, *args)
        done["calls"] += 1
        done["advanced"] += got[0] > pos
        done["bytes"] += max(0, got[0] - max(pos, 0))
        return got

    monkeypatch.setattr(_unpickle, "_c_opcodes", counted)
    return done


_plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner) | st.tuples(inner, inner)
    | st.tuples(inner, inner, inner) | st.lists(inner, min_size=4, max_size=6).map(tuple)
    | st.dictionaries(st.text(max_size=4), inner, max_size=5)
    | st.dictionaries(st.integers(-3, 300), inner, max_size=3),
    max_leaves=30)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=_plain_values, protocol=st.integers(0, 5), shared=st.booleans())
def test_plain_objects_agree(plain_opcodes, obj, protocol, shared) -> None:
    """Any tree of plain values (shared ones too: memo BINGETs), every protocol: the same
    objects, memo and budget, run one way or the other."""
    import pickle

    data = pickle.dumps([obj, obj] if shared else obj, protocol)
    assert both(data)[0] != "error"


def test_plain_opcodes_agree_on_mutations_truncations_and_budgets(plain_opcodes,
                                                                  monkeypatch) -> None:
    import pickle

    obj = {"a": [1, 2.5, None, True, (3, "x"), {"k": [(), {}, []]}] * 6,
           "b": {i: (i, -i, i << 20) for i in range(30)}, "c": ("s",) * 4}
    for protocol in (2, 4):
        data = pickle.dumps([obj, obj["a"]], protocol)
        assert both(data)[0] != "error"
        rng = random.Random(protocol)
        for _ in range(300):
            mutated = bytearray(data)
            for _ in range(rng.choice((1, 1, 2))):
                at = rng.randrange(len(mutated))
                mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, 0x71, 0x72,
                                          0x68, 0x6A, 0x28, 0x74, 0x75, 0x85, 0x86, 0x87, 0x29,
                                          0x7D, 0x5D, 0x4E, 0x2E, 0x94, 0x65))
            both(bytes(mutated))
        for cut in range(0, len(data), max(1, len(data) // 150)):
            assert both(data[:cut])[0] == "error"
        assert len(budget_errors(data, both, monkeypatch, 40_000, 97)) > 50
    if plain_opcodes is not None:
        assert plain_opcodes["advanced"] > 100


def test_module_pickles_go_through_the_plain_opcodes(plain_opcodes) -> None:
    data = module_pickle()
    got = both(data)
    assert got[0] != "error"
    if plain_opcodes is not None:
        # the runner does the modules' calls too (NEWOBJ, BUILD, REDUCE, BINPERSID) and
        # their keys: what the loop still does is each tensor, at its rebuild's BINGET
        assert plain_opcodes["bytes"] > len(data) * 0.9  # tensors included


def test_budgets_of_any_size_or_type_agree() -> None:
    """A budget C cannot hold (``memory_per_byte`` is the caller's: a huge int, a float):
    the plain opcodes go one at a time, with the same outcome."""
    data = module_pickle()
    for per_byte in (1 << 62, float("inf"), 64.5):
        assert both(data, memory_per_byte=per_byte)[0] != "error"


def test_an_error_raised_in_the_plain_opcodes_is_reported_where_the_loop_reports_it(
        monkeypatch) -> None:
    """An OrderedDict handler that raises (here on its fifth call): the same error at the
    same offset (its BINGET), with the runner and without it (each OrderedDict() its own:
    no shared_empty)."""
    from ckptlab.format._pickle import StateDict, _TorchHandlers

    data = module_pickle()

    def got(runner: Any) -> Any:
        calls = []

        def fifth() -> Any:
            calls.append(1)
            if len(calls) == 5:
                raise PickleDataError("the fifth")
            return StateDict()

        with monkeypatch.context() as m:
            m.setattr(_TorchHandlers.ordered_dict, "ckptlab_no_args", fifth)
            m.setattr(_unpickle, "_c_opcodes", runner)
            return outcome(data, True, shared_empty=None)

    with_runner, without = got(_unpickle._c_opcodes), got(None)
    assert with_runner == without and with_runner[0] == "error"
    assert data[with_runner[3]] in (0x68, 0x6A)  # (the BINGET of OrderedDict)


def test_module_pickles_agree_on_mutations_truncations_and_budgets(plain_opcodes,
                                                                   monkeypatch) -> None:
    """The runner's calls (REDUCE, NEWOBJ, BUILD, BINPERSID) and keys (BINUNICODE) on broken
    module pickles: the same objects or the same error at the same offset as the loop, and
    budgets that run out at the same opcodes."""
    data = module_pickle()
    rng = random.Random(5)
    for _ in range(400):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2))):
            at = rng.randrange(len(mutated))
            mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, 0x52, 0x81, 0x62,
                                      0x51, 0x58, 0x68, 0x71, 0x28, 0x74, 0x29, 0x7D, 0x2E))
        both(bytes(mutated))
    for cut in range(0, len(data), max(1, len(data) // 200)):
        assert both(data[:cut])[0] == "error"
    assert len(budget_errors(data, both, monkeypatch, 60_000, 211)) > 100


# --------------------------------------------------------------------------------------------
# the shared empty OrderedDict (interpret's shared_empty)
# --------------------------------------------------------------------------------------------

_ODICT_GLOBAL = b"\x80\x02ccollections\nOrderedDict\nq\x000"  # PROTO, GLOBAL, BINPUT 0, POP
_ODICT = b"h\x00)R"  # BINGET 0, EMPTY_TUPLE, REDUCE: OrderedDict()


# (D,) given to a torch function that returns D: GLOBAL, OrderedDict() D, TUPLE1, BINPUT 2,
# REDUCE
_GIVEN_BACK = b"ctorch._utils\n%s\nq\x01" + _ODICT + b"\x85q\x02R"


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def shared_run(data: bytes) -> tuple[Any, StateDict, str]:
    """``data`` interpreted with a shared empty OrderedDict: the result (or the error), the
    shared dict, and ``"shared"`` or ``"again"`` (SharedEmptyChanged: a scan interprets it
    again without one)."""
    handlers, table = torch_handlers()
    shared = StateDict()
    try:
        result: Any = interpret(data, handlers=table, buildable=_BUILDABLE,
                                persistent_load=handlers.persistent_load, shared_empty=shared)
    except SharedEmptyChanged:
        return None, shared, "again"
    except PickleDataError as exc:
        result = exc
    return result, shared, "shared"


@pytest.mark.parametrize("runner", ["compiled", "loop"])
@pytest.mark.parametrize(("name", "body", "ends"), [
    # hook dicts as values, never touched again: all the shared one
    ("values", b"}q\x01(" + _text("a") + _ODICT + b"q\x02" + _text("b") + _ODICT + b"q\x03u",
     "shared"),
    # _metadata: OrderedDict() then SETITEM into it: copied, the copy filled
    ("setitem", _ODICT + b"q\x01" + _text("k") + b"K\x01s", "shared"),
    # an empty state dict with its _metadata: BUILD of it, copied
    ("build", _ODICT + b"q\x01}q\x02" + _text("_metadata") + b"K\x01sb", "shared"),
    # SETITEMS into it, without a MARK right after its BINPUT: copied
    ("setitems", _ODICT + b"q\x01]0(" + _text("a") + b"K\x01u", "shared"),
    # read back: one dict in two places (then changed through one of them)
    ("binget", b"](" + _ODICT + b"q\x01h\x01e", "again"),
    ("binget-setitem", b"](" + _ODICT + b"q\x01h\x01" + _text("k") + b"K\x01se", "again"),
    ("dup", _ODICT + b"q\x012" + _text("k") + b"K\x01s\x86", "again"),
    # an error after the copy: the error, as without the shared dict
    ("error", _ODICT + b"q\x01" + _text("k") + b"K\x01sK\x02s", "shared"),
    # a handler that gives back its argument (a Parameter of a non-tensor, a device tensor)
    # brings it back onto the stack while an args tuple holds it: changing the copy there
    # would not change it in the tuple
    ("given-back", _GIVEN_BACK % b"_rebuild_parameter" + _text("k") + b"K\x01sh\x02\x86",
     "again"),
    ("given-back-build", _GIVEN_BACK % b"_rebuild_device_tensor_from_cpu_tensor" +
     b"}" + _text("_metadata") + b"K\x01sbh\x02\x86", "again"),
])
def test_the_shared_empty_ordered_dict_is_what_a_new_one_each_gives(
        name: str, body: bytes, ends: str, runner: str, monkeypatch) -> None:
    """Every pickle interprets to what it does with a new OrderedDict each (``canon`` sees
    an empty StateDict as a value): where the shared one is changed it is copied first,
    where it is read back from the memo (or DUP) the run ends (a scan runs it again)."""
    if runner == "loop":
        monkeypatch.setattr(_unpickle, "_c_opcodes", None)
    elif _unpickle._c_opcodes is None:
        pytest.skip("ckptlab.format._entries is not built")
    data = _ODICT_GLOBAL + body + b"."
    result, shared, how = shared_run(data)
    assert how == ends, name
    assert not shared and getattr(shared, "attrs", None) is None
    assert isinstance(result, Exception) == (name == "error")
    if how == "shared" and name != "error":
        assert outcome(data, True)[0] == canon(result.root)
    assert both(data)[0] == outcome(data, False)[0]
    if name == "values":
        assert result.root["a"] is result.root["b"] is shared
    if name in ("setitem", "build"):
        assert result.root is not shared


def test_a_persistent_load_giving_back_the_shared_dict_ends_the_run() -> None:
    data = _ODICT_GLOBAL + _ODICT + b"Q."  # BINPERSID of OrderedDict()
    table = torch_handlers()[1]
    with pytest.raises(SharedEmptyChanged):
        interpret(data, handlers=table, persistent_load=lambda pid: pid,
                  shared_empty=StateDict())
    root = interpret(data, handlers=table, persistent_load=lambda pid: pid).root
    assert type(root) is StateDict and not root


def test_random_programs_over_shared_empty_ordered_dicts_agree() -> None:
    """Random opcode programs over ``OrderedDict()`` values (memo puts and gets, SETITEM(S),
    BUILD, DUP, lists, tuples): the same result or error with the shared dict as with a new
    one each, with the runner and without it."""
    rng = random.Random(11)
    ops = [_ODICT, _ODICT, _ODICT + b"q", _ODICT + b"r", b"h", b"2", b"(", b"s", b"u", b"b",
           b"e", b"a", b"]", b"}", b"K\x01", _text("k"), _text("m"), b"\x85", b"\x86", b"0"]
    for _ in range(3000):
        puts = 1
        body = bytearray()
        for _ in range(rng.randrange(1, 14)):
            op = rng.choice(ops)
            if op.endswith(b"R" + b"q") or op == _ODICT + b"q":
                op = op + bytes([puts])
                puts += 1
            elif op.endswith(b"Rr"):
                op = op + puts.to_bytes(4, "little")
                puts += 1
            elif op == b"h":
                op = b"h" + bytes([rng.randrange(puts + 1)])
            body += op
        data = _ODICT_GLOBAL + bytes(body) + b"."
        both(data)
        result, shared, _ = shared_run(data)
        assert not shared and getattr(shared, "attrs", None) is None
    # ... and well formed ones: a dict of values, each an OrderedDict() (put or not), one
    # read back, or one changed at once or later through the memo
    taken = {"shared": 0, "again": 0}
    for _ in range(1500):
        puts, body = 1, bytearray(b"}(")
        for i in range(rng.randrange(1, 8)):
            body += _text(f"k{i}")
            kind = rng.randrange(6)
            if kind == 4 and puts > 1:
                body += b"h" + bytes([rng.randrange(1, puts)])  # one read back
                continue
            body += _ODICT
            if rng.random() < 0.8:
                body += b"q" + bytes([puts])
                puts += 1
            if kind == 1:  # a SETITEM into it (as _metadata)
                body += _text("v") + b"K\x02s"
            elif kind == 2:  # a BUILD of it
                body += b"}" + _text("_metadata") + b"K\x03sb"
            elif kind == 3:  # items by SETITEMS
                body += b"(" + _text("a") + b"K\x04" + _text("b") + b"]u"
        body += b"u"
        if puts > 1 and rng.random() < 0.3:  # a dict changed later, through the memo
            body += b"h" + bytes([rng.randrange(1, puts)]) + _text("late") + b"K\x05s0"
        data = _ODICT_GLOBAL + bytes(body) + b"."
        fast = both(data)
        result, shared, how = shared_run(data)
        assert not isinstance(result, Exception) and fast[0] != "error"
        assert not shared and getattr(shared, "attrs", None) is None
        taken[how] += 1
    assert min(taken.values()) > 300, taken


@pytest.mark.parametrize("what", ["set", "persistent", "build", "parameter", "fused"])
def test_a_call_that_raises_in_the_runner_is_reported_where_the_loop_reports_it(
        what: str, monkeypatch) -> None:
    """A handler, ``persistent_load`` or the fused tensor handler that raises on its third
    call, or a second BUILD of a module: the same error at the same offset (its REDUCE /
    BINPERSID / BINGET / BUILD), with the runner and without it."""
    from ckptlab.format._pickle import _BUILDABLE as buildable
    from ckptlab.format._pickle import _TorchHandlers

    data = module_pickle()
    if what == "build":  # a second BUILD of the third module built: build() refuses it
        import pickletools

        third_build = [pos for op, _, pos in pickletools.genops(data) if op.name == "BUILD"][2]
        data = data[:third_build + 1] + b"}b" + data[third_build + 1:]

    def third(fn: Any) -> Any:
        calls = []

        def wrapped(*args: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise PickleDataError(f"the third {what}")
            return fn(*args)
        return wrapped

    def got(runner: Any) -> Any:
        handlers, table = torch_handlers()
        load = handlers.persistent_load
        if what == "set":  # (protocol 2 names it __builtin__.set)
            table[("__builtin__", "set")] = third(table[("__builtin__", "set")])
        elif what == "parameter":  # not batchable: each goes through REDUCE
            table[("torch._utils", "_rebuild_parameter")] = third(
                _TorchHandlers.rebuild_parameter)
        elif what == "persistent":
            load = third(load)
        fused = third(handlers.fused_v2) if what == "fused" else None
        with monkeypatch.context() as m:
            m.setattr(_unpickle, "_c_opcodes", runner)
            try:
                interpret(data, handlers=table, persistent_load=load, buildable=buildable,
                          fused_tensor_v2=fused)
            except PickleDataError as exc:
                return str(exc), _unpickle.failure_offset(exc)
        raise AssertionError("no error")

    with_runner, without = got(_unpickle._c_opcodes), got(None)
    assert with_runner == without
    assert ("BUILD applied twice" if what == "build" else f"the third {what}") in with_runner[0]
    assert data[with_runner[1]] == {"set": 0x52, "parameter": 0x52, "persistent": 0x51,
                                    "build": 0x62, "fused": 0x68}[what]  # (fused: at the
    # BINGET of _rebuild_tensor_v2, where the fast path starts)


def _second_tensor(puts: list[bytes]) -> bytes:
    """A list of two tensors, written by hand: the first as torch writes it (memo 0-12), the
    second with the BINPUTs given (or b"" for none)."""
    first = (b"\x80\x02]q\x00(ctorch._utils\n_rebuild_tensor_v2\nq\x01((X\x07\x00\x00\x00"
             b"storageq\x02ctorch\nFloatStorage\nq\x03X\x01\x00\x00\x000q\x04X\x03\x00\x00"
             b"\x00cpuq\x05K\x02tq\x06QK\x00K\x02\x85q\x07K\x01\x85q\x08\x89"
             b"ccollections\nOrderedDict\nq\x09)Rq\x0atq\x0bRq\x0c")
    p = iter(puts)
    second = (b"h\x01((h\x02h\x03X\x01\x00\x00\x009" + next(p) + b"h\x05K\x04t" + next(p)
              + b"QK\x00K\x04\x85" + next(p) + b"K\x01\x85" + next(p) + b"\x89h\x09)R"
              + next(p) + b"t" + next(p) + b"R" + next(p))
    return first + second + b"e."


@pytest.mark.parametrize("puts", ["short", "long", "mixed", "none"])
def test_a_tensor_is_taken_at_once_only_as_tensor_v2_takes_it(puts: str) -> None:
    """The runner rebuilds a tensor at once only where ``tensor_v2`` would (its BINPUTs all
    short or all long), so the same callables run: a ``persistent_load`` that refuses the
    second tensor's storage is called, and raises at the same offset, both ways. A tensor
    with no BINPUT at all is no error (it was a raw KeyError in tensor_v2)."""
    short = [bytes([0x71, 13 + i]) for i in range(7)]
    long_ = [b"r" + (13 + i).to_bytes(4, "little") for i in range(7)]
    data = _second_tensor({"short": short, "long": long_, "none": [b""] * 7,
                           "mixed": [short[0], long_[1], *short[2:]]}[puts])

    def run(runner: Any, refuse: bool) -> Any:
        handlers, table = torch_handlers()
        calls = []

        def load(pid: Any) -> Any:
            calls.append(pid[2])
            if refuse and pid[2] == "9":
                raise PickleDataError("refused storage 9")
            return handlers.persistent_load(pid)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(_unpickle, "_c_opcodes", runner)
            try:
                got = interpret(data, handlers=table, persistent_load=load,
                                buildable=_BUILDABLE, fused_tensor_v2=handlers.fused_v2)
            except PickleDataError as exc:
                return str(exc), _unpickle.failure_offset(exc), calls
        return canon(got.root), calls

    for refuse in (False, True):
        assert run(_unpickle._c_opcodes, refuse) == run(None, refuse), (puts, refuse)
    assert both(data)[0] != "error"
    from ckptlab.format._pickle import scan_pickle

    assert [t.shape for t in scan_pickle(data).tensors] == [(2,), (4,)]


def test_module_values_are_listed_when_first_looked_at(tmp_path: Path) -> None:
    """A pickled module's values (flags, hook dicts) are named on first use, and are what
    the walk over every container gives."""
    from ckptlab.format._bulk import LazyTuple
    from ckptlab.format._pickle import scan_pickle

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    scan = scan_pickle(data_pkl(save(model)))
    assert isinstance(scan.objects, LazyTuple) and not scan.objects.built
    values = dict(scan.objects)
    first, second = ("_modules", "0"), ("_modules", "1")
    assert values[(*first, "training")] is True and values[(*second, "eps")] == 1e-5
    assert values[(*first, "_forward_hooks")] == {} and (*first, "in_features") in values
    assert [t.path[1:] for t in scan.tensors] == [
        ("0", "_parameters", "weight"), ("0", "_parameters", "bias"),
        ("1", "_parameters", "weight"), ("1", "_parameters", "bias"),
        ("1", "_buffers", "running_mean"), ("1", "_buffers", "running_var"),
        ("1", "_buffers", "num_batches_tracked")]
    path = tmp_path / "m.pt"
    torch.save(model, path)
    ck = ckptlab.open(path)
    assert ck.objects["_modules.0.in_features"] == 2 and ck.objects["_modules.1.training"]
    assert len(ck.objects) == len(values)


# --------------------------------------------------------------------------------------------
# archives: numpy columns vs record by record
# --------------------------------------------------------------------------------------------


def run(fn: Any, source: Any, vectorise: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(_zip, "VECTOR_MIN_ENTRIES", 0 if vectorise else 1 << 60)
    monkeypatch.setattr(_zip, "VECTOR_ALWAYS_ENTRIES", 0 if vectorise else 1 << 60)
    try:
        got = fn(source)
    except ArchiveError as exc:
        return ("error", type(exc).__name__, str(exc), exc.offset, exc.record)
    return ("ok", (got, got.logical, got.objects) if hasattr(got, "logical") else got)


def agree(fn: Any, source: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    fast = run(fn, source, True, monkeypatch)
    slow = run(fn, source, False, monkeypatch)
    assert fast == slow
    return fast


def opened(source: Any) -> Any:
    ck = ckptlab.open(source)
    return list(ck.tensors.items()), ck.objects, ck.files


FUNCTIONS = (ckptlab.inspect, ckptlab.storage_offsets,
             lambda s: ckptlab.storage_offsets(s, scan=True), opened)


@pytest.fixture(scope="module")
def archive() -> bytes:
    return save(state(300))


def test_intact_archives_agree(archive, tmp_path, monkeypatch) -> None:
    from torch.utils.serialization import config

    path = tmp_path / "a.pt"
    path.write_bytes(archive)
    for fn in FUNCTIONS:
        assert agree(fn, path, monkeypatch)[0] != "error"
    for alignment in (1, 4096):  # padding fields of every size, and none
        with config.patch({"save.storage_alignment": alignment}):
            torch.save(state(200), tmp_path / f"{alignment}.pt")
        for fn in FUNCTIONS:
            agree(fn, tmp_path / f"{alignment}.pt", monkeypatch)


@pytest.mark.slow  # 13 s
def test_mutated_archives_agree(archive, monkeypatch) -> None:
    """Flipped bytes in local headers, names, extra fields, descriptors, the central directory
    and the trailer; each function both ways."""
    rng = random.Random(3)
    cd = archive.rfind(b"PK\x01\x02") - 46 * 300  # roughly where the directory starts
    spots = [i for i in range(len(archive) - 4) if archive[i:i + 4] in (
        b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02")]
    for trial in range(240):
        mutated = bytearray(archive)
        if trial % 3 == 0:
            at = rng.choice(spots) + rng.randrange(46)
        elif trial % 3 == 1:
            at = rng.randrange(max(0, cd), len(archive))
        else:
            at = rng.randrange(len(archive))
        at = min(at, len(mutated) - 1)
        mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 0x20, mutated[at] ^ 1, 0xFF))
        for fn in FUNCTIONS[:3] if trial % 4 else FUNCTIONS:
            agree(fn, bytes(mutated), monkeypatch)


def test_truncated_archives_agree(archive, monkeypatch) -> None:
    for cut in range(0, len(archive), len(archive) // 40):
        for fn in FUNCTIONS[:2]:
            assert agree(fn, archive[:cut], monkeypatch)[0] == "error"


def test_gaps_and_foreign_extra_fields_agree(tmp_path, monkeypatch) -> None:
    """A zip written by Python's zipfile (no padding field, no descriptors) with bytes between
    records and an extra field of its own on some records."""
    import zipfile

    source = io.BytesIO(save(state(150)))
    out = io.BytesIO()
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w") as dst:
        for i, info in enumerate(src.infolist()):
            new = zipfile.ZipInfo(info.filename)
            if i % 7 == 3:
                new.extra = b"\xfe\xca\x04\x00abcd"
            dst.writestr(new, src.read(info.filename))
            if i % 11 == 5:
                dst.fp.write(b"gap!")  # unaccounted bytes between records
                dst.start_dir = dst.fp.tell()
    for fn in FUNCTIONS:
        agree(fn, out.getvalue(), monkeypatch)


# --------------------------------------------------------------------------------------------
# the builders
# --------------------------------------------------------------------------------------------


def test_build_makes_ordinary_instances() -> None:
    from itertools import repeat

    made = build(Segment, 3, repeat(SegmentKind.DATA), [1, 2, 3], [4, 5, 6])
    assert made == [Segment(SegmentKind.DATA, i, i + 3) for i in (1, 2, 3)]
    assert all(type(s) is Segment and s.record is None for s in made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].offset = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        build(Segment, 1, [SegmentKind.DATA])  # offset has no default
    with pytest.raises(ValueError):
        build(Segment, 2, [SegmentKind.DATA] * 2, [1], [1, 2])


def test_gc_pause_nests_and_restores() -> None:
    import gc

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0  # the young objects were handed on, nothing left frozen
    held = [[i] for i in range(100)]
    gc.freeze()  # someone else's frozen objects (a server before fork) stay frozen
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            more = [[i] for i in range(100)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()
    del held, more


def test_large_checkpoint_round_trip(tmp_path: Path) -> None:
    """10,000 tensors: the numpy paths by default; every tensor reads back as torch loads it."""
    sd = {f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(10_000)}
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    layout = ckptlab.inspect(path)
    assert len(layout.records) == 10_006 and len(layout.tensors) == 10_000
    ck = ckptlab.open(path)
    for name in ("layer.0.weight", "layer.4321.weight", "layer.9999.weight"):
        assert torch.equal(ck.read(name), sd[name])
    offsets = ckptlab.storage_offsets(path)
    assert offsets.method == "cursor" and offsets.reads <= 3
    reader = tc.pytorch_file_reader()(str(path))
    assert offsets.offsets == {n[5:]: reader.get_record_offset(n)
                               for n in reader.get_all_records() if n.startswith("data/")}


# --------------------------------------------------------------------------------------------
# state dict entries in batches (_Machine.entry_run, with the fused torch handlers)
# --------------------------------------------------------------------------------------------



def outcome_batched(data: bytes, mode: str, **kw: Any) -> Any:
    """:func:`outcome` with torch's fused handlers (``"batch"``: in batches too)."""
    try:
        handlers, result = scan_like(data, mode != "slow", kw, fused=mode != "fast",
                                     batch=mode == "batch")
    except PickleDataError as exc:  # messages may show objects: not where they live
        return ("error", type(exc).__name__, re.sub(" at 0x[0-9a-f]+", "", str(exc)),
                _unpickle.failure_offset(exc))
    return (canon(result.root), result.end, result.protocol, result.globals,
            canon([handlers.storages[k] for k in handlers.storage_order]))


@pytest.fixture(params=["patterns", "compiled"])
def scanner(request: Any) -> str:
    """Which walk locates a batch's entries: the regular expressions (``_ENTRY_V2``,
    ``_EntrySpec``) or the compiled scanner (``ckptlab.format._entries``, built by setup.py
    where a C compiler is at hand; under CI it must be)."""
    if request.param == "compiled":
        require_compiled(_unpickle._c_entries)
    return str(request.param)


class _Batches:
    """Small batches from the first byte on, counting the batches taken; ``scanner`` says
    which walk locates them (the patterns unless told: :func:`scanner`)."""

    def __init__(self, monkeypatch: Any, batch: int = 5, pause: int = 4,
                 spec_min: int = 2, scanner: str = "patterns") -> None:
        if scanner == "patterns":  # (a build without the compiled part)
            monkeypatch.setattr(_unpickle, "_c_entries", None)
            monkeypatch.setattr(_unpickle, "_c_units", None)
            monkeypatch.setattr(_unpickle, "_c_opcodes", None)
            monkeypatch.setattr(_pickle, "_c_walk", None)
        monkeypatch.setattr(_unpickle, "BULK_MIN_NBYTES", 0)
        monkeypatch.setattr(_unpickle, "BULK_BATCH", batch)
        monkeypatch.setattr(_unpickle, "BULK_PAUSE", pause)
        monkeypatch.setattr(_unpickle, "_SPEC_MIN", spec_min)
        self.taken = 0
        self.specialised = 0  # batches taken through specialised patterns (_EntrySpec)
        self.shapes = 0  # ... of entries of several shapes
        original = _unpickle._Machine.entry_run
        spec = _unpickle._EntrySpec
        seen: list[str] = []

        def noting(name: str) -> Any:
            method = getattr(spec, name)

            def noted(*args: Any) -> Any:
                seen.append(name)
                return method(*args)
            return noted

        for name in ("values",):
            monkeypatch.setattr(spec, name, noting(name))

        def counted(machine: Any, *args: Any) -> Any:
            seen.clear()
            done = original(machine, *args)
            self.taken += type(done) is tuple
            self.specialised += type(done) is tuple and bool(seen)
            self.shapes += type(done) is tuple and seen.count("values") > 1
            return done

        monkeypatch.setattr(_unpickle._Machine, "entry_run", counted)


def all_ways(data: bytes, **kw: Any) -> Any:
    slow = outcome_batched(data, "slow", **kw)
    assert outcome_batched(data, "fused", **kw) == slow
    assert outcome_batched(data, "batch", **kw) == slow
    return slow


def plain_run(n: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {f"model.layers.{i}.weight": torch.zeros(2 + i % 3, dtype=dtype) for i in range(n)}


def uniform_run(n: int, shape: tuple[int, ...] = (2,)) -> dict[str, Any]:
    """One tensor shape throughout: batches after the first go through an _EntrySpec."""
    return {f"layer.{i}.weight": torch.empty(shape) for i in range(n)}


def test_batches_agree_and_are_taken(monkeypatch, scanner) -> None:
    batches = _Batches(monkeypatch, scanner=scanner)
    for protocol in (2, 3, 4):
        for obj in (plain_run(300), state(200), {"a": plain_run(40), "b": plain_run(7)},
                    plain_run(60, torch.bfloat16)):
            assert all_ways(data_pkl(save(obj, protocol)))[0] != "error"
    assert batches.taken > 100


def test_the_threshold_keeps_small_pickles_one_at_a_time(monkeypatch) -> None:
    calls = {"batch": 0}
    original = _unpickle._Machine.entry_run

    def counted(machine: Any, *args: Any) -> Any:
        calls["batch"] += 1
        return original(machine, *args)

    monkeypatch.setattr(_unpickle._Machine, "entry_run", counted)
    assert all_ways(data_pkl(save(plain_run(300))))[0] != "error"
    assert calls["batch"] == 0  # under BULK_MIN_NBYTES


_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64,
                           torch.uint8, torch.bool, torch.float64])
_tensor = st.tuples(st.lists(st.integers(0, 3), max_size=3), _dtypes, st.booleans(),
                    st.integers(0, 2))


def _build_state(specs: list[Any]) -> dict[str, Any]:
    base = torch.zeros(16)
    out: dict[str, Any] = {}
    for i, (shape, dtype, grad, kind) in enumerate(specs):
        if kind == 2:
            out[f"v.{i}"] = base[i % 5: i % 5 + 3]  # a view of a shared storage
        else:
            t = torch.zeros(shape, dtype=dtype)
            if grad and dtype.is_floating_point:
                t.requires_grad_(True)
            out[f"k.{i}.é" if kind == 1 else f"k.{i}"] = t
    return out


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_tensor, min_size=0, max_size=40), protocol=st.sampled_from([2, 4]),
       batch=st.integers(2, 9), pause=st.integers(0, 5))
def test_batches_agree_on_varied_state_dicts(monkeypatch, scanner, specs, protocol, batch,
                                             pause) -> None:
    with monkeypatch.context() as m:
        _Batches(m, batch, pause, scanner=scanner)
        all_ways(data_pkl(save(_build_state(specs), protocol)))


def test_batches_agree_on_mutated_bytes(monkeypatch, scanner) -> None:
    _Batches(monkeypatch, batch=6, pause=1, scanner=scanner)
    data = data_pkl(save(plain_run(120)))
    rng = random.Random(13)
    puts = [i for i in range(len(data)) if data[i] in (0x72, 0x58, 0x68, 0x6A)]
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2))):
            at = rng.choice(puts) if rng.random() < 0.5 else rng.randrange(len(mutated))
            if rng.random() < 0.5 and at + 1 < len(mutated):
                at += 1  # an index or a length rather than the opcode
            mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, mutated[at] + 1 & 255,
                                      0x71, 0x72, 0x68, 0x6A, 0x58, 0x4B, 0x4D, 0x88, 0x89))
        all_ways(bytes(mutated))


@pytest.mark.slow  # 12 s patterns, 5 s compiled
def test_batches_agree_on_truncations_and_budgets(monkeypatch, scanner) -> None:
    _Batches(monkeypatch, batch=8, pause=0, scanner=scanner)
    data = data_pkl(save(plain_run(150)))
    for cut in range(0, len(data), max(1, len(data) // 150)):
        assert all_ways(data[:cut])[0] == "error"
    assert len(budget_errors(data, all_ways, monkeypatch, 400_000, 1_997)) > 100


def test_batches_agree_on_storages_redeclared(monkeypatch, scanner) -> None:
    """A storage named again in a batch with another size, or of another class: the batch is
    not taken and the one-at-a-time path says what is wrong (or takes it, if it is fine)."""
    _Batches(monkeypatch, batch=50, pause=0, scanner=scanner)
    data = bytearray(data_pkl(save(plain_run(40))))
    # the storage keys are "0".."39": make entry 30 name storage "1" (declared 3 elements)
    at = data.find(b"X\x02\x00\x00\x0030")
    assert at > 0
    for replacement in (b"X\x02\x00\x00\x0001", b"X\x02\x00\x00\x0013", b"X\x02\x00\x00\x0012"):
        mutated = bytearray(data)
        mutated[at:at + 7] = replacement
        all_ways(bytes(mutated))


def test_a_large_plain_state_dict_takes_batches_through_scan_pickle(monkeypatch,
                                                                   scanner) -> None:
    from ckptlab.format._pickle import scan_pickle

    batches = _Batches(monkeypatch, batch=_unpickle.BULK_BATCH, pause=_unpickle.BULK_PAUSE,
                       scanner=scanner)
    obj = plain_run(3000)
    data = data_pkl(save(obj))
    scan = scan_pickle(data)
    assert batches.taken >= 2
    assert [t.path for t in scan.tensors] == [(k,) for k in obj]
    assert [(t.shape, t.stride, t.dtype) for t in scan.tensors] == [
        (tuple(v.shape), v.stride(), "float32") for v in obj.values()]


def _memo_exposed(data: bytes) -> bytes:
    """The pickle, returning ``(root, [every memo entry])``: BINGETs of every index stored."""
    import pickletools
    import struct

    stored = sorted({arg for op, arg, _ in pickletools.genops(data)
                     if op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE") and arg is not None})
    gets = b"".join(b"j" + struct.pack("<I", i) for i in stored)
    return data[:-1] + b"(" + gets + b"l\x86."


def test_batches_leave_the_memo_the_loop_leaves(monkeypatch, scanner) -> None:
    batches = _Batches(monkeypatch, batch=7, pause=1, scanner=scanner)
    for obj in (plain_run(80), _build_state([((2, 3), torch.float16, True, i % 3)
                                             for i in range(50)])):
        got = all_ways(_memo_exposed(data_pkl(save(obj))))
        assert got[0] != "error"
        assert len(got[0][1][1][1]) > 8 * 40  # the memo list: every entry's eight objects
    assert batches.taken > 5  # (the first 32 entries store short BINPUTs: one at a time)


# the batches of one tensor shape (_EntrySpec): specialised patterns give what the general
# one gives, and give way to it where the shape changes


def test_specialised_batches_agree_and_are_taken(monkeypatch) -> None:
    batches = _Batches(monkeypatch, batch=6, pause=0)
    for protocol in (2, 4):
        for obj in (uniform_run(400), uniform_run(200, (3, 4)),
                    {**uniform_run(300), **plain_run(50), "tail": uniform_run(80, (5,))},
                    {"a": uniform_run(120), "b": {"step": 3}, "c": uniform_run(90, ())}):
            assert all_ways(data_pkl(save(obj, protocol)))[0] != "error"
    assert batches.specialised > 100


def cycling_run(n: int) -> dict[str, Any]:
    """An MoE layer's experts: three tensors of two shapes, over and over."""
    out: dict[str, Any] = {}
    for i in range(n // 3):
        out[f"experts.{i}.gate_proj"] = torch.empty(4, 2)
        out[f"experts.{i}.up_proj"] = torch.empty(4, 2)
        out[f"experts.{i}.down_proj"] = torch.empty(2, 4)
    return out


def test_batches_of_several_shapes_take_their_patterns(monkeypatch) -> None:
    batches = _Batches(monkeypatch, batch=8, pause=0)
    for obj in (cycling_run(300), {**cycling_run(90), **uniform_run(90), **plain_run(90)}):
        assert all_ways(data_pkl(save(obj)))[0] != "error"
        assert all_ways(_memo_exposed(data_pkl(save(obj))))[0] != "error"
    assert batches.shapes > 20


@pytest.mark.slow  # 16 s
def test_specialised_batches_agree_on_mutated_bytes(monkeypatch) -> None:
    batches = _Batches(monkeypatch, batch=6, pause=0)
    data = data_pkl(save({**uniform_run(150), **cycling_run(150)}))
    rng = random.Random(29)
    tail = data.find(b"layer.60.weight")  # past the short BINPUTs: specialised batches here
    hot = [i for i in range(tail, len(data)) if data[i] in (0x72, 0x58, 0x68, 0x4B, 0x85)]
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2))):
            at = rng.choice(hot) if rng.random() < 0.6 else rng.randrange(tail, len(mutated))
            if rng.random() < 0.5 and at + 1 < len(mutated):
                at += 1  # an index, a length or a digit rather than the opcode
            mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, mutated[at] + 1 & 255,
                                      0x71, 0x72, 0x68, 0x6A, 0x58, 0x4B, 0x4D, 0x88, 0x89,
                                      0x30, 0x39))
        all_ways(bytes(mutated))
    assert batches.specialised > 100


def test_specialised_batches_agree_on_truncations_budgets_and_the_memo(monkeypatch) -> None:
    batches = _Batches(monkeypatch, batch=8, pause=0)
    data = data_pkl(save(uniform_run(150)))
    for cut in range(0, len(data), max(1, len(data) // 150)):
        assert all_ways(data[:cut])[0] == "error"
    budget_errors(data, all_ways, monkeypatch, 400_000, 4_999)
    monkeypatch.undo()
    batches = _Batches(monkeypatch, batch=7, pause=0)
    got = all_ways(_memo_exposed(data_pkl(save(uniform_run(100)))))
    assert got[0] != "error" and len(got[0][1][1][1]) > 8 * 90
    assert batches.specialised > 5


def test_batches_stop_at_a_key_that_is_not_utf8(monkeypatch, scanner) -> None:
    """A key of bytes that are not UTF-8 inside a batch: the entries before it are taken, the
    loop says what is wrong with it (at its offset), as one at a time."""
    batches = _Batches(monkeypatch, batch=16, pause=0, scanner=scanner)
    data = bytearray(data_pkl(save(uniform_run(120))))
    for name in (b"layer.70.weight", b"layer.71.weight", b"layer.100.weight"):
        mutated = bytearray(data)
        at = mutated.find(name)
        mutated[at + 2] = 0xFF  # a lone continuation byte
        got = all_ways(bytes(mutated))
        assert got[0] != "error" or "utf" in got[2].lower(), got
        mutated[at + 2:at + 4] = b"\xed\xa0"  # a surrogate's first bytes: surrogatepass takes
        all_ways(bytes(mutated))  # a whole one only
    assert batches.taken > 5 and (scanner == "compiled" or batches.specialised > 5)


def test_a_batch_never_hashes_a_storage_tag_that_is_not_a_string(monkeypatch, scanner) -> None:
    """The storage tag's BINGET of the entries reading a dict stored before (or a tuple a
    million deep, whose hash recurses in C): the batch declines before hashing it, and the
    loop reports the persistent id (found by a review: a TypeError, or a crash)."""
    import pickletools

    _Batches(monkeypatch, batch=8, pause=0, scanner=scanner)
    data = data_pkl(save({f"w{i}": torch.zeros(2) for i in range(12)}))
    ops = list(pickletools.genops(data))
    assert data[:5] == b"\x80\x02}q\x00"  # the root dict: memo 0
    tag = next(ops[i + 1][1] for i, (_, arg, _) in enumerate(ops) if arg == "storage")
    out = bytearray(data)
    for _, _, at in [op for op in ops if op[0].name == "BINGET" and op[1] == tag][1:]:
        out[at + 1] = 0
    got = all_ways(bytes(out))
    assert got[:2] == ("error", "PickleDataError") and "persistent id" in got[2]
    # a deep tuple, through scan_pickle at ckptlab's own batch sizes
    monkeypatch.undo()
    if scanner == "patterns":
        monkeypatch.setattr(_unpickle, "_c_entries", None)
    from ckptlab.errors import CorruptArchiveError
    from ckptlab.format._pickle import scan_pickle

    obj: dict[str, Any] = {"pad": "p" * 300_000, "deep": (7,)}
    obj.update({f"w{i}": torch.zeros(2) for i in range(200)})
    data = data_pkl(save(obj))
    ops = list(pickletools.genops(data))
    deep_at = data.index(b"K\x07\x85")
    deep = next(arg for _, arg, at in ops if at == deep_at + 3)
    tag = next(ops[i + 1][1] for i, (_, arg, _) in enumerate(ops) if arg == "storage")
    out = bytearray(data)
    for _, _, at in [op for op in ops if op[0].name in ("BINGET", "LONG_BINGET")
                     and op[1] == tag][17:]:
        out[at + 1] = deep
    out = out[:deep_at] + b")" + b"\x85" * 1_000_000 + out[deep_at + 3:]
    with pytest.raises(CorruptArchiveError, match="persistent id"):
        scan_pickle(bytes(out))


# batches of several storage classes: a BatchNorm's int64 counter, bf16 scales among floats


def norm_run(n: int) -> dict[str, Any]:
    """A BatchNorm-like model's entries: float, int64 and bfloat16 storages in turn."""
    out: dict[str, Any] = {}
    for i in range(n // 4):
        out[f"bn.{i}.weight"] = torch.ones(3)
        out[f"bn.{i}.running_mean"] = torch.zeros(3)
        out[f"bn.{i}.num_batches_tracked"] = torch.tensor(i)
        out[f"bn.{i}.scale"] = torch.ones(2, dtype=torch.bfloat16)
    return out


# specialised patterns, the general one, the compiled scanner
@pytest.mark.parametrize("spec_min", [2, 10**9, 0])
def test_batches_take_entries_of_several_storage_classes(monkeypatch, spec_min: int) -> None:
    if spec_min == 0 and _unpickle._c_entries is None:
        pytest.skip("ckptlab.format._entries is not built (no C compiler at install)")
    batches = _Batches(monkeypatch, batch=8, pause=0, spec_min=spec_min,
                       scanner="compiled" if spec_min == 0 else "patterns")
    for obj in (norm_run(400), {**norm_run(80), **uniform_run(80), **plain_run(40)}):
        assert all_ways(data_pkl(save(obj)))[0] != "error"
        assert all_ways(_memo_exposed(data_pkl(save(obj))))[0] != "error"
    assert batches.taken > 40  # (each batch holds entries of three storage classes)
    if spec_min == 2:
        assert batches.shapes > 20


def test_one_storage_under_two_classes_in_a_batch(monkeypatch, scanner) -> None:
    """torch pickles a float8 weight and its uint8 view as one storage under two classes: the
    batch takes it where the byte sizes agree and gives way to the loop's error where not."""
    batches = _Batches(monkeypatch, batch=8, pause=0, scanner=scanner)
    w = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    obj = {**{f"a.{i}": torch.zeros(3) for i in range(40)}, "w": w, "w_bytes": w.view(torch.uint8),
           **{f"b.{i}": torch.zeros(3) for i in range(40)}}
    data = data_pkl(save(obj))
    got = all_ways(data)
    assert got[0] != "error"
    taken = batches.taken
    assert taken >= 5  # (batches of 8 among the 80 entries around the two)
    # the uint8 view's numel made to disagree (16 -> 17 bytes): an error, the same every way
    view_at = data.index(b"ByteStorage")
    numel_at = data.index(b"K\x10", view_at)
    bad = data[:numel_at] + b"K\x11" + data[numel_at + 2:]
    assert all_ways(bad)[0] == "error"


# Parameters and views of one storage among the entries (the compiled walk takes them)


def mix_run(n: int) -> dict[str, Any]:
    """Per layer: a Parameter (every third requires grad), two views of one storage (the
    second names it by BINGET of the first's BINPUT), a bfloat16 vector."""
    out: dict[str, Any] = {}
    for i in range(n):
        base = torch.zeros(8)
        out.update({f"l.{i}.w": torch.nn.Parameter(torch.zeros(2, 2), requires_grad=i % 3 == 0),
                    f"l.{i}.a": base[:4], f"l.{i}.b": base[4:].view(2, 2),
                    f"l.{i}.bias": torch.zeros(3, dtype=torch.bfloat16)})
    return out


def test_parameters_and_views_agree_and_are_taken(monkeypatch, scanner) -> None:
    batches = _Batches(monkeypatch, batch=9, pause=1, scanner=scanner)
    for protocol in (2, 3):
        for obj in (mix_run(60), {"model": mix_run(20), "step": 3, "more": mix_run(5)}):
            got = all_ways(data_pkl(save(obj, protocol)))
            assert got[0] != "error"
    # the compiled walk takes Parameters and views in its batches (the patterns leave both
    # to the loop: they end a batch)
    if scanner == "compiled":
        assert batches.taken > 40
    memo = all_ways(_memo_exposed(data_pkl(save(mix_run(40)))))
    assert memo[0] != "error" and len(memo[0][1][1][1]) > 4 * 40 * 8


@pytest.mark.slow  # 10 s + 9 s
def test_parameter_batches_agree_on_mutations_truncations_and_budgets(monkeypatch,
                                                                      scanner) -> None:
    _Batches(monkeypatch, batch=8, pause=0, scanner=scanner)
    data = data_pkl(save(mix_run(30)))
    rng = random.Random(29)
    hot = [i for i in range(len(data)) if data[i] in (0x72, 0x71, 0x68, 0x6A, 0x87, 0x88, 0x89)]
    for _ in range(300):
        mutated = bytearray(data)
        at = rng.choice(hot) if rng.random() < 0.7 else rng.randrange(len(mutated))
        if rng.random() < 0.5 and at + 1 < len(mutated):
            at += 1  # an index rather than the opcode
        mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, mutated[at] + 1 & 255,
                                  0x71, 0x72, 0x68, 0x6A, 0x87, 0x86, 0x88, 0x89, 0x52))
        all_ways(bytes(mutated))
    for cut in range(0, len(data), max(1, len(data) // 120)):
        assert all_ways(data[:cut])[0] == "error"
    assert len(budget_errors(data, all_ways, monkeypatch, 300_000, 1_499)) > 100


def test_a_parameter_handler_that_may_raise_is_called_one_at_a_time(monkeypatch,
                                                                    scanner) -> None:
    """Only a ``_rebuild_parameter`` handler that says it never raises
    (``ckptlab_batchable``) is called in a batch: another one, here one that raises on the
    tenth Parameter, is called by the loop, which says where."""
    batches = _Batches(monkeypatch, batch=8, pause=0, scanner=scanner)
    data = data_pkl(save(mix_run(30)))
    calls = []

    def strict(data: Any = None, requires_grad: Any = False, hooks: Any = None) -> Any:
        calls.append(requires_grad)
        if len(calls) == 10:
            raise TypeError("the tenth")
        return data

    def run(fast: bool) -> Any:
        calls.clear()
        handlers, table = torch_handlers()
        table[("torch._utils", "_rebuild_parameter")] = strict
        try:
            interpret(data, handlers=table, persistent_load=handlers.persistent_load,
                      buildable=_BUILDABLE, fast_paths=fast,
                      fused_tensor_v2=handlers.fused_v2 if fast else None,
                      fused_tensor_v2_batch=handlers.fused_v2_batch if fast else None)
        except PickleDataError as exc:
            return str(exc), _unpickle.failure_offset(exc), list(calls)
        raise AssertionError("no error")

    fast = run(True)
    assert fast == run(False) and len(fast[2]) == 10 and "the tenth" in fast[0]
    if scanner == "compiled":  # the walk stops at each Parameter: the entries between go
        assert batches.taken > 0  # in batches


# an optimizer's state: dicts of tensors under int keys, taken a batch of units at a time


def adam_state(n: int, *, step_tensor: bool = True) -> dict[str, Any]:
    """What ``torch.optim.Adam.state_dict()`` holds for ``n`` parameters."""
    state = {i: {"step": torch.tensor(float(i)) if step_tensor else i,
                 "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}
             for i in range(n)}
    return {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(n))}]}


class _Units:
    """Counts the batches state_run takes."""

    def __init__(self, monkeypatch: Any) -> None:
        self.taken = 0
        original = _unpickle._Machine.state_run

        def counted(machine: Any, *args: Any) -> Any:
            done = original(machine, *args)
            self.taken += type(done) is tuple
            return done

        monkeypatch.setattr(_unpickle._Machine, "state_run", counted)


def test_optimizer_states_are_taken_a_batch_of_units_at_a_time(monkeypatch,
                                                               scanner) -> None:
    _Batches(monkeypatch, batch=7, pause=1, scanner=scanner)
    units = _Units(monkeypatch)
    sgd = {"state": {i: {"momentum_buffer": torch.zeros(4)} for i in range(300)}}
    for obj in (adam_state(300), sgd, {"model": uniform_run(90), "optimizer": adam_state(90)},
                adam_state(60, step_tensor=False)):  # (an int step: no unit is taken)
        for protocol in (2, 4):
            assert all_ways(data_pkl(save(obj, protocol)))[0] != "error"
            assert all_ways(_memo_exposed(data_pkl(save(obj, protocol))))[0] != "error"
    assert units.taken > 40


@pytest.mark.slow  # 19 s + 14 s
def test_optimizer_state_batches_agree_on_mutations_truncations_and_budgets(
        monkeypatch, scanner) -> None:
    _Batches(monkeypatch, batch=7, pause=0, scanner=scanner)
    units = _Units(monkeypatch)
    data = data_pkl(save(adam_state(120)))
    for cut in range(0, len(data), max(1, len(data) // 120)):
        assert all_ways(data[:cut])[0] == "error"
    rng = random.Random(31)
    tail = len(data) // 4  # past the first units' short BINPUTs
    hot = [i for i in range(tail, len(data))
           if data[i] in (0x72, 0x58, 0x68, 0x6A, 0x4B, 0x4D, 0x7D, 0x75, 0x28)]
    for _ in range(200):
        mutated = bytearray(data)
        at = rng.choice(hot) if rng.random() < 0.7 else rng.randrange(tail, len(mutated))
        if rng.random() < 0.4 and at + 1 < len(mutated):
            at += 1  # an index, a length or an int rather than the opcode
        mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 1, 0x71, 0x72, 0x68, 0x6A,
                                  0x4B, 0x4D, 0x4A, 0x7D, 0x75, 0x28, 0x58))
        all_ways(bytes(mutated))
    budget_errors(data, all_ways, monkeypatch, 300_000, 3_001)
    assert units.taken > 10


def test_optimizer_state_keys_must_be_strings_stored_before(monkeypatch,
                                                             scanner) -> None:
    """A unit whose key BINGET reads a tensor, a dict, an int, or an index not stored yet: the
    loop's to do (the same outcome as one opcode at a time)."""
    import pickletools

    _Batches(monkeypatch, batch=7, pause=0, scanner=scanner)
    units = _Units(monkeypatch)
    # a model first: the optimizer's keys are stored past index 255 (LONG_BINGETs)
    data = data_pkl(save({"model": uniform_run(300), "optimizer": adam_state(80)}))
    ops = list(pickletools.genops(data))
    gets = [(ops[i][2], ops[i][1]) for i in range(len(ops) - 1)
            if ops[i][0].name == "LONG_BINGET" and ops[i + 1][0].name == "BINGET"
            and ops[i][2] > len(data) // 2]  # a key's BINGET, then the global's
    assert gets
    at, stored = gets[len(gets) // 2]
    assert all_ways(data)[0] != "error" and units.taken > 3
    for index in (0, 1, 3, 5, stored - 1, stored + 1, stored + 40, 10**6):
        mutated = data[:at + 1] + index.to_bytes(4, "little") + data[at + 5:]
        all_ways(mutated)


def test_a_reduced_made_in_the_runner_is_what_its_init_makes(monkeypatch) -> None:
    """The runner makes a global's Reduced without its __init__ frame only while that
    __init__ is the one it knows: patched, it is called for every one."""
    data = module_pickle()
    want = outcome(data, True)
    assert want[0][0] == "reduced" and want == outcome(data, False)
    made = []
    original = Reduced.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Reduced, "__init__", counted)
    assert outcome(data, True) == want and len(made) >= 6 * 3 + 1  # every module
