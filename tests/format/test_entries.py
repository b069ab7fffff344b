"""The compiled entry scanner (``ckptlab/format/_entries.c``) on its own: the entries it finds
are the ones the regular expression finds, and no bytes (random, cut, mutated, at any
position, with any memo size) make it read outside its buffer, crash or return nonsense.

What a batch then does with its columns is compared with one opcode at a time in
``test_fast_paths.py`` (the ``scanner`` fixture runs those tests both ways)."""

from __future__ import annotations

import io
import os
import random
import sys
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.format import _unpickle
from ckptlab.format._unpickle import Global, Reduced

entries, units, opcodes = _unpickle._c_entries, _unpickle._c_units, _unpickle._c_opcodes
if entries is None or units is None or opcodes is None:
    if os.environ.get("CI"):
        raise RuntimeError("ckptlab.format._entries is not built (pip install -e . with gcc)")
    pytest.skip("ckptlab.format._entries is not built (no C compiler at install)",
                allow_module_level=True)


def data_pkl(obj: object, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=protocol)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def state(n: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = i % 5
        out[f"layer.{i}.w"] = (torch.zeros(2, 3) if kind == 0 else torch.tensor(i) if kind == 1
                               else torch.zeros(4, dtype=torch.bfloat16) if kind == 2
                               else torch.zeros(3, 2).t() if kind == 3
                               else torch.zeros(600)[300:])
    return out


def regex_walk(data: bytes, pos: int) -> list[tuple[str, int]]:
    """The entries ``_ENTRY_V2`` finds from ``pos``: (key, end) each."""
    out = []
    while pos + 5 <= len(data) and data[pos] == 0x58:
        length = int.from_bytes(data[pos + 1:pos + 5], "little")
        end = pos + 5 + length
        m = _unpickle._ENTRY_V2(data, end) if end <= len(data) else None
        if m is None:
            break
        g = m.groups()
        size, stride = _unpickle._int_tuple_op(g[11]), _unpickle._int_tuple_op(g[13])
        if (g[4][0] == 0x58 and len(g[4]) - 5 != g[4][1]) or \
                not (size[2] and stride[2] and len(size[0]) == len(stride[0])) or \
                _unpickle._small_int(g[10])[0] < 0:
            break
        try:
            key = data[pos + 5:end].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            break
        out.append((key, m.end()))
        pos = m.end()
    return out


def sixth_key(data: bytes) -> tuple[int, int]:
    """Where the sixth entry's key starts (the first five name the global and the storage
    classes: GLOBAL, not BINGET) and the memo's length there."""
    import pickletools

    pos = data.index(b"X", data.index(b"layer.5.w") - 5)
    stored = [arg for op, arg, at in pickletools.genops(data)
              if at < pos and op.name in ("BINPUT", "LONG_BINPUT")]
    return pos, max(stored) + 1


@pytest.mark.parametrize("protocol", [2, 3])  # (4 memoizes with MEMOIZE: no fast path)
def test_the_entries_the_pattern_finds(protocol: int) -> None:
    data = data_pkl(state(300), protocol)
    pos, memo_len = sixth_key(data)
    want = regex_walk(data, pos)
    assert len(want) == 295
    got = entries(data, pos, 1000, memo_len)
    assert got is not None
    count, end, last, keys, masks, shared, classes, names, numels, offsets, sizes, strides, \
        grads, puts, cost, g_param, params = got
    assert g_param == -1 and params is None  # (no Parameter)
    assert count == 295 and end == want[-1][1] and keys == [k for k, _ in want]
    assert len(set(shared)) == 4 and max(shared) < memo_len  # stored before: the first entries
    assert len(masks) == count and {len(c) for c in (classes, names, numels, offsets, sizes,
                                                     strides, grads)} == {count}
    t = state(300)
    for key, size, stride, off, name in zip(keys, sizes, strides, offsets, names):
        assert (size, stride, off) == (tuple(t[key].shape), t[key].stride(),
                                       t[key].storage_offset())
        assert isinstance(name, str) and name.isdigit()
    assert last < end and puts > 295 and cost > 1416 * 295
    # a memo size that is not the pickle's: the first BINPUT stores another index, no entry
    assert entries(data, pos, 1000, memo_len + 1) is None
    # a limit: that many, ending where the pattern's entry ends
    few = entries(data, pos, 7, memo_len)
    assert few is not None and few[0] == 7 and few[1] == want[6][1]


def parameters_and_views(n: int) -> dict[str, torch.Tensor]:
    """A Parameter, two views of one storage and a bfloat16 vector per layer, as
    ``benchmarks/open.py``'s ``mix``; every seventh Parameter requires grad."""
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=i % 7 == 0)
        base = torch.zeros(8)
        out.update({f"l.{i}.w": w, f"l.{i}.a": base[:4], f"l.{i}.b": base[4:].view(2, 2),
                    f"l.{i}.bias": torch.zeros(3, dtype=torch.bfloat16)})
    return out


