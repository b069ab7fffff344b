"""One bounded pickle interpreter for every pickle ckptlab reads.

``data.pkl`` of torch.save archives, the pickles of legacy-format files, TorchScript's
``data.pkl``/``constants.pkl`` and DCP's ``.metadata`` all go through :func:`interpret`. It is
an opcode loop of its own over the bytes (protocols 0-5), not a subclass of :mod:`pickle`'s
unpicklers, so every rule below holds by construction rather than by overriding hooks:

- **Nothing from the file runs or is imported.** A global is a :class:`Global` (module and
  name, nothing more). Calling it (REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST) runs the caller's
  *handler* for that name, which is ckptlab code, or builds an inert :class:`Reduced` record.
  EXT1/2/4 are refused without consulting :mod:`copyreg`'s process-wide extension registry.
- **BUILD only fills ckptlab's own plain records** (:class:`Reduced`), or is given to the
  caller's ``build`` hook (ckptlab code: torch's handlers keep an ``OrderedDict``'s
  ``_metadata`` beside it); anything else is an error. Nothing can be ``setattr``'d on a class.
- **Memory is bounded by the input.** Every opcode charges an estimate of the memory it makes
  live against a budget of :data:`MEMORY_PER_BYTE` bytes per input byte (plus a small floor);
  declared lengths are checked against the bytes left before anything is read; the memo is a
  list (dense indices, as picklers write them) with a dict only for sparse indices, and an
  entry no GET of the pickle reads holds None (:func:`memo_reads`: what only the pickler
  memoized is freed once used); ints are at most :data:`MAX_INT_NBYTES` bytes (so ``str()``
  of any of them works).
- **Work is linear.** Each opcode consumes at least one input byte and does work amortised over
  the bytes that pushed its operands. Repeated globals are one dictionary lookup.
- **Nothing attacker-deep is hashed or compared.** Dict keys and set members that are not
  simple values (str, bytes, bounded ints, floats, bools, None, a :class:`Global`, or a small
  flat tuple of those) are wrapped in :class:`OpaqueKey`, which hashes by identity. Hashing a
  150,000-deep nested tuple would recurse in C and kill the process.
- **Two implementations, one interface.** :func:`interpret` here (one opcode at a time, in
  Python) and :mod:`ckptlab.format._interp` (the same loop in C), as CPython pairs
  ``pickle.py`` with ``_pickle.c``; :func:`interpreter` picks one. There is no other path:
  no pattern matching of torch's bytes, no batches, no shared objects.

Why not the standard library: the C unpickler sizes its memo from a ``LONG_BINPUT`` index and
preallocates ``BINBYTES`` from the declared length (GBs from a 9-byte pickle), resolves EXT
codes through copyreg before ``find_class``, applies BUILD with ``setattr`` to whatever object
is on the stack, and hashes dict keys of any depth; the pure-Python one shares the last three.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable
from typing import Any

from ckptlab.errors import PickleBudgetError, PickleDataError
from ckptlab.format._records import record_type

__all__ = [
    "MAX_INT_NBYTES",
    "MEMORY_PER_BYTE",
    "PATH_CLASSES",
    "Global",
    "Interpretation",
    "OpaqueKey",
    "PickleBudgetError",
    "PickleDataError",
    "Reduced",
    "canonical_global",
    "interpret",
    "interpreter",
    "path_value",
]

MEMORY_PER_BYTE = 64  # bytes of live objects an input byte may cost
MEMORY_FLOOR = 8 << 20  # a small pickle may always use this much
MAX_INT_NBYTES = 512  # LONG1/LONG4 payload (about 1,233 decimal digits)
MAX_KEY_LEAVES = 64  # a tuple dict key with more leaves (or any nesting) is hashed by identity
_MAX_TEXT_LINE = 4096  # protocol-0 text arguments (INT, FLOAT, GLOBAL, ...)

# Modules CPython moved a class into and pickles name as they were written: a pickle written on
# 3.13 calls ``pathlib._local.PosixPath`` (3.11, 3.12 and 3.14 write ``pathlib.PosixPath``).
# The interpreter names such a global by its public module, so one handler serves every Python
# that wrote the file.
_MOVED_MODULES = {"pathlib._local": "pathlib"}
PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def canonical_global(module: str, name: str) -> tuple[str, str]:
    """The name a pickled global is known by, whichever CPython wrote it.

    ``("pathlib._local", "PosixPath")`` (CPython 3.13) is ``("pathlib", "PosixPath")``;
    every other name is itself.
    """
    return _MOVED_MODULES.get(module, module), name


def path_value(name: str, parts: tuple[Any, ...]) -> str:
    """The string a pickled ``pathlib`` path stands for: ``str(cls(*parts))``.

    A path pickles as its class called with its parts (``('/', 'tmp', 'ckpt')``); joining
    them is pure string work (no filesystem access), done by the *pure* path class of the
    same flavour.

    Raises
    ------
    PickleDataError
        A part that is not a str, or more than 4,096 parts.
    """
    import pathlib

    if len(parts) > 4096 or not all(type(p) is str for p in parts):
        raise PickleDataError(f"pathlib.{name} of something other than strings")
    flavour = pathlib.PureWindowsPath if "Windows" in name else pathlib.PurePosixPath
    return str(flavour(*parts))


def _global_qualname(self: Any) -> str:
    return f"{self.module}.{self.name}"


def _global_repr(self: Any) -> str:
    return f"<global {self.module}.{self.name}>"


# A global the pickle names: ``module.name``. Never imported, never called. An immutable
# record the collector does not track (:mod:`ckptlab.format._records`), so the tuples that
# hold one (a storage's persistent id) are not tracked either.
Global = record_type("ckptlab.format._unpickle.Global", ("module", "name"), (), {
    "qualname": property(_global_qualname), "__repr__": _global_repr,
    "__doc__": "A global the pickle names: ``module.name``. Never imported, never called."})


class Reduced:
    """An object the pickle builds from a global no handler interprets: inert data only.

    ``args``/``kwargs`` are the constructor arguments, ``state`` what BUILD gave it, ``items``
    what APPEND(S) added and ``pairs`` what SETITEM(S) added (a ``defaultdict`` or an unknown
    mapping class), in pickle order: lists, or the empty tuple while nothing was added (a
    module pickled whole holds a Reduced per submodule, none with items or pairs).
    """

    __slots__ = ("__weakref__", "args", "func", "items", "kwargs", "pairs", "state")

    def __init__(self, func: Global, args: tuple[Any, ...] = (),
                 kwargs: dict[Any, Any] | None = None) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None
        self.items: list[Any] | tuple[()] = ()
        self.pairs: list[tuple[Any, Any]] | tuple[()] = ()

    def __repr__(self) -> str:
        return f"<{self.func.qualname} object>"


class OpaqueKey:
    """A dict key or set member that is not a simple value, hashed by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<key>"


