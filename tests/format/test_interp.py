"""One test suite for both pickle interpreters: the Python loop and its compiled twin.

``interpreter("python")`` is :func:`ckptlab.format._unpickle.interpret` (one opcode at a
time); ``interpreter("c")`` is
:mod:`ckptlab.format._interp`, the same loop in C. As CPython runs ``pickletester`` against
``pickle.py`` and ``_pickle.c``, every test here runs against both through the ``interp``
fixture and asserts the expected value (``pickle.loads`` of the same bytes, ``torch.load``
of the same file, a message and an offset), never merely that the two agree.

The compiled case is skipped where ckptlab was built without a C compiler, and fails when
``CI`` is set (the build there must have it). The torch cases skip without torch (CPython
3.13 runs the rest).
"""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.format._pickle_walk import _walk
from ckptlab.format._tensor_refs import _TensorRef
from ckptlab.format._torch_handlers import torch_handlers
from ckptlab.format._unpickle import (
    MEMORY_PER_BYTE,
    Global,
    Interpretation,
    OpaqueKey,
    PickleBudgetError,
    PickleDataError,
    Reduced,
    interpreter,
)
from ckptlab.testing.pickles import (
    amplifier,
    deep_tuple_key,
    distinct_globals,
    opcode_streams,
    pickle_mutations,
)

P2 = b"\x80\x02"


@pytest.fixture(params=["python", "c"])
def interp(request: pytest.FixtureRequest) -> Any:
    """``interpret(data, *, handlers, persistent_load, build, memory_per_byte)`` by one
    implementation."""
    try:
        return interpreter(request.param)
    except ImportError:
        if not os.environ.get("CI"):
            pytest.skip("ckptlab.format._interp is not built (no C compiler at install)")

    def missing(*args: Any, **kwargs: Any) -> Any:  # under CI the build must have it: a failure
        pytest.fail("ckptlab.format._interp is not built (pip install -e . with gcc)")

    return missing


@pytest.fixture
def impl(request: pytest.FixtureRequest, interp: Any) -> str:
    """Which implementation ``interp`` is ("python" or "c")."""
    return request.node.callspec.params["interp"]


def handlers_for(interp: Any) -> tuple[Any, dict[tuple[str, str], Any]]:
    """:func:`torch_handlers` of ``interp``'s implementation (the compiled handlers with the
    compiled interpreter), as a scan pairs them (``_pickle._IMPL`` picks both); the
    interpreter's ``persistent_load`` is ``handlers.load_pid``."""
    return torch_handlers("python" if interp is interpreter("python") else "c")


def fails(interp: Any, data: bytes, match: str | None = None, **kwargs: Any
          ) -> PickleDataError:
    with pytest.raises(PickleDataError, match=match) as info:
        interp(data, **kwargs)
    return info.value


def loads_plain(interp: Any, data: bytes) -> Any:
    """The root, with the torch handlers for the globals plain data pickles through at low
    protocols (``_codecs.encode`` for bytes, ``builtins.set``/``frozenset``)."""
    handlers, table = handlers_for(interp)
    return interp(data, handlers=table, persistent_load=handlers.load_pid,
                  build=handlers.build).root


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types, all the way down (nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(k, j) and same(v, w) for (k, v), (j, w)
                                        in zip(a.items(), b.items()))
    return a == b


# -- plain data, every protocol: what pickle.loads gives ----------------------------------
PLAIN = [
    0, 1, 255, 256, 65535, 65536, -1, -256, 2**31 - 1, -(2**31), 2**31, 2**63, -(2**63) - 1,
    2**64, 2**1000, -(2**2100),  # BININT1/2/4, LONG1, LONG4 (protocol 0/1: INT and LONG text)
    True, False, None,
    0.0, -1.5, 1e308, 5e-324, float("inf"), float("-inf"), float("nan"),
    "", "a", "é€😀", "x" * 300, "line\nbreak\\ and \x00", "\ud800lone",
    b"x", bytes(range(256)) * 2,
    (), (1,), (1, "a"), (1, "a", None), (1, 2, 3, 4), ((),), [(1, 2), [3, [4]]],
    [], [1, 2, 3], list(range(2000)),  # APPENDS in batches of 1000
    {}, {"a": 1, "b": [2]}, {1: "x", 2.5: "y", None: "z", (1, "k"): "t", b"b": 0},
    {str(i): i for i in range(2500)},  # SETITEMS in batches of 1000
    set(), {1, "a", 2.5}, frozenset(), frozenset({1, "b"}),
]
# what pickles through a global ckptlab's handlers do not take below these protocols
# (``__builtin__.bytes()``; ``builtins.set`` of a tuple, whose handler hashes it by identity)
PLAIN_FROM = [(b"", 3), ({1, "a", (2, 3)}, 4), ({"s": {frozenset({1})}}, 4)]


@pytest.mark.parametrize("protocol", range(6))
@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_are_what_pickle_loads_gives(interp: Any, protocol: int,
                                                  value: Any) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert same(loads_plain(interp, data), pickle.loads(data))


@pytest.mark.parametrize("value,first", PLAIN_FROM, ids=lambda v: type(v).__name__)
def test_plain_values_from_a_protocol(interp: Any, value: Any, first: int) -> None:
    for protocol in range(first, 6):
        data = pickle.dumps(value, protocol=protocol)
        assert same(loads_plain(interp, data), pickle.loads(data))


@pytest.mark.parametrize("protocol", range(6))
def test_memo_keeps_identity(interp: Any, protocol: int) -> None:
    inner = [1]
    cyclic: list[Any] = [inner, inner]
    cyclic.append(cyclic)
    root = interp(pickle.dumps(cyclic, protocol=protocol)).root
    assert root[0] is root[1] and root[2] is root and root[0] == [1]


@pytest.mark.parametrize("protocol", [0, 5])
def test_bytearray(interp: Any, protocol: int) -> None:
    data = pickle.dumps(bytearray(b"ab\x00"), protocol=protocol)
    root = interp(data).root
    if protocol == 5:  # BYTEARRAY8
        assert same(root, bytearray(b"ab\x00"))
    else:  # builtins.bytearray called: no handler, an inert record
        assert isinstance(root, Reduced) and root.func.qualname == "__builtin__.bytearray"


@given(value=st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(min_size=1)),
    lambda children: st.one_of(st.lists(children), st.tuples(children, children),
                               st.dictionaries(st.text(), children)), max_leaves=30),
    protocol=st.integers(0, 5))