def test_parameters_and_views_of_one_storage() -> None:
    """Parameters (``_rebuild_parameter(tensor, requires_grad, OrderedDict())``) and storage
    keys read back by BINGET from an earlier entry of the walk are taken: the columns say
    which entries are Parameters, and a view's storage key is the earlier entry's string."""
    import pickletools

    n = 60
    t = parameters_and_views(n)
    data = data_pkl(t)
    pos = data.index(b"X", data.index(b"l.2.w") - 5)  # (the first layers name the globals)
    memo_len = 1 + max(arg for op, arg, at in pickletools.genops(data)
                       if at < pos and op.name in ("BINPUT", "LONG_BINPUT"))
    got = entries(data, pos, 10_000, memo_len)
    assert got is not None
    count, keys, names, sizes, g_param, params = (got[0], got[3], got[7], got[10], got[15],
                                                  got[16])
    assert count == 4 * (n - 2) and keys == list(t)[8:]
    assert 0 <= g_param < memo_len and len(params) == count
    for key, flags, name, size in zip(keys, params, names, sizes):
        want = t[key]
        assert bool(flags & 0x10) == isinstance(want, torch.nn.Parameter)
        assert bool(flags & 0x08) == want.requires_grad and size == tuple(want.shape)
        assert isinstance(name, str) and name.isdigit()
    # each view ``b`` reads its storage key back from view ``a`` (the same string object)
    for i in range(1, count, 4):
        assert keys[i].endswith(".a") and names[i + 1] is names[i]
    # told to take no Parameter: the walk ends before the first
    assert entries(data, pos, 10_000, memo_len, False) is None  # (it starts at one)
    at = data.index(b"X", data.index(b"l.2.a") - 5)
    stored = 1 + max(arg for op, arg, where in pickletools.genops(data)
                     if where < at and op.name in ("BINPUT", "LONG_BINPUT"))
    few = entries(data, at, 10_000, stored, False)
    assert few is not None and few[3] == ["l.2.a", "l.2.b", "l.2.bias"] and few[16] is None
    assert entries(data, at, 10_000, stored)[0] == count - 1  # (and with them: to the end)
    # a storage key BINGET that reads an earlier entry's *key* (not its storage key): the
    # walk ends before that entry
    ops = list(pickletools.genops(data))
    at_b = next(i for i, (op, arg, _) in enumerate(ops) if arg == "l.30.b")
    at_a = next(i for i, (op, arg, _) in enumerate(ops) if arg == "l.30.a")
    skey_get, a_key_put = ops[at_b + 7], ops[at_a + 1]
    assert skey_get[0].name == "LONG_BINGET" and a_key_put[0].name == "LONG_BINPUT"
    bad = bytearray(data)
    bad[skey_get[2] + 1:skey_get[2] + 5] = a_key_put[1].to_bytes(4, "little")
    cut = entries(bytes(bad), pos, 10_000, memo_len)
    assert cut is not None and cut[3][-1] == "l.30.a"
    # ... and one of an index no entry of the walk has stored yet: the same
    bad[skey_get[2] + 1:skey_get[2] + 5] = (skey_get[1] + 1).to_bytes(4, "little")
    cut = entries(bytes(bad), pos, 10_000, memo_len)
    assert cut is not None and cut[3][-1] == "l.30.a"