Handler = Callable[..., Any]


class Interpretation:
    """What :func:`interpret` returns: the root object and what the pickle named."""

    __slots__ = ("end", "globals", "named", "protocol", "root")

    def __init__(self, root: Any, protocol: int, globals_: list[str], end: int,
                 named: list[tuple[str, str, int]] | None = None) -> None:
        self.root = root
        self.protocol = protocol
        self.globals = globals_  # "module.name", in order of first appearance
        self.end = end  # offset just past STOP
        # (module, name, offset) of each global, in the same order: the offset of the opcode
        # (GLOBAL, STACK_GLOBAL or INST) that first named it. A failed interpretation's error
        # has the same list as its ``named`` attribute: what the pickle named before it failed.
        self.named = named if named is not None else []


class _Position(Exception):
    def __init__(self, offset: int, error: PickleDataError) -> None:
        self.offset = offset
        self.error = error


_SIMPLE_KEYS = frozenset({str, bytes, float, bool, type(None), Global})
_STR_ONLY = frozenset({str})
_CONTAINER_TYPES = (tuple, list, dict, set, frozenset)
_unpack_i = struct.Struct("<i").unpack_from
_unpack_I = struct.Struct("<I").unpack_from
_unpack_H = struct.Struct("<H").unpack_from
_unpack_Q = struct.Struct("<Q").unpack_from
_unpack_d = struct.Struct(">d").unpack_from
_INT64 = 1 << 64




_ERRORS = (PickleDataError, UnicodeDecodeError, RecursionError, MemoryError)


def _position(at: int, exc: BaseException) -> _Position:
    """An error of the loop, as a :class:`PickleDataError` at the offset of opcode ``at``."""
    if isinstance(exc, PickleDataError):
        return _Position(at, exc)
    if isinstance(exc, UnicodeDecodeError):
        return _Position(at, PickleDataError(f"a string is not valid UTF-8: {exc.reason} "
                                             f"at byte {exc.start}"))
    if isinstance(exc, RecursionError):
        return _Position(at, PickleDataError("objects nested too deeply"))
    return _Position(at, PickleBudgetError("out of memory interpreting the pickle"))



def _key(value: Any, cache: dict[int, tuple[Any, Any]]) -> Any:
    """``value`` if hashing it is cheap and shallow, else an identity-hashed wrapper."""
    kind = type(value)
    if kind in _SIMPLE_KEYS:
        return value
    if kind is int:
        return value if -_INT64 < value < _INT64 else OpaqueKey(value)
    if kind is tuple:
        hit = cache.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        ok = len(value) <= MAX_KEY_LEAVES and all(
            type(v) in _SIMPLE_KEYS or (type(v) is int and -_INT64 < v < _INT64)
            for v in value)
        result = value if ok else OpaqueKey(value)
        cache[id(value)] = (value, result)
        return result
    if kind is frozenset:  # members were keyed when it was built: hashing it does not recurse
        return value
    return OpaqueKey(value)