@settings(max_examples=60)
def test_random_plain_data(interp: Any, value: Any, protocol: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert same(loads_plain(interp, data), pickle.loads(data))


# -- each opcode, hand-written ---------------------------------------------------------------
OPCODES = [
    # protocol 0 text
    (b"I01\n.", True), (b"I00\n.", False), (b"I 12 \n.", 12), (b"I-7\n.", -7),
    (b"I0x1f\n.", 31), (b"L12L\n.", 12), (b"L-99999999999999999999\n.", -99999999999999999999),
    (b"F1.5\n.", 1.5), (b"F-inf\n.", float("-inf")),
    (b"S'abc'\n.", "abc"), (b"S\"a\\nb\"\r\n.", "a\nb"), (b"S'\\xc3\\xa9'\n.", "é"),
    (b"Vab\\u20ac\\n\n.", "ab€\\n"), (b"N.", None),
    (b"(I1\nI2\nl.", [1, 2]), (b"(I1\nI2\nt.", (1, 2)), (b"(S'k'\nI1\nd.", {"k": 1}),
    (b"(lp0\nI1\nag0\na.", "cycle"), (b"I1\np7\n0g7\n.", 1),
    # binary
    (b"K\xff.", 255), (b"M\xff\xff.", 65535), (b"J\xff\xff\xff\xff.", -1),
    (b"\x8a\x00.", 0), (b"\x8a\x01\xff.", -1), (b"\x8a\x02\x00\x80.", -32768),
    (b"\x8a\x09" + b"\x00" * 8 + b"\x01.", 2**64),
    (b"\x8b\x02\x00\x00\x00\xff\x7f.", 32767),
    (b"G\x3f\xf8\x00\x00\x00\x00\x00\x00.", 1.5),
    (b"U\x02ab.", "ab"), (b"T\x02\x00\x00\x00\xc3\xa9.", "é"), (b"T\x01\x00\x00\x00\xff.",
                                                                  "\udcff"),
    (b"X\x03\x00\x00\x00\xed\xa0\x80.", "\ud800"),
    (b"\x8c\x02\xc3\xa9.", "é"), (b"\x8d\x01" + b"\x00" * 7 + b"z.", "z"),
    (b"C\x01z.", b"z"), (b"B\x02\x00\x00\x00yz.", b"yz"),
    (b"\x8e\x01" + b"\x00" * 7 + b"q.", b"q"),
    (b"\x96\x01" + b"\x00" * 7 + b"q.", bytearray(b"q")),
    (b"\x88.", True), (b"\x89.", False), (b").", ()),
    (b"K\x01\x85.", (1,)), (b"K\x01K\x02\x86.", (1, 2)), (b"K\x01K\x02K\x03\x87.", (1, 2, 3)),
    (b"(K\x01K\x02K\x03K\x04t.", (1, 2, 3, 4)),
    (b"]K\x01a.", [1]), (b"](K\x01K\x02e.", [1, 2]), (b"}K\x01K\x02s.", {1: 2}),
    (b"}(K\x01K\x02K\x03K\x04u.", {1: 2, 3: 4}),
    (b"\x8f(K\x01K\x02\x90.", {1, 2}), (b"(K\x01K\x02\x91.", frozenset({1, 2})),
    # memo, stack
    (b"K\x05q\x03h\x03\x86.", (5, 5)), (b"K\x05r\x00\x01\x00\x00j\x00\x01\x00\x00\x86.", (5, 5)),
    (b"K\x05\x94h\x00\x86.", (5, 5)), (b"K\x05r\xff\xff\xff\xff0j\xff\xff\xff\xff.", 5),
    (b"K\x052\x86.", (5, 5)), (b"K\x05K\x060.", 5), (b"K\x05(K\x06K\x071.", 5),
    (b"K\x05(0.", 5),  # POP of an empty stack pops its MARK
    # protocol and frames
    (b"\x80\x05\x95\x03\x00\x00\x00\x00\x00\x00\x00K\x01.", 1),
]


@pytest.mark.parametrize("data,expected", OPCODES, ids=lambda v: repr(v)[:40])
def test_each_opcode(interp: Any, data: bytes, expected: Any) -> None:
    root = interp(data).root
    if expected == "cycle":
        assert len(root) == 2 and root[0] == 1 and root[1] is root
    else:
        assert same(root, expected)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_any_bytes_like_input(interp: Any, kind: type) -> None:
    data = pickle.dumps({"a": [1, b"x"]}, protocol=4)
    assert interp(kind(data)).root == {"a": [1, b"x"]}
    assert interp(memoryview(data).cast("c")).root == {"a": [1, b"x"]}


def test_interpretation_fields(interp: Any) -> None:
    data = P2 + b"cm\nf\nq\x00h\x00\x86\x8c\x01a\x8c\x01b\x93\x86."
    result = interp(data)
    assert isinstance(result, Interpretation)
    assert result.protocol == 2 and result.end == len(data)
    assert result.globals == ["m.f", "a.b"]
    (first, again), other = result.root
    assert isinstance(first, Global) and first is again and other.qualname == "a.b"


def test_out_of_band_buffers_are_refused(interp: Any) -> None:
    data = pickle.dumps(pickle.PickleBuffer(b"xy"), protocol=5, buffer_callback=lambda b: False)
    assert b"\x97" in data  # NEXT_BUFFER (READONLY_BUFFER after it)
    fails(interp, data, "out-of-band buffers")
    fails(interp, b"\x80\x05\x98.", "out-of-band buffers")
    # in-band, as pickle.loads gives it
    data = pickle.dumps(pickle.PickleBuffer(bytearray(b"xy")), protocol=5)
    assert same(interp(data).root, pickle.loads(data))


# -- globals and calls ---------------------------------------------------------------------
def test_globals_are_one_per_name_and_canonical(interp: Any) -> None:
    data = (P2 + b"(cpathlib._local\nPosixPath\ncpathlib\nPosixPath\n\x8c\x05torch\x8c\x04Size"
            b"\x93ctorch\nSize\nt.")
    result = interp(data)
    a, b, c, d = result.root
    assert a is b and c is d and a.qualname == "pathlib.PosixPath"
    assert result.globals == ["pathlib.PosixPath", "torch.Size"]
    # each at the opcode that first named it (GLOBAL, then STACK_GLOBAL)
    assert result.named == [("pathlib", "PosixPath", 3),
                            ("torch", "Size", data.index(b"\x93"))]


def test_global_offsets_of_each_opcode(interp: Any) -> None:
    """GLOBAL, STACK_GLOBAL and INST name a global at their own opcode's offset."""
    inst = P2 + b"(S'x'\nia\nb\n."  # INST a.b with one argument
    assert interp(inst).named == [("a", "b", inst.index(b"i"))]
    for protocol in range(6):
        data = pickle.dumps([OrderedDict(), OrderedDict(), math.gcd], protocol=protocol)
        result = interp(data)
        assert result.globals == ["collections.OrderedDict", "math.gcd"]
        assert [data[at] for _, _, at in result.named] == (
            [0x93, 0x93] if protocol >= 4 else [ord("c"), ord("c")])
    # a failed interpretation says what was named before it failed
    bad = P2 + b"cos\nsystem\n\x8c\x02ls\x85R0"  # ends without STOP
    with pytest.raises(PickleDataError) as caught:
        interp(bad)
    assert caught.value.named == [("os", "system", len(P2))]


def test_calls_without_a_handler_are_reduced(interp: Any) -> None:
    data = (P2 + b"(cm\nf\nK\x01\x85R"  # REDUCE
            b"cm\nf\nK\x02\x85\x81"  # NEWOBJ
            b"cm\nf\nK\x03\x85}X\x01\x00\x00\x00kK\x04s\x92"  # NEWOBJ_EX
            b"(cm\nf\nK\x05o"  # OBJ
            b"(K\x06im\nf\n"  # INST
            b"t.")
    reduce, newobj, newobj_ex, obj, inst = interp(data).root
    for made, args, kwargs in [(reduce, (1,), None), (newobj, (2,), None),
                               (newobj_ex, (3,), {"k": 4}), (obj, (5,), None),
                               (inst, (6,), None)]:
        assert type(made) is Reduced and made.func.qualname == "m.f"
        assert made.args == args and made.kwargs == kwargs
        assert made.state is None and made.items == () and made.pairs == ()
    assert reduce.func is newobj.func is inst.func


def test_handlers_are_called_in_order(interp: Any) -> None:
    calls = []

    def handler(name: str) -> Any:
        def call(*args: Any) -> Any:
            calls.append((name, args))
            return f"{name}{args}"
        return call

    table = {("m", "f"): handler("f"), ("m", "g"): handler("g")}
    data = P2 + b"cm\nf\nK\x01K\x02\x86Rcm\ng\n)Rcm\nf\n\x8c\x01x\x85\x81\x87."
    assert interp(data, handlers=table).root == ("f(1, 2)", "g()", "f('x',)")
    assert calls == [("f", (1, 2)), ("g", ()), ("f", ("x",))]


def test_handler_errors(interp: Any) -> None:
    def two(a: Any, b: Any) -> Any:
        return a

    def boom(*args: Any) -> Any:
        raise KeyError("the handler's own")

    def bad(*args: Any) -> Any:
        raise PickleDataError("the handler says no")

    table = {("m", "two"): two, ("m", "boom"): boom, ("m", "bad"): bad}
    error = fails(interp, P2 + b"N\x85cm\ntwo\nK\x01\x85R.", "m.two called with 1 arguments it "
                  r"does not take \(.*missing 1 required positional", handlers=table)
    assert error.offset == 14 and error.__cause__ is None
    error = fails(interp, P2 + b"cm\ntwo\n)}X\x01\x00\x00\x00kK\x01s\x92.",
                  "m.two called with keyword arguments", handlers=table)
    assert error.offset == 20
    error = fails(interp, P2 + b"cm\nbad\n)R.", "the handler says no", handlers=table)
    assert error.offset == 10
    with pytest.raises(KeyError, match="the handler's own"):  # not the data's fault: as is
        interp(P2 + b"cm\nboom\n)R.", handlers=table)


@pytest.mark.parametrize("data,message,offset", [
    (P2 + b"K\x01)R.", "call of a int, not a global", 5),
    (P2 + b"cm\nf\nK\x01R.", "call of m.f with int args", 9),
    (P2 + b"cm\nf\n)K\x01\x92.", "m.f called with non-dict kwargs", 10),
    (P2 + b"(o.", "OBJ without a class", 3),
    (P2 + b")R.", "REDUCE with fewer than two items on the stack", 3),
    (P2 + b")\x81.", "opcode 0x81 needs 2 items on the stack, found 1", 3),
    (P2 + b"))\x92.", "opcode 0x92 needs 3 items on the stack, found 2", 4),
    (P2 + b"K\x01\x93.", "opcode 0x93 needs 2 items on the stack, found 1", 4),
    (P2 + b"K\x01K\x02\x93.", "STACK_GLOBAL of non-strings", 6),
])
def test_call_refusals(interp: Any, data: bytes, message: str, offset: int) -> None:
    assert fails(interp, data, message).offset == offset


class Box:
    """A ckptlab-style record BUILD may fill (through the ``build`` hook)."""

    def __init__(self) -> None:
        self.built: list[Any] = []

    def ckptlab_build(self, state: Any) -> None:
        self.built.append(state)


def test_build_rules(interp: Any) -> None:
    root = interp(P2 + b"cm\nf\n)R}X\x01\x00\x00\x00aK\x01sb.").root
    assert type(root) is Reduced and root.state == {"a": 1}
    fails(interp, P2 + b"cm\nf\n)RK\x01bK\x02b.", "BUILD applied twice to a m.f")
    assert fails(interp, P2 + b"cos\nsystem\n}b.",
                 "BUILD applied to os.system, which ckptlab never builds").offset == 14
    fails(interp, P2 + b"}}b.", "BUILD applied to dict, which ckptlab never builds")
    fails(interp, P2 + b"K\x01b.", "opcode 0x62 needs 2 items on the stack, found 1")
    box = Box()
    table = {("m", "box"): lambda: box}
    root = interp(P2 + b"cm\nbox\n)RK\x07b.", handlers=table,
                  build=lambda target, state: target.ckptlab_build(state)).root
    assert root is box and box.built == [7]
    fails(interp, P2 + b"cm\nbox\n)RK\x07b.", "BUILD applied to Box", handlers=table)


def test_items_and_pairs_of_a_reduced(interp: Any) -> None:
    data = P2 + b"cm\nf\n)R(K\x01K\x02eK\x03a(K\x04K\x05K\x06]uK\x07K\x08s."
    root = interp(data).root
    assert root.items == [1, 2, 3] and root.pairs == [(4, 5), (6, []), (7, 8)]


def test_persistent_ids(interp: Any) -> None:
    seen = []

    def load(pid: Any) -> Any:
        seen.append(pid)
        return ("loaded", pid)

    data = P2 + b"X\x01\x00\x00\x00aQ(K\x01tQPname\n\x87."
    assert interp(data, persistent_load=load).root == (
        ("loaded", "a"), ("loaded", (1,)), ("loaded", "name"))
    assert seen == ["a", (1,), "name"]
    assert fails(interp, data, "a persistent id where none is expected").offset == 8
    assert fails(interp, P2 + b"Q.", "BINPERSID with an empty stack").offset == 2


def test_containers_refusals(interp: Any) -> None:
    for data, message, offset in [
        (P2 + b"t.", "TUPLE without a MARK", 2),
        (P2 + b"K\x01\x86.", "TUPLE2 with 1 items on the stack", 4),
        (P2 + b"l.", "opcode 0x6c without a MARK", 2),
        (P2 + b"(K\x01d.", "SETITEMS with an odd number of items", 5),
        (P2 + b"(K\x01K\x02u.", "SETITEMS with nothing to set items on", 7),
        (P2 + b"u.", "SETITEMS without a MARK", 2),
        (P2 + b"N(K\x01K\x02u.", "SETITEM on a NoneType", 8),
        (P2 + b"NK\x01a.", "APPEND on a NoneType", 5),
        (P2 + b"(K\x01e.", "opcode 0x65 needs 1 items on the stack, found 0", 5),
        (P2 + b"](K\x01\x90.", "ADDITEMS on a list", 6),
        (P2 + b"1.", "opcode 0x31 without a MARK", 2),
        (P2 + b"0.", "opcode 0x30 without a MARK", 2),
        (P2 + b"2.", "opcode 0x32 needs 1 items on the stack, found 0", 2),
        (P2 + b"q\x00.", "BINPUT with an empty stack", 2),
        (P2 + b"r\x00\x00\x00\x00.", "LONG_BINPUT with an empty stack", 2),
        (P2 + b"\x94.", "MEMOIZE with an empty stack", 2),
        (P2 + b"h\x00.", "memo index 0 was never stored", 2),
        (P2 + b"Nr\x00\x00\x01\x00j\x00\x00\x02\x00.", "memo index 131072 was never stored", 8),
        (P2 + b"Np-1\n.", "negative PUT index", 3),
        (P2 + b"K\x01K\x02.", "STOP with 2 objects on the stack and 0 open MARKs", 6),
        (P2 + b"(K\x01.", "STOP with 1 objects on the stack and 1 open MARKs", 5),
    ]:
        assert fails(interp, data, message).offset == offset, data


def test_text_refusals(interp: Any) -> None:
    for data, message, offset in [
        (b"S'abc\n.", "STRING is not quoted", 0),
        (b"Ixyz\n.", "not an int: 'xyz'", 0),
        (b"I" + b"1" * 1025 + b"\n.", "an int of 1,025 digits", 0),
        (b"F1.5x\n.", "not a float: '1.5x'", 0),
        (b"I1" + b"2" * 5000 + b".", "INT: no newline within 4096 bytes", 0),
        (b"N(cm\nf\n0", "the pickle ends without a STOP opcode", 7),  # (the last opcode's)
        (b"V\\u12\n.", r"a string is not valid UTF-8: truncated \\uXXXX escape at byte 0", 0),
        (P2 + b"X\x01\x00\x00\x00\xff.", "a string is not valid UTF-8: invalid start byte at "
                                         "byte 0", 2),
    ]:
        assert fails(interp, data, message).offset == offset, data


def test_negative_get_index_was_never_stored(interp: Any) -> None:
    fails(interp, b"NNp0\n0g-5\n.", "memo index -5 was never stored")
    fails(interp, b"NNp0\n0g-1\n.", "memo index -1 was never stored")


def test_string_with_a_bad_escape(interp: Any) -> None:
    assert fails(interp, b"S'\\x'\n.", "STRING with a bad escape").offset == 0



# -- hostile inputs (tests/format/test_pickle_scan.py, test_hostile_pickles.py) -------------
@pytest.mark.parametrize("data,message,offset", [
    (P2 + b"X\xff\xff\xff\xff", "BINUNICODE declares 4,294,967,295 bytes but only 0 are left",
     2),
    (P2 + b"B\xff\xff\xff\x7f.", "bytes payload declares 2,147,483,647 bytes but only 1 are "
     "left", 2),
    (P2 + b"\x8e" + b"\xff" * 8 + b".", "bytes payload declares 18,446,744,073,709,551,615",
     2),
    (P2 + b"\x96" + b"\xff" * 8 + b".", "bytes payload declares", 2),
    (P2 + b"\x8d" + b"\x00" * 7 + b"\x80.", "BINUNICODE8 declares 9,223,372,036,854,775,808",
     2),
    (P2 + b"\x95" + b"\xff" * 8 + b"N.", "FRAME of 18,446,744,073,709,551,615 bytes with 2 "
     "bytes left", 2),
    (P2 + b"\x8b\xff\xff\xff\x7f.", "LONG4 declares 2,147,483,647 bytes", 2),
    (P2 + b"\x8b\xff\xff\xff\xff.", "LONG4 declares -1 bytes but only 1 are left", 2),
    (P2 + b"T\x00\x00\x00\x80.", "BINSTRING declares -2,147,483,648 bytes", 2),
    (P2 + b"U\x05ab.", "BINSTRING declares 5 bytes but only 3 are left", 2),
    (P2 + b"\x8c\x05ab.", "SHORT_BINUNICODE declares 5 bytes", 2),
    (P2 + b"\x8b\x01\x02\x00\x00" + b"\x01" * 513 + b".", r"an int of 513 bytes \(at most 512\)",
     2),
    (b"\x80\x06.", "unsupported pickle protocol 6", 0),
    (P2 + b"K", "BININT1 without its value", 2),
    (P2 + b"J\x00", "BININT without its value", 2),
    (P2 + b"j\x00", "LONG_BINGET without its index", 2),
    (P2 + b"\xff.", "unknown opcode 0xff", 2),
])
def test_declared_lengths_and_truncated_arguments(interp: Any, data: bytes, message: str,
                                                  offset: int) -> None:
    assert fails(interp, data, message).offset == offset


def test_huge_memo_index_is_sparse(interp: Any) -> None:
    data = P2 + b"Nr\x00\x00\x00\x10." # the nine-byte .metadata of test_hostile_pickles
    assert interp(data).root is None
    data = P2 + b"K\x07r\xff\xff\xff\xff0j\xff\xff\xff\xffp99999999999999999999\n" \
                b"g99999999999999999999\n\x86."
    assert interp(data).root == (7, 7)


@pytest.mark.parametrize("code", [b"\x82\x01", b"\x83\xf0\x7f", b"\x84\x01\x00\x00\x00"])
def test_ext_codes_never_consult_copyreg(interp: Any, code: bytes) -> None:
    copyreg.add_extension("os", "system", 0x7FF0)
    try:
        before = dict(copyreg._extension_cache)  # type: ignore[attr-defined]
        error = fails(interp, P2 + code + b")R.", "EXT opcode")
        assert error.offset == 2
        assert dict(copyreg._extension_cache) == before  # type: ignore[attr-defined]
    finally:
        copyreg.remove_extension("os", "system", 0x7FF0)


@pytest.mark.parametrize("data", [
    b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.",
    b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
    b"X\x06\x00\x00\x00system\x86R.",
    b"\x80\x02(ccopyreg\n_reconstructor\nX\x01\x00\x00\x00xo.",  # OBJ opcode
    b"(ios\nsystem\nX\x04\x00\x00\x00truek.",  # INST opcode, protocol 0
    b"\x80\x02csubprocess\ncall\n(X\x02\x00\x00\x00lstR.",
])
def test_nothing_named_is_imported_or_run(interp: Any, data: bytes) -> None:
    modules = set(sys.modules)
    try:
        root = interp(data, handlers=handlers_for(interp)[1]).root
    except PickleDataError:
        pass
    else:
        assert isinstance(root, (Reduced, Global))
    assert set(sys.modules) == modules


@pytest.mark.parametrize("build", [
    lambda: deep_tuple_key(150_000),
    lambda: P2 + b"(" * 150_000 + b"l" * 150_000 + b".",
    lambda: P2 + b"]" * 150_000 + b"a" * 149_999 + b".",
    lambda: P2 + b"}" + b"N" + b"\x85" * 150_000 + b"\x91K\x01s.",
], ids=["tuple-key", "mark-lists", "appends", "frozenset-key"])
def test_deep_nesting_is_iterative(interp: Any, build: Any) -> None:
    data = build()
    try:
        root = interp(data).root
    except PickleDataError:
        return
    if isinstance(root, dict):  # the deep key is hashed by identity
        (key,) = root
        assert isinstance(key, (OpaqueKey, frozenset))
        if isinstance(key, frozenset):
            (member,) = key
            assert isinstance(member, OpaqueKey)
    depth = 0
    while isinstance(root, list) and root:
        root, depth = root[0], depth + 1
    assert depth in (0, 149_999)


def test_keys_hashed_by_identity_past_their_limits(interp: Any) -> None:
    flat = b"(" + b"K\x01" * 65 + b"t"
    data = P2 + b"}" + flat + b"q\x00K\x01sh\x00K\x02s" + flat + b"K\x03s."
    root = interp(data).root
    first, second = root  # the same tuple object is one key, an equal one another
    assert isinstance(first, OpaqueKey) and isinstance(second, OpaqueKey)
    assert root[first] == 2 and root[second] == 3 and first.value == (1,) * 65
    big = b"\x8a\x09" + b"\x00" * 8 + b"\x01"  # 2**64
    (key,) = interp(P2 + b"}" + big + b"Ns.").root
    assert isinstance(key, OpaqueKey) and key.value == 2**64
    root = interp(P2 + b"}K\x01" + big + b"\x86K\x01s]\x85K\x02s.").root
    assert all(isinstance(k, OpaqueKey) for k in root)
    assert interp(P2 + b"\x8f(K\x01K\x01]\x90.").root.__len__() == 2


# -- the budget ------------------------------------------------------------------------------
@pytest.mark.parametrize("opcode,charge", [(b"\x8f", 256), (b"(", 88), (b"}", 96),
                                           (b"]", 88)])
def test_one_byte_amplifiers_run_out_at_their_opcode(interp: Any, opcode: bytes,
                                                     charge: int) -> None:
    data = amplifier(opcode, 1_000_000)
    budget = MEMORY_PER_BYTE * len(data)
    error = fails(interp, data, "bytes of memory per byte of input")
    assert isinstance(error, PickleBudgetError)
    assert error.offset == 2 + budget // charge  # the first opcode past the budget


def test_memoize_amplifier_fits(interp: Any) -> None:
    assert interp(amplifier(b"\x94", 1_000_000)).root is None


def test_distinct_globals(interp: Any) -> None:
    result = interp(distinct_globals(80_000))
    assert result.root is None and len(result.globals) == 80_000


STRINGS = P2 + b"X\x03\x00\x00\x00abcX\x03\x00\x00\x00abc\x86."
SPARSE = P2 + b"Nr\x00\x00\x01\x00r\x00\x00\x01\x00."


@pytest.mark.parametrize("data,per_byte,offset", [
    (P2 + b"]]]\x87.", 29, 4),  # 203 bytes: two lists (88 each) fit, the third does not
    (STRINGS, 10, 10),  # 200 bytes: a 3-byte BINUNICODE is 108
    (STRINGS, 15, 18),  # 300 bytes: the strings fit, their TUPLE2 (88) does not
    (P2 + b"Nq\x00q\x01q\x02.", 4, 5),  # 40 bytes: None 16, each new memo entry 16
    (SPARSE, 10, 3),  # 140 bytes: None 16, a sparse memo entry 128
    (P2 + b"cm\nf\n)R.", 32, 2),  # 320 bytes: GLOBAL m.f is 320 + 4 * 2 (+ 16)
    (P2 + b"cm\nf\n)R.", 39, 8),  # 390 bytes: then EMPTY_TUPLE 16, REDUCE 320
])
def test_budget_runs_out_at_the_same_opcode(interp: Any, monkeypatch: pytest.MonkeyPatch,
                                            data: bytes, per_byte: int, offset: int) -> None:
    from ckptlab.format import _unpickle

    monkeypatch.setattr(_unpickle, "MEMORY_FLOOR", 0)
    error = fails(interp, data, "budget exceeded", memory_per_byte=per_byte)
    assert isinstance(error, PickleBudgetError) and error.offset == offset
    interp(data, memory_per_byte=1000)  # with room, it reads


def test_a_sparse_memo_entry_is_charged_once(interp: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlab.format import _unpickle

    monkeypatch.setattr(_unpickle, "MEMORY_FLOOR", 0)
    assert interp(SPARSE, memory_per_byte=11).root is None  # 154 bytes: 16 + 128 (+ 0)


def test_huge_ints_are_refused_or_printable(interp: Any) -> None:
    value = 10**4301
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    fails(interp, P2 + b"\x8b" + struct.pack("<i", len(raw)) + raw + b".", "an int of")
    big = interp(P2 + b"\x8a\xff" + b"\x7f" * 255 + b".").root
    assert big == int.from_bytes(b"\x7f" * 255, "little") and str(big)


# -- truncation and mutation of real pickles -------------------------------------------------
MIXED = {"a": [1, 2.5, "xy", (3, None, b"b")], "b": {1, 2}, "c": frozenset({"z"}),
         "d": [[[]]], "e": bytearray(b"q"), "f": 2**100, "g": OrderedDict(k=1)}


@pytest.mark.parametrize("protocol", range(6))
def test_truncation_at_every_byte(interp: Any, protocol: int) -> None:
    data = pickle.dumps(MIXED, protocol=protocol)
    interp(data, handlers=handlers_for(interp)[1])
    for cut in range(len(data)):
        with pytest.raises(PickleDataError) as info:
            interp(data[:cut], handlers=handlers_for(interp)[1])
        assert 0 <= info.value.offset <= cut, cut


@settings(max_examples=200)
@given(data=opcode_streams())
def test_random_opcode_streams(interp: Any, data: bytes) -> None:
    handlers, table = handlers_for(interp)
    try:
        interp(data, handlers=table, persistent_load=handlers.load_pid,
               build=handlers.build)
    except PickleDataError as error:
        assert 0 <= error.offset < len(data)


@settings(max_examples=200)
@given(data=pickle_mutations(pickle.dumps(MIXED, protocol=2)))
def test_mutated_pickles(interp: Any, data: bytes) -> None:
    try:
        interp(data, handlers=handlers_for(interp)[1])
    except PickleDataError as error:
        assert 0 <= error.offset < len(data)


# -- torch's own pickles -------------------------------------------------------------------
def data_pkl(obj: Any, protocol: int = 2) -> tuple[bytes, zipfile.ZipFile]:
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf, pickle_protocol=protocol, _use_new_zipfile_serialization=True)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    return archive.read(name), archive


def torch_objects() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                torch.nn.Linear(3, 2, bias=False), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(24, dtype=torch.float32)
    state = {**model.state_dict(), "view": base[2:14].view(3, 4), "t": base[:12].view(3, 4).t(),
             "base": base, "half": torch.ones(2, dtype=torch.float16), "step": 7}
    return {"state_dict": state, "module": model, "optimizer": opt.state_dict()}


def torch_tensors(obj: Any) -> dict[tuple[Any, ...], Any]:
    """Every tensor of a torch.load result by the path ckptlab's walk names it."""
    import torch

    found: dict[tuple[Any, ...], Any] = {}
    todo = [((), obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, dict):
            todo.extend(((*path, k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            todo.extend(((*path, i), v) for i, v in enumerate(value))
        elif isinstance(value, torch.nn.Module):
            todo.extend(((*path, k), v) for k, v in vars(value).items())
    return found


def assert_torch_loads_tensors(interp: Any, obj: Any, protocol: int) -> Any:
    """``obj`` saved, its data.pkl interpreted with torch's handlers: the tensors (paths,
    shapes, strides, offsets, dtypes, storage keys) torch.load gives; the root."""
    import torch

    data, archive = data_pkl(obj, protocol)
    handlers, table = handlers_for(interp)
    result = interp(data, handlers=table, persistent_load=handlers.load_pid,
                    build=handlers.build)
    found = dict(_walk(result.root)[0])
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf, pickle_protocol=protocol)
    buf.seek(0)
    meta = torch_tensors(torch.load(buf, map_location="meta", weights_only=False))
    buf.seek(0)
    cpu = torch_tensors(torch.load(buf, map_location="cpu", weights_only=False))
    assert set(found) == set(meta)
    for path, ref in found.items():
        t = meta[path]
        assert type(ref) is _TensorRef
        assert (ref.shape, ref.stride, ref.storage_offset) == (
            tuple(t.shape), t.stride(), t.storage_offset()), path
        assert ref.dtype == str(t.dtype).removeprefix("torch.")
        assert ref.requires_grad == t.requires_grad
        assert ref.is_parameter == isinstance(t, torch.nn.Parameter)
        record = f"{archive.namelist()[0].split('/')[0]}/data/{ref.storage.key}"
        assert archive.getinfo(record).file_size == ref.storage.nbytes
    # tensors share a storage key exactly where torch.load gives them one storage
    by_key: dict[str, set[Any]] = {}
    by_ptr: dict[int, set[Any]] = {}
    for path, ref in found.items():
        if ref.storage.nbytes:  # (empty storages have no address to tell them apart)
            by_key.setdefault(ref.storage.key, set()).add(path)
            by_ptr.setdefault(cpu[path].untyped_storage().data_ptr(), set()).add(path)
    def groups(by: dict[Any, set[Any]]) -> list[list[str]]:
        return sorted(sorted(map(repr, paths)) for paths in by.values())

    assert groups(by_key) == groups(by_ptr)
    return result.root


@pytest.mark.parametrize("protocol", range(1, 6))  # (protocol 0 writes ids as their repr)
@pytest.mark.parametrize("kind", ["state_dict", "module", "optimizer"])
def test_torch_pickles_give_torch_loads_tensors(interp: Any, kind: str,
                                                protocol: int) -> None:
    pytest.importorskip("torch")
    root = assert_torch_loads_tensors(interp, torch_objects()[kind], protocol)
    if kind == "module":
        assert root.func.qualname == "torch.nn.modules.container.Sequential"
    assert len(_walk(root)[0]) >= 8


def test_random_state_dicts(interp: Any) -> None:
    pytest.importorskip("torch")
    from ckptlab.testing.strategies import state_dicts

    @settings(max_examples=40)
    @given(obj=state_dicts(), protocol=st.integers(2, 5))
    def check(obj: Any, protocol: int) -> None:
        assert_torch_loads_tensors(interp, obj, protocol)

    check()


def test_build_on_a_storage_stand_in_is_refused(interp: Any) -> None:
    storage = (b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
               b"X\x03\x00\x00\x00cpuK\x04tQ")
    handlers, table = handlers_for(interp)
    error = fails(interp, P2 + storage + b"}b.", "BUILD applied to StorageRef", handlers=table,
                  persistent_load=handlers.load_pid, build=handlers.build)
    assert error.offset == len(P2 + storage) + 1


def test_torch_state_dict_is_a_state_dict(interp: Any) -> None:
    pytest.importorskip("torch")
    data, _ = data_pkl(torch_objects()["module"].state_dict())
    handlers, table = handlers_for(interp)
    root = interp(data, handlers=table, persistent_load=handlers.load_pid,
                  build=handlers.build).root
    assert type(root) is dict and list(root)[:2] == ["0.weight", "0.bias"]
    # BUILD of the state dict's metadata, kept beside it
    assert isinstance(handlers.dict_attrs[id(root)][1]["_metadata"], dict)


def test_truncated_torch_pickle(interp: Any) -> None:
    pytest.importorskip("torch")
    data, _ = data_pkl(torch_objects()["optimizer"])
    for cut in range(len(data)):
        handlers, table = handlers_for(interp)
        with pytest.raises(PickleDataError) as info:
            interp(data[:cut], handlers=table, persistent_load=handlers.load_pid,
                   build=handlers.build)
        assert 0 <= info.value.offset <= cut, cut


def test_interpreter_choice() -> None:
    with pytest.raises(ValueError, match="impl"):
        interpreter("rust")
    try:
        from ckptlab.format._interp import interpret as compiled
    except ImportError:
        assert interpreter(None).func.__name__ == "interpret"  # type: ignore[attr-defined]
    else:
        assert interpreter(None) is compiled


# -- the torch handlers: the compiled ones held to the Python ones ----------------------------
# ``torch_handlers("c")`` puts the hot four (persistent_load, rebuild_v2, rebuild_parameter,
# ordered_dict) of ``_TorchHandlers`` in C (``_interp.TorchCore``): the same result for every
# argument list, by doing the common case in C and giving anything else to the Python method
# (``core.fallback``). Each case below calls both on the same arguments and compares results,
# errors (type and message) and the storage tables they leave.
HOT = ("persistent_load", "rebuild_v2", "rebuild_parameter", "ordered_dict", "make_set",
       "make_frozenset")


@pytest.fixture
def core_pair() -> tuple[Any, Any]:
    """Fresh Python handlers and compiled ones (skipped where the extension is not built,
    failed under ``CI``)."""
    try:
        compiled = torch_handlers("c")[0]
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ckptlab.format._interp is not built (pip install -e . with gcc)")
        pytest.skip("ckptlab.format._interp is not built (no C compiler at install)")
    return torch_handlers("python")[0], compiled


def _state(value: Any) -> Any:
    """A value as comparable data: records as themselves, ckptlab's mutable tensor records
    (``_PendingTensor``, ``_CompositeRef``) as their type and fields."""
    from ckptlab.format._tensor_refs import _CompositeRef, _PendingTensor

    if isinstance(value, (_PendingTensor, _CompositeRef)):
        return type(value), tuple(_state(getattr(value, f)) for f in type(value).__slots__)
    if isinstance(value, (set, frozenset)):  # (OpaqueKey members are equal by identity)
        return type(value), sorted(repr(_state(m.value if isinstance(m, OpaqueKey) else m))
                                   for m in value)
    return type(value), value


def _outcome(func: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """``("value", func(*args, **kwargs))``, or ``("error", (its type, its message))``."""
    try:
        return "value", func(*args, **kwargs)
    except Exception as exc:  # every error is compared, type and message
        return "error", (type(exc), str(exc))


def assert_same_call(py: Any, c: Any, name: str, *args: Any, fresh: Any = None,
                     **kwargs: Any) -> Any:
    """``py.<name>(*args, **kwargs)`` and ``c.core.<name>(...)`` give equal results (values
    of the same type, records equal, or the same error type and message) and leave equal
    storage tables; ``fresh``: makes the arguments anew for each side (for arguments the
    Python handler changes in place). The compiled side's outcome."""
    a = _outcome(getattr(py, name), *(fresh() if fresh else args), **kwargs)
    b = _outcome(getattr(c.core, name), *(fresh() if fresh else args), **kwargs)
    assert a[0] == b[0], (name, args, kwargs, a, b)
    if a[0] == "value":
        assert _state(a[1]) == _state(b[1]), (name, args, kwargs)
    else:
        assert a[1] == b[1], (name, args, kwargs)
    assert py.storages == c.storages and py.storage_order == c.storage_order
    if b[0] == "value" and name == "persistent_load":  # the stored ref itself, not a copy
        assert b[1] is c.storages[b[1].key]
    return b


def test_core_shares_the_storage_table(core_pair: tuple[Any, Any]) -> None:
    _, c = core_pair
    assert c.core is not None and c.load_pid == c.core.persistent_load
    ref = c.load_pid(("storage", Global("torch", "FloatStorage"), "0", "cpu", 4))
    assert c.storages == {"0": ref} and c.storage_order == ["0"]
    assert c.persistent_load(("storage", Global("torch", "ByteStorage"), "0", "cpu", 16)) is ref
    assert c.load_pid(("storage", Global("torch", "IntStorage"), "0", "cuda", 4)) is ref
    # the table holds the core's four and the Python handlers' others
    table = c.table()
    assert table[("torch._utils", "_rebuild_tensor_v2")] == c.core.rebuild_v2
    assert table[("torch._utils", "_rebuild_parameter")] == c.core.rebuild_parameter
    assert table[("collections", "OrderedDict")] == c.core.ordered_dict
    assert table[("torch._utils", "_rebuild_tensor")] == c.rebuild_v1
    assert torch_handlers("python")[0].core is None


FLOAT, BYTE, UNTYPED = (Global("torch", "FloatStorage"), Global("torch", "ByteStorage"),
                        Global("torch.storage", "UntypedStorage"))


class Text(str):
    """A str subclass: taken by the Python handlers, left to them by the compiled ones."""


class Number(int):
    pass


PIDS = [
    ("storage", FLOAT, "0", "cpu", 4),
    ("storage", FLOAT, "0", "cpu", 4),  # the same again: the same ref
    ("storage", BYTE, "0", "cpu", 16),  # another class over the same bytes
    ("storage", BYTE, "0", "cpu", 15),  # ... and different ones: refused
    ("storage", UNTYPED, "1", "cuda:0", 0),
    ("storage", Global("torch", "HalfStorage"), Text("2"), "cpu", 3),
    ("storage", FLOAT, "2", "cpu", 1),  # Text("2") == "2": 6 bytes, now 4
    ("storage", FLOAT, "3", Text("cpu"), 1), (Text("storage"), FLOAT, "4", "cpu", 1),
    ("storage", FLOAT, "5", "cpu", -1), ("storage", FLOAT, "5", "cpu", True),
    ("storage", FLOAT, "5", "cpu", 1.0), ("storage", FLOAT, "5", "cpu", Number(2)),
    ("storage", FLOAT, "6", "cpu", 2**61), ("storage", FLOAT, "7", "cpu", 2**63),
    ("storage", FLOAT, "8", "cpu", 2**200), ("storage", FLOAT, "8", "cpu", 2**200),
    ("storage", FLOAT, "9", "cpu", (2**63 - 1) // 4), ("storage", FLOAT, "9", "cpu", 2**61 + 1),
    ("storage", Global("torch", "Float"), "10", "cpu", 1),
    ("storage", Global("torch.cuda", "FloatStorage"), "10", "cpu", 1),
    ("storage", "FloatStorage", "10", "cpu", 1), ("storage", None, "10", "cpu", 1),
    ("storage", FLOAT, 10, "cpu", 1), ("storage", FLOAT, "10", None, 1),
    ("storage", FLOAT, b"10", "cpu", 1), ("Storage", FLOAT, "10", "cpu", 1),
    (b"storage", FLOAT, "10", "cpu", 1), ("storage", FLOAT, "10", "cpu"),
    ("storage", FLOAT, "10", "cpu", 1, "extra"), ("module", "name"), (), "storage",
    ["storage", FLOAT, "10", "cpu", 1], None,
    ("storage", FLOAT, (), "cpu", 1),
    ("storage", FLOAT, [], "cpu", 1),
    ("storage", Global(Text("torch"), "LongStorage"), "11", "cpu", 2),
    ("storage", Global("torch", Text("LongStorage")), "12", "cpu", 2),
    ("storage", Global("torch", "ComplexDoubleStorage"), "13", "cpu", 3),
    ("storage", Global("torch", "BoolStorage"), "0", "cpu", 16),  # "0" again: 16 bytes
]


def test_core_persistent_load(core_pair: tuple[Any, Any]) -> None:
    py, c = core_pair
    for pid in PIDS:
        assert_same_call(py, c, "persistent_load", pid)
    assert c.storage_order == ["0", "1", "2", "3", "4", "6", "7", "8", "9", "11", "12", "13"]
    assert_same_call(py, c, "persistent_load")  # (TypeError: no pid)
    assert_same_call(py, c, "persistent_load", PIDS[0], PIDS[0])
    assert_same_call(py, c, "persistent_load", pid=PIDS[0])
    assert_same_call(py, c, "persistent_load", PIDS[0], other=1)


@st.composite
def pids(draw: Any) -> Any:
    part = st.sampled_from
    pid = [draw(part(["storage", "storage", Text("storage"), "Storage", b"storage"])),
           draw(part([FLOAT, BYTE, UNTYPED, Global("torch", "DoubleStorage"),
                      Global("torch", "Bogus"), Global("other", "FloatStorage"),
                      "FloatStorage", None])),
           draw(part(["0", "1", "2", Text("1"), 1, None])),
           draw(part(["cpu", "cuda:0", Text("cpu"), None])),
           draw(st.one_of(st.integers(-2, 40), st.integers(), part([True, 1.0, 2**62, 2**64])))]
    shape = draw(part(["tuple", "tuple", "tuple", "short", "long", "list"]))
    if shape == "short":
        return tuple(pid[:draw(st.integers(0, 4))])
    if shape == "long":
        return (*pid, None)
    return pid if shape == "list" else tuple(pid)


@settings(max_examples=300)
@given(calls=st.lists(pids(), max_size=12))
def test_core_persistent_load_random(calls: list[Any]) -> None:
    try:
        py, c = torch_handlers("python")[0], torch_handlers("c")[0]
    except ImportError:
        pytest.skip("ckptlab.format._interp is not built")
    for pid in calls:
        assert_same_call(py, c, "persistent_load", pid)


def _storage() -> Any:
    from ckptlab.format._tensor_refs import StorageRef

    return StorageRef("0", "FloatStorage", "float32", "cpu", 24, 96)


V2_ARGS = [
    (0, (2, 3), (3, 1)), (0, (2, 3), (3, 1), False), (5, (2, 3), (3, 1), True),
    (0, (), ()), (0, (0,), (1,)), (2**70, (2**70,), (2**65,)),
    (0, (2, 3), (3, 1), True, None, "more", "args"),
    (-1, (2,), (1,)), (True, (2,), (1,)), (1.0, (2,), (1,)), (Number(1), (2,), (1,)),
    (None, (2,), (1,)), (0, [2, 3], [3, 1]), (0, (2, 3), [3, 1]), (0, (2, 3), (3,)),
    (0, (2, -3), (3, 1)), (0, (2, 3), (3, -1)), (0, (2, True), (3, 1)),
    (0, (2, 3.0), (3, 1)), (0, (2, Number(3)), (3, 1)), (0, (2, 3), (3, 1), 1),
    (0, (2, 3), (3, 1), 0), (0, (2, 3), (3, 1), None), (0, (2, 3), (3, 1), "yes"),
    (0, (1,) * 64, (1,) * 64), (0, (1,) * 65, (1,) * 65), (0, (1,) * 65, (1,) * 64),
    (0, [1] * 65, [1] * 65), (0, "ab", "ab"), (0, None, None), (0, (2,)), (0,), (),
]


def test_core_rebuild_v2(core_pair: tuple[Any, Any]) -> None:
    from ckptlab.format._tensor_refs import StorageRef

    py, c = core_pair
    storage = _storage()
    for args in V2_ARGS:
        assert_same_call(py, c, "rebuild_v2", storage, *args)
    other = _TensorRef(storage, 0, (1,), (1,), False, "float32")
    for bad in (None, "0", other, (storage,), StorageRef("x", "s", "int8", "cpu", 0, 0)):
        assert_same_call(py, c, "rebuild_v2", bad, 0, (2,), (1,))
    made = c.core.rebuild_v2(storage, 3, (2, 3), (3, 1), True)
    assert made == _TensorRef(storage, 3, (2, 3), (3, 1), True, "float32")
    assert made.storage is storage and made.is_parameter is False
    assert_same_call(py, c, "rebuild_v2", storage=storage, offset=0, size=(1,), stride=(1,))
    assert_same_call(py, c, "rebuild_v2", storage, 0, (1,), (1,), requires_grad=True)
    assert_same_call(py, c, "rebuild_v2", storage, 0, (1,), (1,), nonsense=True)
    # torch's metadata argument (the conjugate / negative bits): empty or None as without it
    for metadata in (None, {}, {"conj": True}, {"neg": True}, {"conj": True, "neg": False},
                     {"conj": 1}, {"other": True}, [], "conj", OrderedDict(conj=True)):
        assert_same_call(py, c, "rebuild_v2", storage, 0, (2,), (1,), False, {}, metadata)
    assert c.core.rebuild_v2(storage, 0, (2,), (1,), False, {}, {"neg": True}).metadata == \
        (("neg", True),)
    # a Parameter of such a tensor keeps the bits, on both sides
    bits = _TensorRef(storage, 0, (2,), (1,), False, "float32", metadata=(("conj", True),))
    made = assert_same_call(py, c, "rebuild_parameter", bits, True, {})[1]
    assert made.metadata == (("conj", True),) and made.is_parameter


@settings(max_examples=300)
@given(args=st.lists(st.one_of(
    st.integers(-3, 5), st.sampled_from([True, False, None, 2**64, 1.5, "x", [], ()]),
    st.lists(st.integers(-1, 4), max_size=3).map(tuple),
    st.lists(st.integers(-1, 4), max_size=3),
    st.lists(st.one_of(st.integers(0, 3), st.booleans()), max_size=3).map(tuple)),
    max_size=6))
def test_core_rebuild_v2_random(args: list[Any]) -> None:
    try:
        py, c = torch_handlers("python")[0], torch_handlers("c")[0]
    except ImportError:
        pytest.skip("ckptlab.format._interp is not built")
    assert_same_call(py, c, "rebuild_v2", _storage(), *args)
    if len(args) >= 3:  # (the size and stride of one length, where the draw allows)
        args[2] = args[1] if isinstance(args[1], tuple) else args[2]
        assert_same_call(py, c, "rebuild_v2", _storage(), *args)


def _tensor(**changes: Any) -> Any:
    fields = {"storage": _storage(), "storage_offset": 2, "shape": (2, 3), "stride": (3, 1),
              "requires_grad": False, "dtype": "float32", **changes}
    return _TensorRef(**fields)


def _pending(built: bool) -> Any:
    from ckptlab.format._tensor_refs import _PendingTensor

    tensor = _PendingTensor(False)
    if built:
        tensor.ckptlab_build((_storage(), 0, (4,), (1,)))
    return tensor


def _composite() -> Any:
    from ckptlab.format._tensor_refs import _CompositeRef

    return _CompositeRef("sparse", "float32", (3,), [("values", _tensor())])


def test_core_rebuild_parameter(core_pair: tuple[Any, Any]) -> None:
    py, c = core_pair
    tensors = [_tensor(), _tensor(requires_grad=True, subclass="m.T", attrs={"a": 1}),
               _tensor(is_parameter=True), _tensor(storage=None)]
    for data in tensors:
        for rest in [(), (True,), (False,), (1,), (0,), (None,), ("",), ([],), (True, None),
                     (True, {"hook": 1}), (True, None, None), (False, None, {}),
                     (True, None, {"x": 1}), (True, None, ({"x": 1}, {})),
                     (True, None, None, "more")]:
            assert_same_call(py, c, "rebuild_parameter", data, *rest)
    made = c.core.rebuild_parameter(tensors[1], False)
    assert made == _TensorRef(tensors[1].storage, 2, (2, 3), (3, 1), False, "float32", True,
                              "m.T", {"a": 1})
    for fresh in (lambda: (_pending(True), True), lambda: (_pending(False), 1),
                  lambda: (_composite(), True), lambda: (_composite(), 0, None, {"s": 1})):
        assert_same_call(py, c, "rebuild_parameter", fresh=fresh)
    for data in (None, "x", _storage(), 5):
        assert_same_call(py, c, "rebuild_parameter", data, True)
    assert_same_call(py, c, "rebuild_parameter")
    assert_same_call(py, c, "rebuild_parameter", data=_tensor(), requires_grad=True)
    assert_same_call(py, c, "rebuild_parameter", _tensor(), True, unknown=1)


def test_core_ordered_dict(core_pair: tuple[Any, Any]) -> None:
    import gc

    py, c = core_pair
    for args in [(), (None,), ((),), ([],), ([1],), ((1,),), ({},), ("",), (0,), (False,),
                 ([("a", 1)],), (None, None), (OrderedDict(),)]:
        assert_same_call(py, c, "ordered_dict", *args)
    assert_same_call(py, c, "ordered_dict", items=None)
    assert_same_call(py, c, "ordered_dict", items=[1])
    assert_same_call(py, c, "ordered_dict", other=None)
    made = c.core.ordered_dict()
    assert made == {} and type(made) is dict and not gc.is_tracked(made)
    assert c.core.ordered_dict(None) is not made


@pytest.mark.parametrize("name", ["make_set", "make_frozenset"])
def test_core_sets(core_pair: tuple[Any, Any], name: str) -> None:
    py, c = core_pair

    class Text(str):
        pass

    for args in [(), ([],), ((),), (["a", 1, 2.5, True, b"x"],), (("a", "a", 1, 1.0),),
                 ([float("nan")],), ([(1, 2)],), ([[1]],), ([None],), ([Text("t")],),
                 ({1, 2},), ("ab",), (None,), (0,), ([1], [2]), (OrderedDict(),)]:
        assert_same_call(py, c, name, *args)
    assert_same_call(py, c, name, items=[1])
    assert_same_call(py, c, name, other=[1])
    kind = set if name == "make_set" else frozenset
    assert type(getattr(c.core, name)([1, "a"])) is kind
    member = next(iter(getattr(c.core, name)([(1, 2)])))
    assert isinstance(member, OpaqueKey) and member.value == (1, 2)  # (by the fallback)


def test_core_rebuild_from_type_dispatches_to_it(core_pair: tuple[Any, Any]) -> None:
    py, c = core_pair
    for h in (py, c):
        h.table()
    v2 = Global("torch._utils", "_rebuild_tensor_v2")
    storage = _storage()
    for new_type, args, state in [
        (Global("torch.nn.parameter", "Parameter"), (storage, 0, (2,), (1,)), None),
        (Global("torch", "Tensor"), (storage, 0, (2,), (1,), True), {"a": 1}),
        (Global("m", "Sub"), (storage, 0, (2,), (1,)), None),
        (Global("m", "Sub"), (storage, -1, (2,), (1,)), None),
    ]:
        a = _outcome(py.rebuild_from_type, v2, new_type, args, state)
        b = _outcome(c.rebuild_from_type, v2, new_type, args, state)
        assert a == b


class _Counting:
    """A _TorchHandlers whose four hot methods count their calls (the core's fallback)."""

    def __init__(self) -> None:
        from ckptlab.format._torch_handlers import _TorchHandlers

        class Handlers(_TorchHandlers):
            calls: ClassVar[list[str]] = []

        for name in HOT:
            def counted(self: Any, *args: Any, __name: str = name, **kwargs: Any) -> Any:
                self.calls.append(__name)
                return getattr(super(Handlers, self), __name)(*args, **kwargs)
            setattr(Handlers, name, counted)
        self.handlers = Handlers()
        self.calls = Handlers.calls


def test_core_takes_the_common_case_itself(core_pair: tuple[Any, Any]) -> None:
    """What torch.save writes never reaches the Python methods; the rest always does."""
    from ckptlab.format._interp import TorchCore

    from ckptlab.format._tensor_refs import StorageRef
    from ckptlab.format._torch_handlers import _STORAGE_DTYPES

    counting = _Counting()
    core = TorchCore(counting.handlers, StorageRef, _TensorRef, _STORAGE_DTYPES)
    ref = core.persistent_load(("storage", FLOAT, "0", "cpu", 6))
    assert core.persistent_load(("storage", BYTE, "0", "cpu", 24)) is ref
    tensor = core.rebuild_v2(ref, 0, (2, 3), (3, 1), False)
    core.rebuild_v2(ref, 0, (2, 3), (3, 1))
    core.rebuild_v2(ref, 0, (2, 3), (3, 1), True, None)
    core.rebuild_parameter(tensor, True, OrderedDict())
    core.rebuild_parameter(tensor, False, OrderedDict(), None)
    core.ordered_dict()
    core.ordered_dict(None)
    assert counting.calls == []
    assert counting.handlers.storages == {"0": ref}
    for name, args in [("persistent_load", (("storage", FLOAT, "0", "cpu", 5),)),
                       ("persistent_load", (("storage", FLOAT, Text("1"), "cpu", 5),)),
                       ("rebuild_v2", (ref, 0, [2, 3], (3, 1))),
                       ("rebuild_v2", (ref, 0, (2, 3), (3, 1), 1)),
                       ("rebuild_parameter", (tensor, 1)),
                       ("rebuild_parameter", (tensor, True, None, {"a": 1})),
                       ("ordered_dict", ([("k", 1)],))]:
        _outcome(getattr(core, name), *args)
        assert counting.calls[-1] == name
    core.ordered_dict(items=None)
    assert counting.calls[-1] == "ordered_dict" and len(counting.calls) == 8


def test_core_keeps_no_references_it_should_not(core_pair: tuple[Any, Any]) -> None:
    """Reference counts of the arguments are as before after each path (fast and fallback,
    value and error), and handlers dropped are collected (the core is in a cycle with them)."""
    import gc
    import weakref

    _, c = core_pair
    kind = Global("torch", "FloatStorage")
    storage, size, stride, key = _storage(), (2, 3), (3, 1), "k" + str(os.getpid())
    pid = ("storage", kind, key, "cpu", 6)
    c.core.persistent_load(pid)
    cases = [("persistent_load", (pid,)), ("persistent_load", (("storage", kind, key, "cpu", 7),)),
             ("rebuild_v2", (storage, 0, size, stride)),
             ("rebuild_v2", (storage, -1, size, stride)),
             ("rebuild_parameter", (_tensor(), True)), ("rebuild_parameter", (_tensor(), 1)),
             ("ordered_dict", ()), ("ordered_dict", ([1],))]
    gc.collect()
    gc.disable()  # (a collection of earlier tests' garbage changes what we count)
    try:
        for name, args in cases:
            watched = [pid, kind, key, storage, size, stride, *args]
            _outcome(getattr(c.core, name), *args)  # (what the handlers cache, once)
            before = [sys.getrefcount(o) for o in watched]
            for _ in range(50):
                _outcome(getattr(c.core, name), *args)
            assert [sys.getrefcount(o) for o in watched] == before, name
    finally:
        gc.enable()
    dropped = torch_handlers("c")[0]
    dropped.core.persistent_load(pid)
    alive = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert alive() is None


def test_core_refuses_a_bad_setup() -> None:
    try:
        from ckptlab.format._interp import TorchCore
    except ImportError:
        pytest.skip("ckptlab.format._interp is not built")
    from ckptlab.format._tensor_refs import StorageRef
    from ckptlab.format._torch_handlers import _STORAGE_DTYPES, _TorchHandlers

    fallback = _TorchHandlers()
    with pytest.raises(TypeError):
        TorchCore(fallback, StorageRef, _TensorRef)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        TorchCore(fallback, StorageRef, "not a class", _STORAGE_DTYPES)
    with pytest.raises(TypeError, match="itemsize"):
        TorchCore(fallback, StorageRef, _TensorRef, {"FloatStorage": ("float32", 0)})
    with pytest.raises(TypeError, match="itemsize"):
        TorchCore(fallback, StorageRef, _TensorRef, {"FloatStorage": "float32"})
    with pytest.raises(AttributeError):
        TorchCore(object(), StorageRef, _TensorRef, _STORAGE_DTYPES)
    fallback.storages = OrderedDict()  # type: ignore[assignment]
    with pytest.raises(TypeError, match="storages"):
        TorchCore(fallback, StorageRef, _TensorRef, _STORAGE_DTYPES)


def test_handlers_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlab.format import _torch_handlers

    with pytest.raises(ValueError, match="impl"):
        torch_handlers("rust")
    assert torch_handlers("python")[0].core is None
    built = _torch_handlers._TorchCore is not None
    assert (torch_handlers()[0].core is not None) == built
    monkeypatch.setattr(_torch_handlers, "_TorchCore", None)
    with pytest.raises(ImportError):
        torch_handlers("c")
    assert torch_handlers()[0].core is None


@pytest.mark.parametrize("impl", ["python", "c"])
def test_one_switch_picks_interpreter_and_handlers(impl: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlab.format import _pickle

    try:
        expected = interpreter(impl)
    except ImportError:
        pytest.skip("ckptlab.format._interp is not built")
    used = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        used.append(kwargs["persistent_load"])
        return expected(*args, **kwargs)

    monkeypatch.setattr(_pickle, "_IMPL", impl)
    monkeypatch.setattr(_pickle, "interpreter", lambda which: spy if which == impl else None)
    storage = (b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
               b"X\x03\x00\x00\x00cpuK\x04tQ")
    handlers, result = _pickle._interpret(P2 + storage + b".", None, None)
    assert (handlers.core is None) == (impl == "python")
    assert used == [handlers.load_pid]
    assert result.root is handlers.storages["0"]


def test_memo_reads_are_the_pickles_gets() -> None:
    """``memo_reads``: exactly the indices BINGET / LONG_BINGET read (as pickletools lists
    them), None where it cannot follow the pickle; the memo keeps only those entries."""
    import pickle
    import pickletools

    from ckptlab.format._optable import memo_reads

    shared = [1, 2]
    obj = {"a": shared, "b": shared, "c": [shared] * 3, "d": ("x",) * 300, "e": [[0]] * 260}
    for protocol in (2, 3, 4, 5):
        data = pickle.dumps(obj, protocol=protocol)
        gets = {arg for op, arg, _ in pickletools.genops(data)
                if op.name in ("BINGET", "LONG_BINGET")}
        assert memo_reads(data) == gets and gets
        assert memo_reads(bytearray(data)) == gets
        for cut in (1, len(data) // 2, len(data) - 1):
            assert memo_reads(data[:cut]) is None  # (no STOP: keep every entry)
    assert memo_reads(pickle.dumps(obj, protocol=0)) is None  # a protocol-0 GET
    assert memo_reads(b"\x80\x02\xff.") is None  # an unknown opcode
    assert memo_reads(b"\x80\x02T\xff\xff\xff\xff.") is None  # a negative BINSTRING length
    assert memo_reads(b"\x80\x02N.") == set()


@st.composite
def memo_programs(draw: Any) -> bytes:
    """Protocol-4 pickles that store many memo entries (past several 512-index blocks of
    the compiled memo's rank table), overwrite some with BINPUT / LONG_BINPUT, and read a
    scattered few with BINGET / LONG_BINGET: a list of what each step pushed."""
    out = [b"\x80\x04]\x94(K\x07\x94"]  # EMPTY_LIST MEMOIZE(0) MARK 7 MEMOIZE(1)
    stored = 2
    for _ in range(draw(st.integers(1, 300))):
        step = draw(st.integers(0, 9))
        if step <= 5:  # a run of new entries
            for _ in range(draw(st.integers(1, 40))):
                out.append(b"J" + struct.pack("<i", stored) + b"\x94")
                stored += 1
        elif step <= 7:  # read one stored entry
            index = draw(st.integers(1, stored - 1))  # (0: the list itself)
            out.append(b"h" + bytes([index]) if index < 256 else
                       b"j" + struct.pack("<I", index))
        else:  # overwrite a stored entry (read or not) with a new value
            index = draw(st.integers(1, stored - 1))
            value = draw(st.integers(-1000, -1))
            put = b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)
            out.append(b"J" + struct.pack("<i", value) + put)
    out.append(b"e.")  # APPENDS STOP
    return b"".join(out)


@settings(max_examples=150, deadline=None)
@given(data=memo_programs())
def test_memo_slots_for_read_entries_only(interp: Any, data: bytes) -> None:
    """The compiled memo keeps a slot only for entries some GET reads (found by a rank over
    the read bits); every read still sees the last value stored at its index."""
    assert interp(data).root == pickle.loads(data)