def test_the_units_of_an_optimizer_state() -> None:
    """An Adam state's dicts (``{i: {"step": t, "exp_avg": t, "exp_avg_sq": t}}``) from the
    first whose BINPUTs are LONG_BINPUTs (memo indices past 255) on."""
    import itertools
    import pickletools

    n = 200
    state = {i: {"step": torch.tensor(float(i)), "exp_avg": torch.zeros(2, 3),
                 "exp_avg_sq": torch.zeros(3)} for i in range(n)}
    data = data_pkl({"state": state})
    ops = list(pickletools.genops(data))
    heads = [(at, put[1]) for (op, _, at), (op2, _, _), put in zip(ops, ops[1:], ops[2:])
             if op.name in ("BININT1", "BININT2") and op2.name == "EMPTY_DICT"
             and put[0].name == "LONG_BINPUT"]
    (pos, memo_len), first = heads[0], n - len(heads)
    got = units(data, pos, 10_000, memo_len)
    assert got is not None
    count, end, ints, per_unit, key_gets, masks, shared, classes, names, numels, offsets, \
        sizes, strides, grads, puts, cost = got
    assert count == len(heads) and ints == list(range(first, n)) and per_unit == [3] * count
    assert data[end - 1] == 0x75 and len(set(key_gets)) == 3 and max(key_gets) < memo_len
    assert sizes[:3] == [(), (2, 3), (3,)] and strides[:3] == [(), (3, 1), (1,)]
    assert offsets == [0] * 3 * count and numels[:3] == [1, 6, 3] and not any(grads)
    assert len(masks) == len(names) == len(classes) == 3 * count
    assert all(map(str.isdigit, names)) and len(set(shared)) == 4
    assert puts == (5 + 7 + 7) * count and cost > 3 * count * 1416  # (a scalar: 5 BINPUTs)
    # at most a limit of tensors, whole units only
    few = units(data, pos, 7, memo_len)
    assert few is not None and few[0] == 2 and few[3] == [3, 3]
    assert units(data, pos, 10_000, memo_len + 1) is None
    assert list(itertools.islice(ints, 2)) == [first, first + 1]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 500), st.integers(0, 5000),
       st.integers(0, 2**33))
def test_random_bytes(data: bytes, pos: int, limit: int, memo_len: int) -> None:
    for walk in (entries, units):
        got = walk(data, pos, limit, memo_len)
        if got is not None:
            assert 0 < got[0] <= limit and pos < got[1] <= len(data)


def test_cut_and_mutated_pickles_anywhere() -> None:
    data = data_pkl(state(60))
    rng = random.Random(7)
    starts = [i for i in range(len(data)) if data[i] == 0x58]
    for _ in range(3000):
        mutated = bytearray(data[:rng.randrange(len(data) + 1)])
        for _ in range(rng.choice((0, 1, 2, 4))):
            if mutated:
                at = rng.randrange(len(mutated))
                mutated[at] = rng.choice((rng.randrange(256), 0xFF, 0x00, 0x58, 0x28, 0x74,
                                          0x4A, 0x72, 0x6A))
        pos = rng.choice(starts) if rng.random() < 0.8 else rng.randrange(len(data) + 8)
        got = entries(bytes(mutated), pos, rng.randrange(0, 80), rng.randrange(0, 400))
        if got is not None:
            assert pos < got[1] <= len(mutated) and got[0] == len(got[3]) == len(got[4])
        got = units(bytes(mutated), pos, rng.randrange(0, 80), rng.randrange(0, 400))
        if got is not None:
            assert pos < got[1] <= len(mutated) and got[0] == len(got[2]) == len(got[3])


