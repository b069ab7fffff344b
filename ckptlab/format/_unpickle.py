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
  entry no GET of the pickle reads holds None (:func:`~ckptlab.format._optable.memo_reads`:
  what only the pickler memoized is freed once used); ints are at most
  :data:`MAX_INT_NBYTES` bytes (so ``str()`` of any of them works).
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

The Python implementation is three modules, one job each:

- this one, the interface and the rules: :func:`interpret` and :func:`interpreter`, what the
  interpreter makes (:class:`Global`, :class:`Reduced`, :class:`OpaqueKey`,
  :class:`Interpretation`), the budgets, and :class:`_Rules`, the state every opcode changes
  through it (the memo, the globals, calls, what SETITEMS/APPENDS/BUILD may change, keys,
  charges), where the rules above are kept;
- :mod:`ckptlab.format._opcodes`, the opcode loop: a :class:`_Rules` that reads the bytes one
  opcode at a time (lengths checked, the stack and its MARKs kept) and applies them;
- :mod:`ckptlab.format._optable`, pickletools' opcode table as data, and the walks that read
  a pickle without running it (:func:`~ckptlab.format._optable.memo_reads`, which the loop
  runs first; :func:`~ckptlab.format._optable.opcode_spans`).
"""

from __future__ import annotations

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
    from ckptlab.format._opcodes import _Machine  # (the loop is made of this module's rules)

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


def _extend(target: Reduced, attr: str, new: list[Any]) -> None:
    """``target.<attr>.extend(new)``; ``new`` itself while the attribute is still ``()``."""
    before = getattr(target, attr)
    if type(before) is tuple and not before:
        setattr(target, attr, new)
    else:
        before.extend(new)


class _Rules:
    """The state an interpretation changes, and the rules it changes it by: the memo (an entry
    no GET reads held as None), one :class:`Global` per name, calls (a handler's result, else
    a :class:`Reduced`), what SETITEMS/APPENDS/BUILD may change, keys (:func:`_key`), and the
    memory budget every opcode is charged against. The opcode loop
    (:class:`ckptlab.format._opcodes._Machine`) is one of these; :mod:`ckptlab.format._interp`
    keeps the same rules in C."""

    __slots__ = (
        "budget",
        "build_other",
        "globals",
        "handlers",
        "keycache",
        "memo",
        "memo_sparse",
        "n",
        "persistent",
        "reads",
        "seen_at",
        "seen_globals",
    )

    def __init__(self, nbytes: int, handlers: dict[tuple[str, str], Handler],
                 persistent: Callable[[Any], Any] | None,
                 build: Callable[[Any, Any], None] | None,
                 budget: int, reads: set[int] | None) -> None:
        self.n = nbytes  # the input's length (what the budget is per byte of)
        self.handlers = handlers
        self.persistent = persistent
        self.build_other = build
        self.budget = budget
        self.memo: list[Any] = []
        self.memo_sparse: dict[int, Any] = {}
        self.reads = reads  # the memo indices a GET reads (None: all)
        self.globals: dict[tuple[str, str], Global] = {}
        self.seen_globals: list[str] = []
        self.seen_at: list[tuple[str, str, int]] = []
        self.keycache: dict[int, tuple[Any, Any]] = {}

    def charge(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise self.over_budget()

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

    def over_budget(self) -> PickleBudgetError:
        return PickleBudgetError(
            f"the pickle would need more than {MEMORY_PER_BYTE} bytes of memory per byte "
            f"of input ({self.n:,} bytes in, budget exceeded); ckptlab refuses it")