def interpret(data: bytes | bytearray | memoryview, *,
              handlers: dict[tuple[str, str], Handler] | None = None,
              persistent_load: Callable[[Any], Any] | None = None,
              build: Callable[[Any, Any], None] | None = None,
              memory_per_byte: int = MEMORY_PER_BYTE) -> Interpretation:
    """Interpret one pickle without importing or running anything it names, one opcode at a
    time: the Python implementation (:func:`interpreter` picks the compiled one of the same
    interface, :mod:`ckptlab.format._interp`, where it is built).

    Parameters
    ----------
    data
        The pickle's bytes; it must end exactly at its STOP opcode (trailing bytes are an error
        for the caller to report: see ``Interpretation.end``).
    handlers
        ``(module, name) -> callable``: ckptlab functions run when the pickle calls that
        global; their result goes on the stack. Globals without a handler build a
        :class:`Reduced` record when called.
    persistent_load
        Called with each persistent id (BINPERSID/PERSID); without it they are an error.
    build
        Called as ``build(target, state)`` for a BUILD on anything but a :class:`Reduced`
        (which keeps the state itself); it raises :class:`PickleDataError` to refuse. Without
        it such a BUILD is refused.
    memory_per_byte
        Memory budget per input byte.

    Raises
    ------
    PickleDataError
        With ``.offset`` set to the position of the failing opcode (see :func:`failure_offset`).
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    machine = _Machine(view, handlers or {}, persistent_load, build,
                       max(MEMORY_FLOOR, memory_per_byte * len(view)))
    try:
        return machine.run()
    except _Position as where:
        where.error.offset = where.offset  # type: ignore[attr-defined]
        where.error.named = machine.seen_at  # type: ignore[attr-defined]
        raise where.error from None


def interpreter(impl: str | None = None) -> Callable[..., Interpretation]:
    """:func:`interpret` (one opcode at a time) by one
    implementation, as CPython pairs ``pickle.py`` with ``_pickle.c``: ``"python"`` (the loop
    here), ``"c"`` (:mod:`ckptlab.format._interp`, the whole loop compiled; ImportError where
    ckptlab was built without a C compiler) or None (the compiled one where it was built).

    Each takes ``(data, *, handlers, persistent_load, build, memory_per_byte)`` and gives
    the same :class:`Interpretation`, handler calls, memo, budget and errors
    (``tests/format/test_interp.py`` runs one suite against both).
    """
    if impl in ("c", None):
        try:
            from ckptlab.format._interp import interpret as compiled
        except ImportError:
            if impl == "c":
                raise
        else:
            return compiled  # type: ignore[no-any-return]
    elif impl != "python":
        raise ValueError(f"impl is 'python', 'c' or None, not {impl!r}")
    return interpret


def built_name(target: Any) -> str:
    """How a refused BUILD names its target: a global by its qualified name, anything else
    by its type's name."""
    return target.qualname if isinstance(target, Global) else type(target).__name__


def failure_offset(error: PickleDataError) -> int:
    """The pickle offset of the opcode an error from :func:`interpret` was raised at."""
    return getattr(error, "offset", 0)


def _pop_mark(stack: list[Any], metastack: list[list[Any]], code: int
              ) -> tuple[list[Any], list[Any]]:
    """The items since the last MARK, and the stack below it."""
    if not metastack:
        raise PickleDataError(f"opcode {code:#04x} without a MARK")
    return stack, metastack.pop()


# How each opcode's argument is laid out, from pickletools' opcode table (data only):
# opcode -> (kind, count): kind > 0 fixed bytes; LINE text lines (count 1, or 2 for
# GLOBAL/INST); a length prefix (LENGTH_NBYTES: -2 one byte, -3 four signed, -4 four, -5
# eight); 0 no argument. The one table for walking opcodes without interpreting them
# (memo_reads here, the legacy format's pickle_end).
LINE = -1  # pickletools' UP_TO_NEWLINE
LENGTH_NBYTES = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}


def _opcode_table() -> dict[int, tuple[int, int]]:
    import pickletools

    table = {}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        if op.arg is None:
            table[code] = (0, 0)
        elif op.arg.n == LINE:
            table[code] = (LINE, 2 if op.arg.name == "stringnl_noescape_pair" else 1)
        else:
            table[code] = (op.arg.n, 0)
    return table


OPCODE_ARGUMENTS = _opcode_table()