def test_buffers_and_bad_arguments() -> None:
    data = data_pkl(state(10))
    pos, memo_len = sixth_key(data)
    a = entries(data, pos, 50, memo_len)
    assert a is not None and a[0] == 5
    assert entries(bytearray(data), pos, 50, memo_len) == a
    assert entries(memoryview(data), pos, 50, memo_len) == a
    assert entries(data, -1, 50, memo_len) is None and entries(data, pos, 0, memo_len) is None
    assert entries(data, len(data) + 10, 50, memo_len) is None
    # a start past the end (near the largest index: no position arithmetic wraps) and a
    # limit larger than the buffer (no allocation of it)
    for walk in (entries, units):
        assert walk(b"X\0\0\0\0", sys.maxsize - 2, 4, 0) is None
        assert walk(data, pos, 1 << 40, memo_len) == walk(data, pos, 10_000, memo_len)
    with pytest.raises(TypeError):
        entries("not bytes", 0, 1, 0)


# opcodes(): the plain opcodes many at a time (what _Machine.run leaves to it)


def run_opcodes(data: bytes, pos: int, budget: int = 1 << 40, units: bool = False) -> tuple:
    stack: list = []
    meta: list = []
    memo: list = []
    got = opcodes(data, pos, stack, meta, memo, budget, None, dict, object(), units, [0])
    return got, meta, memo


def test_opcodes_stop_before_what_they_leave_to_the_loop() -> None:
    import pickle

    data = pickle.dumps({"a": [1, (2, 3.5), None], "b": {}}, 2)
    (pos, stack, budget, last), meta, memo = run_opcodes(data, 2)  # (after PROTO)
    # EMPTY_DICT, BINPUT, MARK, "a" (BINUNICODE: the loop's) -> stops at the key
    assert data[pos] == 0x58 and last == pos - 1 and len(meta) == 1 and len(memo) == 1
    assert stack == [] and meta[0] == [{}] and budget == (1 << 40) - 96 - 16 - 88
    # nothing done: the same position, last -1
    again = opcodes(data, pos, [], [], [], 1 << 40, None, dict, object(), False, [0])
    assert again[0] == pos and again[3] == -1
    # a budget that does not cover the next opcode: stop before it
    (pos2, _, budget2, _), _, _ = run_opcodes(data, 2, budget=100)
    assert pos2 == 3 and budget2 == 4  # EMPTY_DICT (96) done, BINPUT (16) not
    # a BINGET of an index never stored, a BINPUT out of order: the loop's
    assert run_opcodes(b"h\x05", 0)[0][0] == 0
    assert run_opcodes(b"Nq\x01", 0)[0][0] == 1
    # SETITEMS into a dict with str keys is done; with an int key, or before an int when an
    # optimizer state's batch may follow, it is left to the loop
    def setitems(data: bytes, units: bool = False) -> tuple:
        return opcodes(data, 0, [], [], ["a"], 1 << 40, None, dict, object(), units, [0])

    pos, stack, _, _ = setitems(b"}(h\x00K\x01u.")
    assert pos == 7 and stack == [{"a": 1}]
    assert setitems(b"}(K\x02K\x01u.")[0] == 6  # (an int key: the loop's)
    assert setitems(b"}(h\x00K\x01uK\x00", units=True)[0] == 6
    assert setitems(b"}(h\x00K\x01uK\x00")[0] == 9


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(-3, 320), st.integers(0, 3000), st.booleans())
def test_opcodes_on_random_bytes(data: bytes, pos: int, budget: int, units: bool) -> None:
    stack: list = [1]
    meta: list = [[0]]
    memo: list = ["m", {}, ()]
    end, top, left, last = opcodes(data, pos, stack, meta, memo, budget, memo[1], dict,
                                   memo[0], units, [0])
    start = len(data) if pos < 0 else pos
    assert start <= end <= max(start, len(data)) and 0 <= left <= budget
    assert last == -1 if end == start else start <= last < end
    assert isinstance(top, list)


def test_opcodes_bad_arguments() -> None:
    with pytest.raises(TypeError):
        opcodes(b"", 0, [], [], [], 0, None, dict, None, False)  # ten
    with pytest.raises(TypeError):
        opcodes(b"N", 0, (), [], [], 0, None, dict, None, False, [0])  # a tuple for the stack
    with pytest.raises(TypeError):
        opcodes(b"N", 0, [], [], [], 0, None, dict, None, False, [])  # no item to set
    with pytest.raises(TypeError):
        opcodes("N", 0, [], [], [], 0, None, dict, None, False, [0])
    with pytest.raises(OverflowError):
        opcodes(b"N", 0, [], [], [], 1 << 70, None, dict, None, False, [0])
    with pytest.raises(TypeError, match="calls"):  # (machine, call, build, persistent, fused)
        opcodes(b"N", 0, [], [], [], 0, None, dict, None, False, [0], (1, 2, 3, 4))
    with pytest.raises(TypeError):
        opcodes(b"N", 0, [], [], [], 0, None, dict, None, False, [0], None, 13)  # thirteen


class _Calls:
    """A machine for ``opcodes``' calls: records each call, charges as ``_Machine.call``."""

    def __init__(self, budget_cost: int = 320) -> None:
        self.budget = 0
        self.log: list = []
        self.cost = budget_cost
        self.param_global: object = object()  # (no _rebuild_parameter)
        self.param_handler = None
        self.plain_calls: dict = {}  # globals whose call makes a record without call()
        self.empty_list_calls: dict = {}  # ... and what some make of one empty list

    def call(self, func: object, args: object) -> object:
        self.log.append(("call", func, args))
        self.budget -= self.cost
        return ("made", func, args)

    def build(self, target: object, state: object) -> None:
        self.log.append(("build", target, state))

    def persistent(self, pid: object) -> object:
        self.log.append(("pid", pid))
        return ("loaded", pid)

    def calls(self) -> tuple:
        return (self, self.call, self.build, self.persistent, None, self.plain_calls, Global,
                Reduced, self.empty_list_calls)


def test_opcodes_call_the_machine() -> None:
    """REDUCE / NEWOBJ through ``call`` with the budget synced, BUILD through ``build``,
    BINPERSID through ``persistent`` (charging 160), BINUNICODE decoded; without ``calls``
    each of them is left to the loop."""
    m = _Calls()
    data = b"N)RN)\x81NK\x01bK\x07QX\x02\x00\x00\x00\xc3\xa9."
    pos, stack, left, last = opcodes(data, 0, [], [], [], 10_000, None, dict, None, False, [0],
                                     m.calls())
    assert data[pos:] == b"." and last == pos - 7
    assert stack == [("made", None, ()), ("made", None, ()), None, ("loaded", 7), "\u00e9"]
    assert left == 10_000 - (16 + 16 + 320) * 2 - 16 - 16 - 16 - 160 - (96 + 8)
    assert [e[0] for e in m.log] == ["call", "call", "build", "pid"] and m.log[2][2] == 1
    for op in (b"N)R", b"N)\x81", b"NNb", b"K\x01Q", b"X\x00\x00\x00\x00"):
        pos, *_ = opcodes(op + b".", 0, [], [], [], 10_000, None, dict, None, False, [0])
        assert op[pos] in b"R\x81bQX"  # stopped before it


def test_opcodes_leave_what_would_fail_to_the_loop() -> None:
    m = _Calls()
    calls = m.calls()
    run = lambda data, budget=10_000: opcodes(  # noqa: E731
        data, 0, [], [], [], budget, None, dict, None, False, [0], calls)
    assert run(b"R.")[0] == 0 and run(b"NR.")[0] == 1  # too few items: the loop says so
    assert run(b"b.")[0] == 0 and run(b"Q.")[0] == 0
    assert run(b"NQ.", budget=16 + 159)[0] == 1  # BINPERSID over budget: before the call
    assert run(b"X\x01\x00\x00\x00\xff.")[0] == 0  # not UTF-8: the loop raises it
    assert run(b"X\x05\x00\x00\x00ab")[0] == 0  # cut off
    assert run(b"X\x01\x00\x00\x00a.", budget=99)[0] == 0  # 96 + 4 > 99
    assert m.log == []  # nothing was called
    # a key a state dict entry follows (BINPUT, BINGET of fast_global) is the loop's
    fast = object()
    key = b"X\x01\x00\x00\x00aq\x01h\x00"
    assert opcodes(key, 0, [], [], [fast], 10_000, None, dict, fast, False, [0], calls)[0] == 0
    assert opcodes(key, 0, [], [], [0], 10_000, None, dict, fast, False, [0], calls)[0] == 10