def _opcode_names() -> dict[int, tuple[str, int]]:
    import pickletools

    return {op.code.encode("latin-1")[0]: (op.name, op.proto) for op in pickletools.opcodes}


# opcode -> (its name, the protocol that introduced it), from the same table
OPCODE_NAMES = _opcode_names()


def opcode_spans(data: Any, start: int = 0) -> Any:
    """The opcodes of the pickle at ``start`` walked by their argument lengths alone
    (:data:`OPCODE_ARGUMENTS`; nothing decoded or run): ``(offset, code)`` each, up to and
    including the first STOP. Ends early where ``data`` ends inside an opcode; raises
    ValueError at an unknown opcode or a negative length."""
    n = len(data)
    pos = start
    while pos < n:
        at, code = pos, data[pos]
        spec = OPCODE_ARGUMENTS.get(code)
        if spec is None:
            raise ValueError(f"unknown opcode {code:#04x} at {at}")
        kind, count = spec
        pos += 1
        if kind == LINE:
            for _ in range(count):
                newline = bytes(data[pos:pos + _MAX_TEXT_LINE]).find(b"\n")
                if newline < 0:
                    return
                pos += newline + 1
        elif kind in LENGTH_NBYTES:
            width, signed = LENGTH_NBYTES[kind]
            if pos + width > n:
                return
            length = int.from_bytes(bytes(data[pos:pos + width]), "little", signed=signed)
            if length < 0:
                raise ValueError(f"negative length at {at}")
            pos += width + length
        else:
            pos += kind
        if pos > n:
            return
        yield at, code
        if code == 0x2E:  # STOP
            return


def memo_reads(data: Any) -> set[int] | None:
    """The memo indices the pickle can read, found before it runs: the arguments of every
    BINGET and LONG_BINGET up to the first STOP.

    A memo entry no GET reads is stored as None (and charged as before): what only the
    pickler memoized (a tensor's argument tuple, a persistent id) is freed once used, instead
    of living, and being walked by the cyclic collector, until the end. None (keep every
    entry) where the scan cannot follow the pickle: a protocol-0 GET (its text is the loop's
    to parse), an unknown opcode, an argument past the end, no STOP.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    n = len(data)
    pos = 0
    reads: set[int] = set()
    while pos < n:
        code = data[pos]
        pos += 1
        if code == 0x2E:  # STOP
            return reads
        if code == 0x68:  # BINGET
            if pos >= n:
                return None
            reads.add(data[pos])
            pos += 1
            continue
        if code == 0x6A:  # LONG_BINGET
            if pos + 4 > n:
                return None
            reads.add(_unpack_I(data, pos)[0])
            pos += 4
            continue
        kind, count = OPCODE_ARGUMENTS.get(code, (None, 0))
        if kind is None or code == 0x67:  # an unknown opcode, or a GET (its text: the loop's)
            return None
        if kind > 0:
            pos += kind
        elif kind == LINE:
            for _ in range(count):
                end = data.find(b"\n", pos)
                if end < 0:
                    return None
                pos = end + 1
        elif kind < 0:
            width, signed = LENGTH_NBYTES[kind]
            if pos + width > n:
                return None
            length = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            if length < 0:
                return None
            pos += width + length
        if pos > n:
            return None
    return None


def _extend(target: Reduced, attr: str, new: list[Any]) -> None:
    """``target.<attr>.extend(new)``; ``new`` itself while the attribute is still ``()``."""
    before = getattr(target, attr)
    if type(before) is tuple and not before:
        setattr(target, attr, new)
    else:
        before.extend(new)


def _need(stack: list[Any], k: int, code: int) -> None:
    if len(stack) < k:
        raise PickleDataError(f"opcode {code:#04x} needs {k} items on the stack, "
                              f"found {len(stack)}")



class _Machine:
    __slots__ = (
        "budget",
        "build_other",
        "data",
        "globals",
        "handlers",
        "keycache",
        "memo",
        "memo_sparse",
        "n",
        "persistent",
        "pos",
        "proto",
        "reads",
        "seen_at",
        "seen_globals",
    )

    def __init__(self, data: Any, handlers: dict[tuple[str, str], Handler],
                 persistent: Callable[[Any], Any] | None,
                 build: Callable[[Any, Any], None] | None,
                 budget: int) -> None:
        self.data = data
        self.n = len(data)
        self.pos = 0
        self.handlers = handlers
        self.persistent = persistent
        self.build_other = build
        self.budget = budget
        self.memo: list[Any] = []
        self.memo_sparse: dict[int, Any] = {}
        self.reads = memo_reads(data)
        self.globals: dict[tuple[str, str], Global] = {}
        self.seen_globals: list[str] = []
        self.seen_at: list[tuple[str, str, int]] = []
        self.keycache: dict[int, tuple[Any, Any]] = {}
        self.proto = 0

    # -- helpers ------------------------------------------------------------------------
    def charge(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise self.over_budget()

    def take(self, nbytes: int, what: str) -> Any:
        start = self.pos
        end = start + nbytes
        if nbytes < 0 or end > self.n:
            raise PickleDataError(
                f"{what} declares {nbytes:,} bytes but only {self.n - start:,} are left")
        self.pos = end
        return self.data[start:end]

    def line(self, what: str) -> str:
        data, start = self.data, self.pos
        limit = min(self.n, start + _MAX_TEXT_LINE)
        end = bytes(data[start:limit]).find(b"\n")
        if end < 0:
            raise PickleDataError(f"{what}: no newline within {_MAX_TEXT_LINE} bytes")
        self.pos = start + end + 1
        return bytes(data[start:start + end]).decode("latin-1")

    def memo_put(self, index: int, value: Any) -> None:
        if self.reads is not None and index not in self.reads:
            value = None  # (no GET reads it: stored as None, charged the same)
        memo = self.memo
        if index == len(memo):
            memo.append(value)
            self.charge(16)
        elif index < len(memo):
            memo[index] = value
        else:
            if index not in self.memo_sparse:
                self.charge(128)
            self.memo_sparse[index] = value

    def memo_get(self, index: int) -> Any:
        if 0 <= index < len(self.memo):
            return self.memo[index]
        try:
            return self.memo_sparse[index]
        except KeyError:
            raise PickleDataError(f"memo index {index} was never stored") from None

    def global_(self, module: str, name: str, op: int) -> Global:
        if type(module) is not str or type(name) is not str:
            raise PickleDataError("STACK_GLOBAL of non-strings")
        module, name = key = canonical_global(module, name)
        found = self.globals.get(key)
        if found is None:
            self.charge(320 + 4 * (len(module) + len(name)))
            found = self.globals[key] = Global(module, name)
            self.seen_globals.append(f"{module}.{name}")
            self.seen_at.append((module, name, op))
        return found

    def call(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        if not isinstance(func, Global):
            raise PickleDataError(f"call of a {type(func).__name__}, not a global")
        if not isinstance(args, tuple):
            raise PickleDataError(f"call of {func.qualname} with {type(args).__name__} args")
        self.charge(320)  # a handler's record or a Reduced with its lists
        handler = self.handlers.get((func.module, func.name))
        if handler is not None:
            if kwargs:
                raise PickleDataError(f"{func.qualname} called with keyword arguments")
            try:
                return handler(*args)
            except TypeError as exc:  # arguments the function does not take: bad data
                raise PickleDataError(f"{func.qualname} called with {len(args)} arguments it "
                                      f"does not take ({str(exc)[:120]})") from None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise PickleDataError(f"{func.qualname} called with non-dict kwargs")
        return Reduced(func, args, kwargs)

    def setitems(self, target: Any, flat: list[Any]) -> None:
        if len(flat) % 2:
            raise PickleDataError("SETITEMS with an odd number of items")
        self.charge(64 * (len(flat) // 2 + 1))
        if isinstance(target, dict):
            keys = flat[::2]
            if set(map(type, keys)) <= _STR_ONLY:  # a state dict: string keys, as they are
                target.update(zip(keys, flat[1::2]))
                return
            cache = self.keycache
            for i in range(0, len(flat), 2):
                target[_key(flat[i], cache)] = flat[i + 1]
        elif isinstance(target, Reduced):
            _extend(target, "pairs", list(zip(flat[::2], flat[1::2])))
        else:
            raise PickleDataError(f"SETITEM on a {type(target).__name__}")

    def appends(self, target: Any, items: list[Any]) -> None:
        self.charge(16 * len(items) + 16)
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, Reduced):
            _extend(target, "items", list(items))
        else:
            raise PickleDataError(f"APPEND on a {type(target).__name__}")

    def build(self, target: Any, state: Any) -> None:
        if isinstance(target, Reduced):
            if target.state is not None:
                raise PickleDataError(f"BUILD applied twice to a {target.func.qualname}")
            target.state = state
        elif self.build_other is not None:
            self.build_other(target, state)
        else:
            raise PickleDataError(f"BUILD applied to {built_name(target)}, which ckptlab "
                                  f"never builds")

    def make_set(self, items: list[Any]) -> list[Any]:
        self.charge(96 * len(items) + 256)
        cache = self.keycache
        return [_key(v, cache) for v in items]

    def int_from_bytes(self, raw: Any) -> int:
        if len(raw) > MAX_INT_NBYTES:
            raise PickleDataError(f"an int of {len(raw):,} bytes (at most {MAX_INT_NBYTES})")
        self.charge(64 + len(raw))
        return int.from_bytes(raw, "little", signed=True)

    def text_int(self, text: str) -> int:
        text = text.strip().rstrip("L")
        if len(text) > 2 * MAX_INT_NBYTES:
            raise PickleDataError(f"an int of {len(text):,} digits")
        try:
            return int(text, 0) if text.startswith(("0x", "0X")) else int(text)
        except ValueError:
            raise PickleDataError(f"not an int: {text[:40]!r}") from None

    # -- the loop -----------------------------------------------------------------------
    def over_budget(self) -> PickleBudgetError:
        return PickleBudgetError(
            f"the pickle would need more than {MEMORY_PER_BYTE} bytes of memory per byte "
            f"of input ({self.n:,} bytes in, budget exceeded); ckptlab refuses it")

    def run(self) -> Interpretation:
        data = self.data
        n = self.n
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        push = stack.append
        memo = self.memo
        reads = self.reads
        # the budget lives in a local in the loop; methods that charge get it through
        # self.budget (synced around their calls)
        budget = self.budget
        pos = 0
        op = 0
        try:
            while True:
                if pos >= n:
                    raise PickleDataError("the pickle ends without a STOP opcode")
                op = pos
                code = data[pos]
                pos += 1
                # the hot opcodes of torch pickles first (LONG_* once the memo passes 256)
                if code == 0x58:  # BINUNICODE
                    if pos + 4 > n:
                        raise PickleDataError("BINUNICODE without its length")
                    (length,) = _unpack_I(data, pos)
                    pos += 4
                    if pos + length > n:
                        raise PickleDataError(
                            f"BINUNICODE declares {length:,} bytes but only {n - pos:,} are left")
                    text = str(data[pos:pos + length], "utf-8", "surrogatepass")
                    push(text)
                    pos += length
                    budget -= 96 + 4 * length
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x72 or code == 0x71:  # LONG_BINPUT / BINPUT
                    if code == 0x71:
                        if pos >= n:
                            raise PickleDataError("BINPUT without its index")
                        idx = data[pos]
                        pos += 1
                        if not stack:
                            raise PickleDataError("BINPUT with an empty stack")
                    else:
                        if pos + 4 > n:
                            raise PickleDataError("LONG_BINPUT without its index")
                        (idx,) = _unpack_I(data, pos)
                        pos += 4
                        if not stack:
                            raise PickleDataError("LONG_BINPUT with an empty stack")
                    if idx == len(memo):
                        memo.append(stack[-1] if reads is None or idx in reads else None)
                        budget -= 16
                        if budget < 0:
                            raise self.over_budget()
                    else:
                        self.budget = budget
                        self.memo_put(idx, stack[-1])
                        budget = self.budget
                    continue
                if code == 0x6A or code == 0x68:  # LONG_BINGET / BINGET
                    if code == 0x68:
                        if pos >= n:
                            raise PickleDataError("BINGET without its index")
                        idx = data[pos]
                        pos += 1
                    else:
                        if pos + 4 > n:
                            raise PickleDataError("LONG_BINGET without its index")
                        (idx,) = _unpack_I(data, pos)
                        pos += 4
                    value = memo[idx] if idx < len(memo) else self.memo_get(idx)
                    push(value)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4B:  # BININT1
                    if pos >= n:
                        raise PickleDataError("BININT1 without its value")
                    push(data[pos])
                    pos += 1
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                    push = stack.append
                    budget -= 88
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x74:  # TUPLE
                    if not metastack:
                        raise PickleDataError("TUPLE without a MARK")
                    items = tuple(stack)
                    stack = metastack.pop()
                    push = stack.append
                    push(items)
                    budget -= 72 + 8 * len(items)
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x85 or code == 0x86 or code == 0x87:  # TUPLE1/2/3
                    k = code - 0x84
                    if len(stack) < k:
                        raise PickleDataError(f"TUPLE{k} with {len(stack)} items on the stack")
                    items = tuple(stack[-k:])
                    del stack[-k:]
                    push(items)
                    budget -= 72 + 8 * k
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x52:  # REDUCE
                    if len(stack) < 2:
                        raise PickleDataError("REDUCE with fewer than two items on the stack")
                    args = stack.pop()
                    self.budget = budget
                    stack[-1] = self.call(stack[-1], args)
                    budget = self.budget
                    continue
                if code == 0x51:  # BINPERSID
                    if not stack:
                        raise PickleDataError("BINPERSID with an empty stack")
                    if self.persistent is None:
                        raise PickleDataError("a persistent id where none is expected")
                    stack[-1] = self.persistent(stack[-1])
                    budget -= 160
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x89 or code == 0x88:  # NEWFALSE / NEWTRUE
                    push(code == 0x88)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x29:  # EMPTY_TUPLE
                    push(())
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x7D:  # EMPTY_DICT
                    push({})
                    budget -= 96
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x75:  # SETITEMS
                    if not metastack:
                        raise PickleDataError("SETITEMS without a MARK")
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    if not stack:
                        raise PickleDataError("SETITEMS with nothing to set items on")
                    self.budget = budget
                    self.setitems(stack[-1], items)
                    budget = self.budget
                    continue
                if code == 0x63:  # GLOBAL
                    self.pos = pos
                    module = self.line("GLOBAL module")
                    name = self.line("GLOBAL name")
                    pos = self.pos
                    self.budget = budget
                    push(self.global_(module, name, op))
                    budget = self.budget - 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x94:  # MEMOIZE
                    if not stack:
                        raise PickleDataError("MEMOIZE with an empty stack")
                    memo.append(stack[-1] if reads is None or len(memo) in reads else None)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4D:  # BININT2
                    if pos + 2 > n:
                        raise PickleDataError("BININT2 without its value")
                    push(_unpack_H(data, pos)[0])
                    pos += 2
                    budget -= 48
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4A:  # BININT
                    if pos + 4 > n:
                        raise PickleDataError("BININT without its value")
                    push(_unpack_i(data, pos)[0])
                    pos += 4
                    budget -= 48
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x2E:  # STOP
                    if len(stack) != 1 or metastack:
                        raise PickleDataError(
                            f"STOP with {len(stack)} objects on the stack and "
                            f"{len(metastack)} open MARKs")
                    self.budget = budget
                    return Interpretation(stack[0], self.proto, self.seen_globals, pos,
                                          self.seen_at)
                # everything else, less frequent in checkpoints
                self.pos = pos
                self.budget = budget
                stack, push = self.rare(code, stack, metastack)
                pos = self.pos
                budget = self.budget
        except _ERRORS as exc:
            raise _position(op, exc) from None

    def rare(self, code: int, stack: list[Any], metastack: list[list[Any]]
             ) -> tuple[list[Any], Any]:
        op = self.pos - 1  # the opcode byte (a GLOBAL below is named at it)
        push = stack.append
        charge = self.charge
        take = self.take
        if code == 0x80:  # PROTO
            self.proto = take(1, "PROTO")[0]
            if self.proto > 5:
                raise PickleDataError(f"unsupported pickle protocol {self.proto}")
        elif code == 0x95:  # FRAME: a buffering hint; check the length and read straight on
            (length,) = _unpack_Q(take(8, "FRAME"))
            if length > self.n - self.pos:
                raise PickleDataError(f"FRAME of {length:,} bytes with "
                                      f"{self.n - self.pos:,} bytes left")
        elif code == 0x4E:  # NONE
            push(None)
            charge(16)
        elif code == 0x8C:  # SHORT_BINUNICODE
            length = take(1, "SHORT_BINUNICODE")[0]
            push(str(take(length, "SHORT_BINUNICODE"), "utf-8", "surrogatepass"))
            charge(96 + 4 * length)
        elif code == 0x8D:  # BINUNICODE8
            (length,) = _unpack_Q(take(8, "BINUNICODE8"))
            push(str(take(length, "BINUNICODE8"), "utf-8", "surrogatepass"))
            charge(96 + 4 * length)
        elif code in (0x42, 0x43, 0x8E, 0x96):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
            if code == 0x43:
                length = take(1, "SHORT_BINBYTES")[0]
            elif code == 0x42:
                (length,) = _unpack_I(take(4, "BINBYTES"))
            else:
                (length,) = _unpack_Q(take(8, "BINBYTES8"))
            raw = take(length, "bytes payload")
            push(bytearray(raw) if code == 0x96 else bytes(raw))
            charge(80 + length)
        elif code in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str)
            if code == 0x55:
                length = take(1, "SHORT_BINSTRING")[0]
            else:
                (length,) = _unpack_i(take(4, "BINSTRING"))
            raw = bytes(take(length, "BINSTRING"))
            push(raw.decode("utf-8", "surrogateescape"))
            charge(96 + 4 * length)
        elif code == 0x53:  # STRING (protocol 0, quoted)
            text = self.line("STRING").rstrip("\r")
            if len(text) < 2 or text[0] != text[-1] or text[0] not in "'\"":
                raise PickleDataError("STRING is not quoted")
            try:
                raw = codecs.escape_decode(text[1:-1].encode("latin-1"))[0]
            except (ValueError, DeprecationWarning):  # (the warning: when warnings are errors)
                raise PickleDataError("STRING with a bad escape") from None
            push(raw.decode("utf-8", "surrogateescape"))
            charge(96 + 4 * len(raw))
        elif code == 0x56:  # UNICODE (protocol 0)
            text = self.line("UNICODE")
            push(codecs.raw_unicode_escape_decode(text.encode("latin-1"))[0])
            charge(96 + 4 * len(text))
        elif code == 0x49:  # INT (protocol 0; also the old bools)
            text = self.line("INT").strip()
            push(True if text == "01" else False if text == "00" else self.text_int(text))
            charge(64 + len(text))
        elif code == 0x4C:  # LONG (protocol 0)
            text = self.line("LONG")
            push(self.text_int(text))
            charge(64 + len(text))
        elif code == 0x8A:  # LONG1
            length = take(1, "LONG1")[0]
            push(self.int_from_bytes(take(length, "LONG1")))
        elif code == 0x8B:  # LONG4
            (length,) = _unpack_i(take(4, "LONG4"))
            push(self.int_from_bytes(take(length, "LONG4")))
        elif code == 0x46:  # FLOAT (protocol 0)
            text = self.line("FLOAT")
            try:
                push(float(text))
            except ValueError:
                raise PickleDataError(f"not a float: {text[:40]!r}") from None
            charge(48)
        elif code == 0x47:  # BINFLOAT
            push(_unpack_d(take(8, "BINFLOAT"))[0])
            charge(48)
        elif code == 0x5D:  # EMPTY_LIST
            push([])
            charge(88)
        elif code == 0x8F:  # EMPTY_SET
            push(set())
            charge(256)
        elif code == 0x6C:  # LIST
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(items)
        elif code == 0x64:  # DICT
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            target: dict[Any, Any] = {}
            push(target)
            charge(96)
            self.setitems(target, items)
        elif code == 0x91:  # FROZENSET
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(frozenset(self.make_set(items)))
        elif code == 0x90:  # ADDITEMS
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            _need(stack, 1, code)
            target = stack[-1]
            if type(target) is not set:
                raise PickleDataError(f"ADDITEMS on a {type(target).__name__}")
            target.update(self.make_set(items))
        elif code == 0x61:  # APPEND
            _need(stack, 2, code)
            item = stack.pop()
            self.appends(stack[-1], [item])
        elif code == 0x65:  # APPENDS
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            _need(stack, 1, code)
            self.appends(stack[-1], items)
        elif code == 0x73:  # SETITEM
            _need(stack, 3, code)
            value = stack.pop()
            key = stack.pop()
            self.setitems(stack[-1], [key, value])
        elif code == 0x62:  # BUILD
            _need(stack, 2, code)
            state = stack.pop()
            self.build(stack[-1], state)
        elif code == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                _, stack = _pop_mark(stack, metastack, code)
                push = stack.append
        elif code == 0x31:  # POP_MARK
            _, stack = _pop_mark(stack, metastack, code)
            push = stack.append
        elif code == 0x32:  # DUP
            _need(stack, 1, code)
            push(stack[-1])
            charge(16)
        elif code == 0x67:  # GET (protocol 0)
            push(self.memo_get(self.text_int(self.line("GET"))))
            charge(16)
        elif code == 0x70:  # PUT (protocol 0)
            index = self.text_int(self.line("PUT"))
            _need(stack, 1, code)
            if index < 0:
                raise PickleDataError("negative PUT index")
            self.memo_put(index, stack[-1])
        elif code == 0x93:  # STACK_GLOBAL
            _need(stack, 2, code)
            name = stack.pop()
            module = stack.pop()
            push(self.global_(module, name, op))
        elif code == 0x81:  # NEWOBJ
            _need(stack, 2, code)
            args = stack.pop()
            stack[-1] = self.call(stack[-1], args)
        elif code == 0x92:  # NEWOBJ_EX
            _need(stack, 3, code)
            kwargs = stack.pop()
            args = stack.pop()
            stack[-1] = self.call(stack[-1], args, kwargs)
        elif code == 0x6F:  # OBJ: MARK cls args... OBJ
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            if not items:
                raise PickleDataError("OBJ without a class")
            push(self.call(items[0], tuple(items[1:])))
        elif code == 0x69:  # INST: MARK args... INST module\nname\n
            module = self.line("INST module")
            name = self.line("INST name")
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(self.call(self.global_(module, name, op), tuple(items)))
        elif code == 0x50:  # PERSID (protocol 0)
            pid = self.line("PERSID")
            if self.persistent is None:
                raise PickleDataError("a persistent id where none is expected")
            push(self.persistent(pid))
            charge(160)
        elif code in (0x82, 0x83, 0x84):  # EXT1/2/4
            raise PickleDataError(
                "EXT opcode: extension codes name globals through Python's process-wide copyreg "
                "registry; ckptlab never consults it")
        elif code in (0x97, 0x98):  # NEXT_BUFFER / READONLY_BUFFER
            raise PickleDataError("out-of-band buffers (protocol 5) are not used by checkpoints")
        else:
            raise PickleDataError(f"unknown opcode {code:#04x}")
        return stack, push