def test_a_call_that_raises_says_where() -> None:
    m = _Calls()

    def refuse(func: object, args: object) -> None:
        raise ValueError("no")

    failed = [0]
    with pytest.raises(ValueError):
        opcodes(b"NN)R.", 0, [], [], [], 10_000, None, dict, None, False, failed,
                (m, refuse, m.build, m.persistent, None, {}, Global, Reduced, {}))
    assert failed == [3]


def test_a_reduced_is_built_and_an_empty_set_made_without_the_machine() -> None:
    """BUILD of a Reduced with no state yet sets it (a second BUILD goes to build(), which
    refuses it); a global in ``empty_list_calls`` called with one empty list makes what it
    says (``set([])``), charged as call() charges; any other call goes through call()."""
    m = _Calls()
    made = Reduced(Global("m", "C"))
    settle, other = Global("builtins", "set"), Global("m", "Other")
    m.empty_list_calls[settle] = set
    memo = [made, settle, other]
    data = b"h\x00}bh\x00Nbh\x01]\x85Rh\x01K\x01]\x86Rh\x02]\x85R."
    pos, stack, left, _ = opcodes(data, 0, [], [], memo, 10_000, None, dict, None, False,
                                  [0], m.calls())
    assert data[pos:] == b"."
    assert made.state == {} and m.log[0] == ("build", made, None)  # the second BUILD: build()
    assert stack[:3] == [made, made, set()] and stack[3][0] == stack[4][0] == "made"
    assert [e[1] for e in m.log[1:]] == [settle, other]  # two arguments; not a set global
    # (BINGET EMPTY_DICT BUILD, BINGET NONE BUILD, then the three calls, each with its
    # BINGET, EMPTY_LIST, tuple and 320; the second has a BININT1 more and a TUPLE2)
    assert left == 10_000 - (16 + 96) - (16 + 16) - 2 * (16 + 88 + 72 + 8 + 320) \
        - (16 + 16 + 88 + 72 + 16 + 320)


def test_a_global_without_a_handler_is_called_without_the_machine() -> None:
    """A global in ``plain_calls`` (no handler: call() would make a record of it) gets its
    record made at once, charged as call() charges it; anything else goes through call()."""
    m = _Calls()
    plain, other = Global("m", "Plain"), Global("m", "Other")
    m.plain_calls[plain] = lambda func, args: ("record", func.name, args)
    memo = [plain, other]
    data = b"h\x00K\x01\x85Rh\x01)\x81h\x00K\x02\x85R."
    pos, stack, left, _ = opcodes(data, 0, [], [], memo, 10_000, None, dict, None, False, [0],
                                  m.calls())
    assert data[pos:] == b"." and stack == [("record", "Plain", (1,)), ("made", other, ()),
                                            ("record", "Plain", (2,))]
    assert [e[1] for e in m.log] == [other]  # only the global without a record maker
    assert left == 10_000 - 3 * (16 + 320) - 2 * (16 + 72 + 8) - 16
    # not a Global (an unhashable list), not a tuple of arguments, or over budget: call()'s
    for data, budget in ((b"]K\x01\x85R.", 10_000), (b"h\x00K\x01R.", 10_000),
                         (b"h\x00)R.", 16 + 16 + 319)):
        m.log.clear()
        pos, *_ = opcodes(data, 0, [], [], memo, budget, None, dict, None, False, [0],
                          m.calls())
        assert data[pos:] == b"." and [e[0] for e in m.log] == ["call"], data


def test_opcodes_say_where_an_error_was_raised() -> None:
    """An OrderedDict handler that raises: ``failed`` holds the offset of its BINGET."""
    def refuse() -> None:
        raise ValueError("no")

    failed = [0]
    odict = object()
    with pytest.raises(ValueError):
        opcodes(b"NNh\x00)R.", 0, [], [], [odict], 1 << 20, odict, refuse, None, False, failed)
    assert failed == [2]
