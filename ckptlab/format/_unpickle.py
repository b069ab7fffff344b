"""One bounded pickle interpreter for every pickle ckptlab reads.

``data.pkl`` of torch.save archives, the pickles of legacy-format files, TorchScript's
``data.pkl``/``constants.pkl`` and DCP's ``.metadata`` all go through :func:`interpret`. It is
an opcode loop of its own over the bytes (protocols 0-5), not a subclass of :mod:`pickle`'s
unpicklers, so every rule below holds by construction rather than by overriding hooks:

- **Nothing from the file runs or is imported.** A global is a :class:`Global` (module and
  name, nothing more). Calling it (REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST) runs the caller's
  *handler* for that name, which is ckptlab code, or builds an inert :class:`Reduced` record.
  EXT1/2/4 are refused without consulting :mod:`copyreg`'s process-wide extension registry.
- **BUILD only fills ckptlab's own plain records** (:class:`Reduced`); applied to a global, a
  handler's result or a built-in value it is an error. Nothing can be ``setattr``'d on a class.
- **Memory is bounded by the input.** Every opcode charges an estimate of the memory it makes
  live against a budget of :data:`MEMORY_PER_BYTE` bytes per input byte (plus a small floor);
  declared lengths are checked against the bytes left before anything is read; the memo is a
  list (dense indices, as picklers write them) with a dict only for sparse indices; ints are at
  most :data:`MAX_INT_NBYTES` bytes (so ``str()`` of any of them works).
- **Work is linear.** Each opcode consumes at least one input byte and does work amortised over
  the bytes that pushed its operands. Repeated globals are one dictionary lookup.
- **Nothing attacker-deep is hashed or compared.** Dict keys and set members that are not
  simple values (str, bytes, bounded ints, floats, bools, None, a :class:`Global`, or a small
  flat tuple of those) are wrapped in :class:`OpaqueKey`, which hashes by identity. Hashing a
  150,000-deep nested tuple would recurse in C and kill the process.
- **torch's tensors at once, with the same outcome.** The ~28 opcodes torch writes for every
  tensor (``_rebuild_tensor_v2`` of a persistent storage) are matched by one regular
  expression and applied in one step (:meth:`_Machine.tensor_v2`), and a state dict's next
  key with its tensor straight after (:meth:`_Machine.tensor_entries`): the same memo entries,
  charges, handler calls and error offsets as the loop; whatever else the bytes are, the loop
  reads them. ``interpret(..., fast_paths=False)`` turns it off (tests compare the two).
  With torch's handlers fused (``fused_tensor_v2``: the persistent id and the rebuild in one
  call), a large pickle's runs of plain state dict entries are taken a batch at a time
  (:meth:`_Machine.entry_run`): located entry by entry by the same expression, then checked
  column by column (the same BINGETs in every entry, the BINPUTs' indices in order with
  numpy, one budget check for the batch) and applied with one handler call, all or nothing.
  After a batch, the shapes of its last entries (up to :data:`_SPECS`) become patterns of
  their own (:class:`_EntrySpec`: the same expression with the bytes that repeat written out,
  only the BINPUTs and the storage key left to match), which locate the next batches' entries
  at a fraction of the cost and give the very same columns. A batch may mix shapes and
  storage classes (an int64 counter among fp32 weights). An optimizer's state, dicts of
  tensors under int keys, is taken the same way a batch of dicts at a time
  (:meth:`_Machine.state_run`). Where ckptlab was built with a C compiler, a batch's entries
  are located and decoded by :mod:`ckptlab.format._entries` instead of the expressions
  (:meth:`_Machine.entry_run_c`; byte work only, the same checks and outcome), about twice
  as fast; without it the expressions do the same.
- **A pickled ``nn.Module``'s hook dicts at once**: ``OrderedDict()`` (the BINGET of the
  global, EMPTY_TUPLE, REDUCE and its BINPUT), a dozen per module, in one step. Given a
  ``shared_empty`` dict, they are all that one dict, as is every tensor's hooks dict (a
  100,000-tensor module pickled whole holds about 900,000 of them, 120 MB as their own
  objects): a dict the next opcode fills (a MARK, a BUILD) is a new one, and one SETITEM(S)
  or BUILD would change is copied first (:meth:`_Machine.own`: the stack held its only
  reference). Reading the shared dict back from the memo, DUP, or a call or persistent load
  that gives it back ends the run with :class:`SharedEmptyChanged`, as does one left
  changed, and the caller interprets again without it: so every result is the one a new
  dict each gives, whatever the bytes.

Why not the standard library: the C unpickler sizes its memo from a ``LONG_BINPUT`` index and
preallocates ``BINBYTES`` from the declared length (GBs from a 9-byte pickle), resolves EXT
codes through copyreg before ``find_class``, applies BUILD with ``setattr`` to whatever object
is on the stack, and hashes dict keys of any depth; the pure-Python one shares the last three.
"""

from __future__ import annotations

import codecs
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, chain, compress, repeat
from operator import itemgetter
from typing import Any

from ckptlab.errors import PickleBudgetError, PickleDataError

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
    "SharedEmptyChanged",
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


class Global:
    """A global the pickle names: ``module.name``. Never imported, never called."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __repr__(self) -> str:
        return f"<global {self.module}.{self.name}>"


class Reduced:
    """An object the pickle builds from a global no handler interprets: inert data only.

    ``args``/``kwargs`` are the constructor arguments, ``state`` what BUILD gave it, ``items``
    what APPEND(S) added and ``pairs`` what SETITEM(S) added (a ``defaultdict`` or an unknown
    mapping class), in pickle order.
    """

    __slots__ = ("__weakref__", "args", "func", "items", "kwargs", "pairs", "state")

    def __init__(self, func: Global, args: tuple[Any, ...] = (),
                 kwargs: dict[Any, Any] | None = None) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None
        self.items: list[Any] = []
        self.pairs: list[tuple[Any, Any]] = []

    # the __init__ the compiled runner does in C (its slots set as above) while it is this
    ckptlab_init = __init__

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

    __slots__ = ("end", "globals", "protocol", "root")

    def __init__(self, root: Any, protocol: int, globals_: list[str], end: int) -> None:
        self.root = root
        self.protocol = protocol
        self.globals = globals_
        self.end = end  # offset just past STOP


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


_NOTHING = object()  # never on the stack nor in the memo
_FAST_GLOBALS = (("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
                 ("torch._utils", "_rebuild_parameter"))
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


# torch's tensor, after the _rebuild_tensor_v2 global (see _Machine.tensor_v2); the groups are
# the opcodes whose arguments vary, and the three opcodes whose offsets errors report
_GET = rb"(h.|j.{4})"
_PUT = rb"(q.|r.{4})?"
_INT = rb"(K.|M.{2}|J.{4})"
_I = rb"(?:K.|M.{2}|J.{4})"
_TUPLE = rb"(\)|" + _I + rb"\x85|" + _I * 2 + rb"\x86|" + _I * 3 + rb"\x87|\(" + _I + rb"*t)"
_TENSOR_V2_OPS = (
    rb"\(\(" + _GET + _GET  # MARK MARK 'storage' <storage class>
    + rb"(X[\x01-\x14]\x00\x00\x00[0-9]+|h.|j.{4})" + _PUT  # storage key
    + _GET + _INT + rb"t" + _PUT  # location, numel, TUPLE: the persistent id
    + rb"(Q)" + _INT  # BINPERSID, storage offset
    + _TUPLE + _PUT + _TUPLE + _PUT  # size, stride
    + rb"([\x88\x89])" + _GET + rb"\)(R)" + _PUT  # requires_grad, OrderedDict()
    + rb"t" + _PUT + rb"(R)" + _PUT  # TUPLE REDUCE
)
_TENSOR_V2 = re.compile(_TENSOR_V2_OPS, re.DOTALL).match
# a state dict entry: after the key string, its BINPUT and the BINGET of the global
_ENTRY_V2 = re.compile(_PUT + _GET + _TENSOR_V2_OPS, re.DOTALL).match


def _put_columns(put_cols: list[Any]) -> tuple[Any, bytes, int]:
    """The BINPUTs of a batch, from its 8 columns of :data:`_ENTRY_PUTS` opcodes (None or
    ``b""`` where an entry has none): which each entry has (one list of bools when every entry
    has the same ones, else a tuple of bools each), their bytes in order, and how many."""
    cols = [c if isinstance(c, (list, tuple)) else list(c) for c in put_cols]
    count = len(cols[0])
    if all(all(c) if c[0] else not any(c) for c in cols):
        present = [c for c in cols if c[0]]
        return ([bool(c[0]) for c in cols], b"".join(chain.from_iterable(zip(*present))),
                len(present) * count)
    # each entry its own (a scalar's empty size and stride are not memoized)
    mask = list(zip(*[list(map(bool, c)) for c in cols]))
    return mask, b"".join(filter(None, chain.from_iterable(zip(*cols)))), sum(map(sum, mask))


def _put_ends(put_mask: list[Any], count: int) -> list[int]:
    """Where each of ``count`` tensors' BINPUTs start in a batch's memo values, and where
    the last end (``put_mask``: one list of bools for all, or a tuple each)."""
    return list(accumulate(map(sum, put_mask) if type(put_mask[0]) is not bool else
                           repeat(sum(put_mask), count), initial=0))


def _puts_in_order(joined: bytes, puts: int, first: int) -> bool:
    """Whether ``joined`` is ``puts`` LONG_BINPUTs storing ``first``, ``first + 1``..."""
    if len(joined) != 5 * puts:
        return False
    import numpy as np

    ops = np.frombuffer(joined, dtype=np.dtype([("op", "u1"), ("index", "<u4")]))
    return bool((ops["op"] == 0x72).all() and
                (ops["index"] == np.arange(first, first + puts, dtype=np.int64)).all())


def _put_runs(nbytes: int, code: int) -> dict[int, tuple[int, int]]:
    """``count -> (base, step)``: ``count`` BINPUTs (``nbytes`` each, index after the opcode)
    storing indices n, n+1, ... read as one little-endian int are ``base + n * step``."""
    out = {}
    for count in range(9):  # (0: a tensor with no BINPUT, which stores nothing)
        base = sum((code + (k << 8)) << (8 * nbytes * k) for k in range(count))
        step = sum(1 << (8 * nbytes * k + 8) for k in range(count))
        out[count] = base, step
    return out


_SHORT_PUTS = _put_runs(2, 0x71)  # BINPUT
_LONG_PUTS = _put_runs(5, 0x72)  # LONG_BINPUT
# the state dict entries taken together (_Machine.entry_run): from pickles of this many bytes
# on (smaller ones are read one tensor at a time), in batches of at most this many entries;
# after a batch that is not taken, as many entries as it looked at (at least BULK_PAUSE) go
# one at a time before the next try, so no byte is looked at by more than two tries (and a
# quarter of BULK_PAUSE go one at a time before the first)
BULK_MIN_NBYTES = 1 << 18
BULK_BATCH = 1024
BULK_PAUSE = 64
_ENTRY_PUTS = (0, 5, 8, 12, 14, 18, 19, 21)  # the groups of _ENTRY_V2's BINPUTs, in order
_GROUPS = re.Match.groups
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_AFTER_LENGTH, _LENGTH_REST = itemgetter(slice(5, None)), itemgetter(slice(2, 5))


def _memo_index(op: bytes) -> int:
    """The index of a BINGET / LONG_BINGET (or BINPUT / LONG_BINPUT) opcode."""
    return op[1] if len(op) == 2 else _unpack_I(op, 1)[0]


def _small_int(op: bytes) -> tuple[int, int]:
    """BININT1 / BININT2 / BININT ``op``: (value, charge)."""
    code = op[0]
    if code == 0x4B:
        return op[1], 16
    if code == 0x4D:
        return _unpack_H(op, 1)[0], 48
    return _unpack_i(op, 1)[0], 48


def _int_tuple_op(op: bytes) -> tuple[tuple[int, ...], int, bool]:
    """A tuple of ints as :data:`_TENSOR_V2` matched it: (value, what the loop charges,
    whether every int is >= 0 and there are at most 64)."""
    if op == b")":
        return (), 16, True
    values = []
    cost = 0
    i = 1 if op[0] == 0x28 else 0
    end = len(op) - 1
    while i < end:
        value, charge = _small_int(op[i:i + 5])
        values.append(value)
        cost += charge
        i += 2 if op[i] == 0x4B else 3 if op[i] == 0x4D else 5
    return (tuple(values), cost + 72 + 8 * len(values) + (88 if op[0] == 0x28 else 0),
            len(values) <= 64 and all(v >= 0 for v in values))


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
              buildable: tuple[type, ...] = (),
              memory_per_byte: int = MEMORY_PER_BYTE,
              fast_paths: bool = True,
              fused_tensor_v2: Callable[..., Any] | None = None,
              fused_tensor_v2_batch: Callable[..., Any] | None = None,
              shared_empty: Any = None) -> Interpretation:
    """Interpret one pickle without importing or running anything it names.

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
    buildable
        Extra ckptlab types (besides :class:`Reduced`) BUILD may fill: each must define
        ``ckptlab_build(state)``.
    memory_per_byte
        Memory budget per input byte.
    fast_paths
        Interpret torch's tensor rebuild calls (``_rebuild_tensor_v2`` with a storage) at
        once when their bytes are exactly what torch writes (:meth:`_Machine.tensor_v2`), and,
        where the compiled part is built, the opcodes many at a time
        (``ckptlab.format._entries.opcodes``: the plain ones, the calls through this
        machine's own methods and handlers, and tensor rebuilds as the fast path does them);
        the result, the memo, the budget, the calls made and any error are the same as one
        opcode at a time (False: always one at a time, for tests that compare the two).
    fused_tensor_v2
        ``fused(pid, offset, size, stride, requires_grad) -> (storage, tensor) | None``: what
        ``persistent_load(pid)`` and the ``_rebuild_tensor_v2`` handler together return for a
        tensor of the fast path whose arguments are well formed (a 5-tuple ``pid``, sizes and
        strides of non-negative ints and equal length, a non-negative offset, a bool), done in
        one call; it must return None, having changed nothing, wherever those two calls would
        not simply return (an error, a storage class not seen before), and the two calls are
        made instead. Only used with the fast path.
    fused_tensor_v2_batch
        ``batch(pids, offsets, sizes, strides, grads) -> (storages, tensors) | None``: the
        same for many tensors at once (lists, one item per tensor, in pickle order), all or
        nothing: the state dict entries of a pickle of :data:`BULK_MIN_NBYTES` or more are
        taken in batches through it (:meth:`_Machine.entry_run`).
    shared_empty
        An empty object of the kind ``OrderedDict()`` makes (the handler's): the fast paths
        push it for every ``OrderedDict()`` not followed (past its BINPUT) by a MARK or a
        BUILD, and give it to every tensor as its hooks, instead of a new one each (a pickled
        module has a dozen empty hook dicts per submodule). A SETITEM(S) or BUILD into it
        makes a new one first, where it stands on the stack. Where the pickle could reach it
        a second way (read back from the memo, DUP, given back by a call or a persistent
        load), or leaves it changed, :class:`SharedEmptyChanged` is raised (in place of any
        other error): interpret again without it, with new handlers. The result is then
        always the one a new dict each gives, less their memory.

    Raises
    ------
    PickleDataError
        With ``.offset`` set to the position of the failing opcode (see :func:`failure_offset`).
    SharedEmptyChanged
        The pickle reaches ``shared_empty`` a second way, or changed it.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    machine = _Machine(view, handlers or {}, persistent_load, buildable,
                       max(MEMORY_FLOOR, memory_per_byte * len(view)), fast_paths)
    machine.fused = fused_tensor_v2 if fast_paths else None
    machine.fused_batch = fused_tensor_v2_batch if fast_paths and machine.persistent else None
    machine.shared_empty = shared_empty if fast_paths else None
    if machine.shared_empty is not None and persistent_load is not None:
        machine.persistent = _giving_back(persistent_load, shared_empty)
    try:
        result = machine.run()
    except _Position as where:
        where.error.offset = where.offset  # type: ignore[attr-defined]
        machine.shared_unchanged()
        raise where.error from None
    except SharedEmptyChanged:
        raise
    except Exception:  # (an error the changed dict may have led to)
        machine.shared_unchanged()
        raise
    machine.shared_unchanged()
    return result


class SharedEmptyChanged(Exception):
    """The pickle changed :func:`interpret`'s ``shared_empty``: interpret it again without."""


def _giving_back(persistent_load: Callable[[Any], Any], shared: Any) -> Callable[[Any], Any]:
    """``persistent_load``, refusing to give back the shared empty dict (part of its id)."""
    def load(pid: Any) -> Any:
        made = persistent_load(pid)
        if made is shared:
            raise SharedEmptyChanged("persistent_load gave back the shared empty dict")
        return made
    return load


def _filled_at_once(data: Any, pos: int) -> bool:
    """Whether the opcode at ``pos`` (after an ``OrderedDict()``'s REDUCE), past a memo put,
    is a MARK (its SETITEMS to come, as torch writes a dict with items) or a BUILD: then it
    gets a new dict. Anything else that changes the shared one is caught after the run."""
    n = len(data)
    if pos < n:
        code = data[pos]
        pos += 2 if code == 0x71 else 5 if code == 0x72 else 1 if code == 0x94 else 0
    return pos >= n or data[pos] in (0x28, 0x62)


def interpreter(impl: str | None = None) -> Callable[..., Interpretation]:
    """:func:`interpret`'s plain semantics (``fast_paths=False``: one opcode at a time) by one
    implementation, as CPython pairs ``pickle.py`` with ``_pickle.c``: ``"python"`` (the loop
    here), ``"c"`` (:mod:`ckptlab.format._interp`, the whole loop compiled; ImportError where
    ckptlab was built without a C compiler) or None (the compiled one where it was built).

    Each takes ``(data, *, handlers, persistent_load, buildable, memory_per_byte)`` and gives
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
    from functools import partial

    return partial(interpret, fast_paths=False)


def failure_offset(error: PickleDataError) -> int:
    """The pickle offset of the opcode an error from :func:`interpret` was raised at."""
    return getattr(error, "offset", 0)


def _pop_mark(stack: list[Any], metastack: list[list[Any]], code: int
              ) -> tuple[list[Any], list[Any]]:
    """The items since the last MARK, and the stack below it."""
    if not metastack:
        raise PickleDataError(f"opcode {code:#04x} without a MARK")
    return stack, metastack.pop()


def _need(stack: list[Any], k: int, code: int) -> None:
    if len(stack) < k:
        raise PickleDataError(f"opcode {code:#04x} needs {k} items on the stack, "
                              f"found {len(stack)}")


try:  # the entries' byte work in C, where ckptlab was built with a compiler (setup.py)
    from ckptlab.format import _entries as _compiled
except ImportError:  # the same walks by _ENTRY_V2 / _EntrySpec patterns
    _compiled = None
_c_entries = getattr(_compiled, "entries", None)
_c_units = getattr(_compiled, "units", None)
# the plain opcodes (memo, stack, MARKs, ints, empty containers, tuples, SETITEMS into a dict,
# OrderedDict()) many at a time, exactly as run() does them (a build without it: one at a time)
_c_opcodes = getattr(_compiled, "opcodes", None)
# which of the eight BINPUTs of _ENTRY_PUTS an entry has, from its bit mask
_MASKS = tuple(tuple(bool(m >> i & 1) for i in range(8)) for m in range(256))
# a Parameter's three BINPUTs (hooks, arguments, result) from the bits 0-2 of its params byte
_PARAM_MASKS = tuple(tuple(bool(m >> i & 1) for i in range(3)) for m in range(256))

_SPEC_MIN = 16  # entries in a batch before the next batch is tried with their shapes' patterns
_SPECS = 8  # the shapes (specialised patterns) kept: a layer's few, an MoE expert's three
_ENTRY_CAPTURED = (*_ENTRY_PUTS, 4)  # the groups a specialised pattern still captures
_SPEC_GROUPS = tuple(sorted(_ENTRY_CAPTURED))  # ... in the order its match has them
# a dict under an int key (an optimizer's state of one parameter), up to its first key: the
# int, EMPTY_DICT, its LONG_BINPUT and MARK (see _Machine.state_run)
_UNIT_HEAD = re.compile(rb"(K.|M.{2}|J.{4})\}(r.{4})\(", re.DOTALL).match
_KEY_GET = re.compile(rb"h.|j.{4}", re.DOTALL).match  # a key stored before: BINGET
_INT_CODES = frozenset(b"KMJ")  # BININT1, BININT2, BININT
_ENTRY_SHARED = (1, 2, 6, 16)  # BINGETs the same in every entry of a batch (global, tag,
# location, hooks); the storage class (group 3) may differ from entry to entry
_SPEC_STORAGE_KEY = rb"(X[\x01-\x14]\x00\x00\x00[0-9]+)"


class _EntrySpec:
    """:data:`_ENTRY_V2` specialised to the shape of one state dict entry: the bytes of every
    group but the BINPUTs and the storage key are the template's, literally (the same global,
    storage class, location, numel, offset, size, stride, requires_grad and hooks); the
    BINPUTs are LONG_BINPUTs of any index and the storage key any digits. A match is also a
    match of :data:`_ENTRY_V2` with those same groups (a pickle parses one way): a batch
    reads the captured groups entry by entry and the rest once per shape (:meth:`values`),
    at the cost of a mostly literal pattern and a few groups. A state dict of a few tensor
    shapes (100,000 equal layers; an MoE layer's norms, projections and experts) is read
    this way after its first batch.
    """

    __slots__ = ("_values", "constants", "last_back", "match")

    def __init__(self, match: Callable[..., Any], constants: tuple[Any, ...],
                 last_back: int) -> None:
        self.match = match  # its groups: those of _SPEC_GROUPS, b"" for a BINPUT it lacks
        self.constants = constants  # every general group's template value
        self.last_back = last_back  # the last opcode's distance from the entry's end
        self._values: Any = _NOTHING

    def values(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...], bool, int] | None:
        """The shape's numel, storage offset, size, stride, requires_grad and what the loop
        charges for the four ints, worked out once; None when they are not a valid tensor's
        (a negative offset, sizes and strides that are not ints >= 0 of equal length)."""
        if self._values is _NOTHING:
            c = self.constants
            (numel, numel_cost), (offset, offset_cost) = _small_int(c[7]), _small_int(c[10])
            (size, size_cost, size_ok), (stride, stride_cost, stride_ok) = (
                _int_tuple_op(c[11]), _int_tuple_op(c[13]))
            valid = offset >= 0 and size_ok and stride_ok and len(size) == len(stride)
            self._values = (numel, offset, size, stride, c[15] == b"\x88",
                            numel_cost + offset_cost + size_cost + stride_cost) if valid else None
        return self._values


def _entry_specs(matches: list[re.Match[Any]]) -> list[_EntrySpec]:
    """The patterns of the last :data:`_SPECS` shapes among ``matches`` (entries of a batch,
    :data:`_ENTRY_V2` matches), latest first."""
    specs: list[_EntrySpec] = []
    seen: set[tuple[Any, ...]] = set()
    for m in reversed(matches):
        shape = _shape_of(m.groups())
        if shape in seen:
            continue
        seen.add(shape)
        spec = _entry_spec(m)
        if spec is not None:
            specs.append(spec)
            if len(specs) == _SPECS:
                break
    return specs


def _shape_of(groups: tuple[Any, ...]) -> tuple[Any, ...]:
    """What an :class:`_EntrySpec` holds constant, of an :data:`_ENTRY_V2` match's groups."""
    return tuple(g for i, g in enumerate(groups) if i not in _ENTRY_CAPTURED)


def _entry_spec(m: re.Match[Any]) -> _EntrySpec | None:
    """The :class:`_EntrySpec` of the entry ``m`` (an :data:`_ENTRY_V2` match), or None when
    its BINPUTs are short ones (memo indices under 256: the pickle's first entries) or its
    storage key is a memo reference (shared storages)."""
    data = m.string
    parts = []
    at = m.start()
    for group in range(22):
        start, end = m.span(group + 1)
        if start < 0:  # an optional BINPUT the template does not have: neither may a match
            parts.append(rb"()")  # (an empty group where it would be: columns line up)
            continue
        parts.append(re.escape(bytes(data[at:start])))
        if group in _ENTRY_PUTS:
            if data[start] != 0x72:
                return None
            parts.append(rb"(r.{4})")
        elif group == 4:
            if data[start] != 0x58:
                return None
            parts.append(_SPEC_STORAGE_KEY)
        else:
            parts.append(re.escape(bytes(data[start:end])))
        at = end
    parts.append(re.escape(bytes(data[at:m.end()])))
    last_back = 5 if m.group(22) is not None else 1
    return _EntrySpec(re.compile(b"".join(parts), re.DOTALL).match, m.groups(), last_back)


class _Machine:
    __slots__ = (
        "budget",
        "buildable",
        "data",
        "empty_list_calls",
        "entry_after",
        "entry_pause",
        "entry_specs",
        "fast_global",
        "fast_handler",
        "fast_paths",
        "fused",
        "fused_batch",
        "gets",
        "globals",
        "handlers",
        "indices",
        "keycache",
        "memo",
        "memo_sparse",
        "n",
        "odict_global",
        "odict_handler",
        "param_global",
        "param_handler",
        "persistent",
        "plain_calls",
        "pos",
        "proto",
        "seen_globals",
        "shared_empty",
        "state_pause",
        "tuples",
        "unit_specs",
    )

    def __init__(self, data: Any, handlers: dict[tuple[str, str], Handler],
                 persistent: Callable[[Any], Any] | None, buildable: tuple[type, ...],
                 budget: int, fast_paths: bool = True) -> None:
        self.data = data
        self.n = len(data)
        self.pos = 0
        self.handlers = handlers
        # the globals with no handler, for the compiled runner: what a call of one makes
        self.plain_calls: dict[Global, Any] = {}
        # ... and those whose handler says what it makes of one empty list (set([]))
        self.empty_list_calls: dict[Global, Any] = {}
        self.persistent = persistent
        self.buildable = (Reduced, *buildable)
        self.budget = budget
        self.memo: list[Any] = []
        self.memo_sparse: dict[int, Any] = {}
        self.globals: dict[tuple[str, str], Global] = {}
        self.seen_globals: list[str] = []
        self.keycache: dict[int, tuple[Any, Any]] = {}
        self.proto = 0
        # the fast path for torch's tensors (tensor_v2): set when the globals it calls are seen
        self.fast_paths = fast_paths
        self.fast_global: Any = _NOTHING
        self.fast_handler: Handler | None = None
        self.odict_global: Any = _NOTHING
        self.odict_handler: Handler | None = None
        # the one empty OrderedDict the fast paths give every OrderedDict() that nothing fills
        # at once (interpret's shared_empty), or None: a new one each
        self.shared_empty: Any = None
        self.param_global: Any = _NOTHING  # _rebuild_parameter, for batches (entry_run_c)
        self.param_handler: Handler | None = None
        self.fused: Callable[..., Any] | None = None
        self.fused_batch: Callable[..., Any] | None = None
        # the shapes of the last batches' entries as specialised patterns (_entry_spec)
        self.entry_specs: list[_EntrySpec] = []
        self.entry_after: dict[tuple[Any, Any], _EntrySpec] = {}  # see entry_run
        self.unit_specs: list[_EntrySpec] = []  # the tensors of a state_run unit, in order
        self.entry_pause = BULK_PAUSE // 4  # entries to let pass before entry_run is tried
        # (see tensor_entries)
        self.state_pause = 0  # SETITEMS to let pass before state_run is tried again
        # tuple opcodes -> (value, charge, whether it is a valid size: ints >= 0, <= 64 dims)
        self.tuples: dict[bytes, tuple[tuple[int, ...], int, bool]] = {}
        # the four BINGETs of a tensor (their opcodes) -> (indices, the largest)
        self.gets: dict[tuple[bytes, ...], tuple[tuple[int, ...], int]] = {}
        self.indices: dict[Any, Any] = {}  # BINGET opcodes -> memo indices

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
            return self.unshared(self.memo[index])
        try:
            return self.unshared(self.memo_sparse[index])
        except KeyError:
            raise PickleDataError(f"memo index {index} was never stored") from None

    def unshared(self, value: Any) -> Any:
        """``value``, read back from the memo (or DUP): the shared empty OrderedDict may not
        be, as the pickle would have two references to one dict that may then change."""
        if value is self.shared_empty and value is not None:
            raise SharedEmptyChanged("the shared empty OrderedDict read back from the memo")
        return value

    def shared_unchanged(self) -> None:
        """Raise :class:`SharedEmptyChanged` if the shared empty OrderedDict was filled (by
        a change no copy in :meth:`own` was made for): the run's result is not the one a new
        dict each gives."""
        if self.shared_empty is not None and len(self.shared_empty):
            raise SharedEmptyChanged("items set into the shared empty OrderedDict") from None

    def own(self, stack: list[Any]) -> Any:
        """The target of a SETITEM(S) or BUILD (the stack's top), made a new dict of its own
        if it is the shared empty OrderedDict: nothing else refers to that one of them, so
        the change is seen wherever the pickle sees it. (An object leaves the stack for good
        once something holds it: only a read from the memo or DUP, a call's or a persistent
        load's result can bring it back, and each of those ends the run if it is the shared
        dict.)"""
        target = stack[-1]
        if target is self.shared_empty and target is not None:
            target = stack[-1] = self.odict_handler()  # type: ignore[misc]
        return target

    def global_(self, module: str, name: str) -> Global:
        if type(module) is not str or type(name) is not str:
            raise PickleDataError("STACK_GLOBAL of non-strings")
        module, name = key = canonical_global(module, name)
        found = self.globals.get(key)
        if found is None:
            self.charge(320 + 4 * (len(module) + len(name)))
            found = self.globals[key] = Global(module, name)
            self.seen_globals.append(f"{module}.{name}")
            handler = self.handlers.get(key)
            if handler is None:  # call() makes a Reduced of it
                self.plain_calls[found] = Reduced
            elif getattr(handler, "ckptlab_of_empty_list", None) is not None:
                self.empty_list_calls[found] = handler.ckptlab_of_empty_list
            if self.fast_paths and key in _FAST_GLOBALS:
                if handler is None:
                    pass
                elif key == _FAST_GLOBALS[0]:
                    if self.persistent is not None:
                        self.fast_global, self.fast_handler = found, handler
                elif key == _FAST_GLOBALS[1]:
                    # what the handler does with no arguments (``ckptlab_no_args``, a class
                    # it would return an instance of, saves a frame per call), else itself
                    self.odict_global = found
                    self.odict_handler = getattr(handler, "ckptlab_no_args", handler)
                elif getattr(handler, "ckptlab_batchable", False):
                    # Parameters in batches: a handler that says it never raises for a
                    # tensor of the batch, a bool and an empty hooks dict
                    self.param_global, self.param_handler = found, handler
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
                made = handler(*args)
            except TypeError as exc:  # arguments the function does not take: bad data
                raise PickleDataError(f"{func.qualname} called with {len(args)} arguments it "
                                      f"does not take ({str(exc)[:120]})") from None
            if made is self.shared_empty and made is not None:  # (its argument, given back)
                raise SharedEmptyChanged(f"{func.qualname} gave back the shared empty dict")
            return made
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
            target.pairs.extend(zip(flat[::2], flat[1::2]))
        else:
            raise PickleDataError(f"SETITEM on a {type(target).__name__}")

    def appends(self, target: Any, items: list[Any]) -> None:
        self.charge(16 * len(items) + 16)
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, Reduced):
            target.items.extend(items)
        else:
            raise PickleDataError(f"APPEND on a {type(target).__name__}")

    def new_hooks(self) -> Any:
        """A tensor's hooks, ``OrderedDict()`` made on a fast path (nothing fills them)."""
        shared = self.shared_empty
        return self.odict_handler() if shared is None else shared  # type: ignore[misc]

    def build(self, target: Any, state: Any) -> None:
        if target is self.shared_empty and target is not None:
            raise SharedEmptyChanged("BUILD of the shared empty OrderedDict")
        if not isinstance(target, self.buildable):
            what = target.qualname if isinstance(target, Global) else type(target).__name__
            raise PickleDataError(f"BUILD applied to {what}, which ckptlab never builds")
        if isinstance(target, Reduced):
            if target.state is not None:
                raise PickleDataError(f"BUILD applied twice to a {target.func.qualname}")
            target.state = state
        else:
            target.ckptlab_build(state)

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
        # the budget lives in a local in the loop; methods that charge get it through
        # self.budget (synced around their calls)
        budget = self.budget
        pos = 0
        op = 0
        units = self.fused_batch is not None and n >= BULK_MIN_NBYTES  # state_run tried
        # the shared empty OrderedDict, which no BINGET may read back (see unshared)
        shared = _NOTHING if self.shared_empty is None else self.shared_empty
        # the plain opcodes in C (a budget of a C long long: memory_per_byte may be anything)
        plain = _c_opcodes if self.fast_paths and type(budget) is int and \
            0 <= budget < 1 << 62 else None
        failed = [0]  # where an error raised in it was raised
        # ... and the opcodes that call the machine (REDUCE, NEWOBJ, BUILD, BINPERSID, a
        # tensor rebuild as tensor_v2 does it) and BINUNICODE, through its own methods (or,
        # for a Reduced and a Parameter, as those methods would: plain_calls, param_handler)
        calls = (self, self.call, self.build, self.persistent, self.fused, self.plain_calls,
                 Global, Reduced, self.empty_list_calls, self.shared_empty)
        try:
            while True:
                if plain is not None:  # the plain opcodes from here, up to one left to the loop
                    try:
                        pos, stack, budget, last = plain(
                            data, pos, stack, metastack, memo, budget, self.odict_global,
                            self.odict_handler, self.fast_global, units, failed, calls)
                    except _ERRORS:
                        op = failed[0]
                        raise
                    push = stack.append
                    if last >= 0:
                        op = last
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
                    if self.fast_handler is not None:  # a state dict's key and its tensor?
                        done = self.tensor_entries(pos, budget, text, push)
                        if done is not None:
                            pos, budget, op = done
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
                        memo.append(stack[-1])
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
                    if value is shared:
                        self.unshared(value)
                    push(value)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    if value is self.fast_global:  # torch's tensor rebuild: try the fast path
                        done = self.tensor_v2(pos, budget)
                        if done is not None:
                            pos, budget, stack[-1], op = done
                    elif value is self.odict_global and data[pos:pos + 2] == b")R" and \
                            budget >= 336:
                        # OrderedDict(): EMPTY_TUPLE and REDUCE at once, as call() does them
                        # (a pickled module has a dozen empty hook dicts)
                        made = self.shared_empty
                        if made is None or _filled_at_once(data, pos + 2):
                            made = self.odict_handler()  # type: ignore[misc]
                        stack[-1] = made
                        budget -= 336
                        op = pos + 1  # the REDUCE
                        pos += 2
                        # and its LONG_BINPUT, when it appends to the memo
                        if pos + 5 <= n and data[pos] == 0x72 and budget >= 16 and \
                                _unpack_I(data, pos + 1)[0] == len(memo):
                            memo.append(made)
                            budget -= 16
                            op = pos
                            pos += 5
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
                    self.setitems(self.own(stack), items)
                    budget = self.budget
                    if units and pos < n and data[pos] in _INT_CODES:  # the next int's dict?
                        if self.state_pause:
                            self.state_pause -= 1
                        else:
                            ran = self.state_run(pos, budget, stack)
                            if type(ran) is int:
                                self.state_pause = max(BULK_PAUSE, ran)
                            else:
                                pos, budget, op = ran
                    continue
                if code == 0x63:  # GLOBAL
                    self.pos = pos
                    module = self.line("GLOBAL module")
                    name = self.line("GLOBAL name")
                    pos = self.pos
                    self.budget = budget
                    push(self.global_(module, name))
                    budget = self.budget - 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x94:  # MEMOIZE
                    if not stack:
                        raise PickleDataError("MEMOIZE with an empty stack")
                    memo.append(stack[-1])
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
                    return Interpretation(stack[0], self.proto, self.seen_globals, pos)
                # everything else, less frequent in checkpoints
                self.pos = pos
                self.budget = budget
                stack, push = self.rare(code, stack, metastack)
                pos = self.pos
                budget = self.budget
        except _ERRORS as exc:
            raise _position(op, exc) from None

    def tensor_v2(self, pos: int, budget: int, after_key: Any = _NOTHING
                  ) -> tuple[int, int, Any, int] | None:
        """torch's ``_rebuild_tensor_v2`` call at ``pos``, interpreted at once.

        torch writes every tensor as the same ~28 opcodes (:data:`_TENSOR_V2`): MARK MARK,
        the persistent id tuple and BINPERSID, offset, size and stride tuples, requires_grad,
        an empty ``OrderedDict()`` of hooks, TUPLE and REDUCE, with a BINPUT after each new
        object. ``pos`` is just after the BINGET of the ``_rebuild_tensor_v2`` global, or just
        after the string ``after_key`` (a state dict's key), where :data:`_ENTRY_V2` also takes
        the string's BINPUT and that BINGET. When the bytes are exactly that, with every BINGET
        reading an index stored before and the BINPUTs appending to the memo in order, this
        does what the loop would: the same memo entries, the same charges, the same
        ``persistent_load`` and handler calls in the same order, errors at the same opcode
        offsets. Anything else (a first GLOBAL inside, other memo indices, a budget that could
        run out inside, metadata after the hooks) returns None and the loop reads the bytes one
        opcode at a time. Returns where to go on, the budget left, the tensor and the offset of
        the last opcode taken.
        """
        memo = self.memo
        n = len(memo)
        indices = self.indices
        if after_key is not _NOTHING:
            m = _ENTRY_V2(self.data, pos)
            if m is None:
                return None
            (p_first, get, g_storage, g_type, key_op, p_key, g_location, i_numel, p_pid, _,
             i_offset, t_size, p_size, t_stride, p_stride, grad, g_hooks, _, p_hooks, p_args,
             _, p_result) = m.groups()
            idx = indices.get(get)
            if idx is None:
                idx = indices[get] = _memo_index(get)
            if idx >= n or memo[idx] is not self.fast_global:
                return None
            puts: tuple[Any, ...] = (p_first, p_key, p_pid, p_size, p_stride, p_hooks, p_args,
                                     p_result)
            marks = 10, 18, 21  # groups of BINPERSID and the two REDUCEs
            cost = 16  # the BINGET of the global
        else:
            m = _TENSOR_V2(self.data, pos)
            if m is None:
                return None
            (g_storage, g_type, key_op, p_key, g_location, i_numel, p_pid, _, i_offset, t_size,
             p_size, t_stride, p_stride, grad, g_hooks, _, p_hooks, p_args, _,
             p_result) = m.groups()
            puts = (p_key, p_pid, p_size, p_stride, p_hooks, p_args, p_result)
            marks = 8, 16, 19
            cost = 0
        # the BINGETs read indices stored before this tensor (else the loop does it)
        gets = (g_storage, g_type, g_location, g_hooks)
        known = self.gets.get(gets)
        if known is None:
            where = tuple(map(_memo_index, gets))
            known = self.gets[gets] = (where, max(where))
        where, top = known
        if top >= n:
            return None  # a sparse or missing index: the loop handles (or reports) it
        if key_op[0] == 0x58:
            digits = key_op[5:]
            if len(digits) != key_op[1]:
                return None  # the declared length splits the bytes elsewhere
            key = digits.decode("ascii")
            cost += 96 + 4 * len(digits)
        else:
            idx = _memo_index(key_op)
            if idx >= n:
                return None
            key = memo[idx]
            cost += 16
        # the BINPUTs append to the memo in order (else the loop does what they say)
        count = len(puts)
        try:
            joined = b"".join(puts)
        except TypeError:  # some object is not memoized (None: no BINPUT)
            count -= puts.count(None)
            joined = b"".join(filter(None, puts))
        if len(joined) == 5 * count:
            base, step = _LONG_PUTS[count]
        elif len(joined) == 2 * count and n + count <= 256:
            base, step = _SHORT_PUTS[count]
        else:
            return None
        if int.from_bytes(joined, "little") != base + n * step:
            return None
        if i_numel[0] == 0x4B:
            numel = i_numel[1]
            cost += 16
        else:
            numel = _small_int(i_numel)[0]
            cost += 48
        if i_offset[0] == 0x4B:
            offset = i_offset[1]
            cost += 16
        else:
            offset = _small_int(i_offset)[0]
            cost += 48
        tuples = self.tuples
        size = tuples.get(t_size)
        if size is None:
            size = tuples[t_size] = _int_tuple_op(t_size)
        stride = tuples.get(t_stride)
        if stride is None:
            stride = tuples[t_stride] = _int_tuple_op(t_stride)
        # MARK MARK, 4 BINGETs, TUPLE of 5, BINPERSID, requires_grad, EMPTY_TUPLE, TUPLE of 6,
        # two REDUCEs, a memo slot per BINPUT
        cost += 1304 + size[1] + stride[1] + 16 * count
        if budget < cost:
            return None  # the loop finds the opcode where it runs out
        budget -= cost
        hooks_func = memo[where[3]]
        pid = (memo[where[0]], memo[where[1]], key, memo[where[2]], numel)
        valid = size[2] and stride[2] and len(size[0]) == len(stride[0]) and offset >= 0
        size = (*size[0],)  # a tuple of its own, as the loop would build
        stride = (*stride[0],)
        requires_grad = grad == b"\x88"
        fused = self.fused
        both = None
        if fused is not None and valid and hooks_func is self.odict_global:
            both = fused(pid, offset, size, stride, requires_grad)
        if both is not None:  # persistent_load and the handler in one call, as they would
            ref, result = both
            hooks = self.new_hooks()
            args = (ref, offset, size, stride, requires_grad, hooks)
        else:
            stage = 0
            try:
                ref = self.persistent(pid)  # type: ignore[misc]
                stage = 1
                if hooks_func is self.odict_global:
                    hooks = self.new_hooks()
                else:
                    self.budget = budget + 320  # call() charges its REDUCE again
                    hooks = self.call(hooks_func, ())
                    budget = self.budget
                args = (ref, offset, size, stride, requires_grad, hooks)
                stage = 2
                result = self.fast_handler(*args)  # type: ignore[misc]
            except TypeError as exc:  # in a handler call() makes: what call() says of it
                if stage == 0:
                    raise
                func = hooks_func if stage == 1 else self.fast_global
                raise _position(m.start(marks[stage]), PickleDataError(
                    f"{func.qualname} called with {0 if stage == 1 else 6} arguments it does "
                    f"not take ({str(exc)[:120]})")) from None
            except _ERRORS as exc:
                raise _position(m.start(marks[stage]), exc) from None
        if after_key is _NOTHING:
            values: Any = (key, pid, size, stride, hooks, args, result)
        else:
            values = (after_key, key, pid, size, stride, hooks, args, result)
        memo.extend(values if count == len(puts) else compress(values, puts))
        # the last opcode taken (the loop reports a pickle ending without STOP there)
        last = m.start(marks[2] + 1) if p_result is not None else m.start(marks[2])
        return m.end(), budget, result, last

    def tensor_entries(self, pos: int, budget: int, key: str, push: Callable[[Any], None]
                       ) -> tuple[int, int, int] | None:
        """State dict entries from ``pos``, just after the string ``key``: each tensor (see
        :meth:`tensor_v2`) is pushed after its key, then the next key string is taken as
        BINUNICODE would, and so on while the bytes are that. Returns where the loop goes on
        (after a tensor, or after a key whose tensor is not the template), the budget left and
        the offset of the last opcode taken; None when the first tensor is not the template.
        """
        data = self.data
        n = self.n
        done = self.tensor_v2(pos, budget, key)
        if done is None:
            return None
        bulk = self.fused_batch is not None and n >= BULK_MIN_NBYTES
        # entries go alone until a batch is due (entry_pause): a file's first few are not
        # worth one, nor the entries a batch not taken looked at. The count goes on across
        # runs: Parameters, which tensor_v2 leaves to the loop, end each run but not a batch.
        while True:
            pos, budget, result, last = done
            push(result)
            if bulk:
                if self.entry_pause:
                    self.entry_pause -= 1
                else:
                    ran = self.entry_run(pos, budget, push.__self__)  # type: ignore[attr-defined]
                    if type(ran) is int:
                        self.entry_pause = max(BULK_PAUSE, ran)
                    else:
                        pos, budget, last = ran
            # the next entry's key: a BINUNICODE the loop would take the same way
            if pos + 5 > n or data[pos] != 0x58:
                return pos, budget, last
            (length,) = _unpack_I(data, pos + 1)
            start = pos + 5
            cost = 96 + 4 * length
            if start + length > n or budget < cost:
                return pos, budget, last  # the loop reports it at this opcode
            try:
                key = str(data[start:start + length], "utf-8", "surrogatepass")
            except UnicodeDecodeError:
                return pos, budget, last
            push(key)
            budget -= cost
            done = self.tensor_v2(start + length, budget, key)
            if done is None:
                return start + length, budget, pos

    def entry_run(self, pos: int, budget: int, stack: list[Any]) -> tuple[int, int, int] | int:
        """Up to :data:`BULK_BATCH` state dict entries from ``pos`` (a key string, then its
        tensor as :meth:`tensor_v2` takes it after a key), all at once.

        The batch is taken only when every entry is what :meth:`tensor_v2` would take without
        a fallback and with the fused handler (:func:`interpret`'s ``fused_tensor_v2``): the
        same BINGETs of the global, the storage tag, the location and the hooks' ``OrderedDict``
        in every entry, and storage classes (a few, entry by entry), all of earlier memo
        indices; the BINPUTs (an entry's own) appending to the memo in order (checked for the
        whole batch at once); UTF-8 keys; sizes and strides valid; a budget that covers the
        whole batch. Then it does what the entries one at a time would: the keys and tensors
        pushed in order, the same memo entries, the same charges and the same handler results
        (the fused handler takes the batch in one call, all or nothing: :meth:`fuse`), and
        returns where the loop goes on, the budget left and the offset of the last opcode
        taken. Anything else: nothing changed, the
        entries go one at a time, and it returns how many entries it looked at.
        """
        if _c_entries is not None:
            return self.entry_run_c(pos, budget, stack)
        data = self.data
        n = self.n
        memo = self.memo
        size0 = len(memo)
        lengths: list[int] = []
        matches: list[Any] = []
        specs = self.entry_specs
        used: list[_EntrySpec] = []  # the pattern of each entry, when specialised
        after = self.entry_after  # two shapes -> the shape of the entry after them, last time
        starts = []
        pos0 = pos
        context: tuple[_EntrySpec | None, _EntrySpec | None] = (None, None)
        for _ in range(BULK_BATCH):
            if pos + 5 > n or data[pos] != 0x58:
                break
            (length,) = _unpack_I(data, pos + 1)
            start = pos + 5
            end = start + length
            if end > n:
                break
            if not specs:
                m = _ENTRY_V2(data, end)
                if m is None:
                    break
            else:  # the shape that came after the last two last time first (layers repeat)
                guess = after.get(context, specs[0])
                m = guess.match(data, end)
                if m is None:
                    tried = guess
                    for guess in specs:
                        if guess is not tried:
                            m = guess.match(data, end)
                            if m is not None:
                                break
                    if m is None:
                        break
                    after[context] = guess
                used.append(guess)
                context = (context[1], guess)
            starts.append(start)
            lengths.append(length)
            matches.append(m)
            pos = m.end()
        try:  # the keys, as BINUNICODE takes them
            keys = list(map(str, map(data.__getitem__, map(slice, starts, map(
                int.__add__, starts, lengths))), repeat("utf-8"), repeat("surrogatepass")))
        except UnicodeDecodeError:  # up to the first that is not UTF-8
            keys = []
            for start, length in zip(starts, lengths):
                try:
                    keys.append(str(data[start:start + length], "utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    break
            del matches[len(keys):], lengths[len(keys):], used[len(keys):]
            pos = matches[-1].end() if matches else pos0
        count = len(matches)
        if specs and count < 2:  # not the last batches' shapes: the general pattern
            self.entry_specs = []
            ran = self.entry_run(pos0, budget, stack)
            if not self.entry_specs:  # (the general batch was not taken)
                self.entry_specs = specs
            return ran
        if count < 2:
            return count
        got = self.tensor_columns(matches, used, size0)
        if got is None:
            return count
        _, joined, puts, _, _, _, _, charged, names, _ = got
        if not _puts_in_order(joined, puts, size0):
            return count
        cost = (count * (96 + 16 + 1304) + 16 * puts + 4 * sum(lengths)
                + 96 * count + 4 * sum(map(len, names)) + charged)
        if cost > budget:
            return count  # one at a time: the loop says where it runs out
        done = self.fuse(got, keys)
        if done is None:
            return count
        results, stored = done
        memo += stored
        stack.extend(chain.from_iterable(zip(keys, results)))
        last = matches[-1]
        if not specs:
            if count >= _SPEC_MIN:
                self.entry_specs = _entry_specs(matches)
                self.entry_after = {}
            # the last opcode taken: the BINPUT of the result, else its REDUCE
            return pos, budget - cost, last.start(22) if last.group(22) is not None else \
                last.start(21)
        return pos, budget - cost, last.end() - used[-1].last_back

    def entry_run_c(self, pos: int, budget: int, stack: list[Any]
                    ) -> tuple[int, int, int] | int:
        """:meth:`entry_run` with the entries located and decoded by the compiled scanner
        (:mod:`ckptlab.format._entries`): the same batch, taken on the same checks. The
        scanner has checked the bytes of each entry (as :data:`_ENTRY_V2` reads them), its
        ints, sizes and strides, its UTF-8 key, its BINPUTs storing the next memo indices in
        order and the four BINGETs alike in every entry, and worked out the charges; what is
        left here is what the memo holds (the global, the hooks' global, the storage classes
        and keys read by BINGET, all stored before the batch) and the budget.

        The scanner also takes two shapes the patterns leave to the loop: a tensor wrapped in
        a Parameter (its ``_rebuild_parameter`` BINGET alike in every one, the global stored
        before the batch; asked for only where that handler may go in a batch:
        :meth:`parameters`), and a storage key read back by BINGET from an earlier entry's
        BINPUT (a view of the storage before it), which the scanner resolves to that entry's
        key."""
        memo = self.memo
        size0 = len(memo)
        # Parameters only with a handler of _rebuild_parameter that may go in a batch
        got = _c_entries(self.data, pos, BULK_BATCH, size0,  # type: ignore[misc]
                         self.param_handler is not None)
        if got is None:
            return 0
        (count, end, last, keys, masks, shared, classes, names, numels, offsets, sizes,
         strides, grads, puts, cost, g_param, params) = got
        if count < 2 or cost > budget:
            return count  # (the budget: one opcode at a time, the loop says where)
        if params is not None and (g_param >= size0 or memo[g_param] is not self.param_global):
            return count
        cols = self.checked_columns(size0, count, masks, shared, classes, names, numels,
                                    offsets, sizes, strides, grads, puts)
        if cols is None:
            return count
        done = self.fuse(cols, keys, params)
        if done is None:
            return count
        results, stored = done
        memo += stored
        stack.extend(chain.from_iterable(zip(keys, results)))
        return end, budget - cost, last

    def state_run(self, pos: int, budget: int, stack: list[Any]) -> tuple[int, int, int] | int:
        """Dicts of tensors under int keys from ``pos``, all at once: an optimizer's state
        (``{0: {"step": t, "exp_avg": t, "exp_avg_sq": t}, 1: ...}``), whose dicts torch
        pickles as the int, EMPTY_DICT, its LONG_BINPUT, MARK, then each key as a BINGET of
        a string stored before and its tensor as :meth:`tensor_v2` takes it after a key, and
        SETITEMS (a *unit*; up to :data:`BULK_BATCH` tensors of units are taken together).

        Taken only as :meth:`entry_run` takes its entries (:meth:`tensor_columns`), with
        every BINPUT, the dicts' among the tensors', appending to the memo in order and every
        key a string; then it does what the loop would: the same memo entries, charges and
        handler results, each int and its dict pushed in order, and returns where the loop
        goes on (after the last SETITEMS), the budget left and that SETITEMS' offset.
        Anything else: nothing changed, and it returns how many units it looked at. After a
        batch, its last unit's tensors become patterns (:class:`_EntrySpec`) the next batch
        matches position by position.
        """
        if _c_units is not None:
            return self.state_run_c(pos, budget, stack)
        data = self.data
        n = self.n
        memo = self.memo
        size0 = len(memo)
        specs = self.unit_specs
        heads: list[re.Match[Any]] = []
        per_unit: list[int] = []  # tensors in each unit
        gets: list[bytes] = []  # the keys' BINGETs
        matches: list[re.Match[Any]] = []
        pos0 = pos
        while len(matches) < BULK_BATCH:
            head = _UNIT_HEAD(data, pos)
            if head is None:
                break
            q = head.end()
            unit_gets: list[bytes] = []
            unit: list[re.Match[Any]] = []
            while q < n and data[q] != 0x75 and (not specs or len(unit) < len(specs)):
                get = _KEY_GET(data, q)
                if get is None:
                    break
                m = specs[len(unit)].match(data, get.end()) if specs else \
                    _ENTRY_V2(data, get.end())
                if m is None or (not specs and m.group(1) is not None):
                    break  # (a BINPUT of the key it just read: the loop's to do)
                unit_gets.append(get.group())
                unit.append(m)
                q = m.end()
            if not unit or q >= n or data[q] != 0x75 or (specs and len(unit) != len(specs)):
                break
            heads.append(head)
            per_unit.append(len(unit))
            gets += unit_gets
            matches += unit
            pos = q + 1
        units = len(heads)
        if specs and units < 2:  # not the last batch's tensors: the general pattern
            self.unit_specs = []
            ran = self.state_run(pos0, budget, stack)
            if not self.unit_specs:
                self.unit_specs = specs
            return ran
        if units < 2:
            return units
        count = len(matches)
        used = specs * units if specs else []
        got = self.tensor_columns(matches, used, size0)
        if got is None:
            return units
        put_mask, joined, puts, _, _, _, _, charged, names, _ = got
        # the keys: strings stored before the batch
        where = [g[1] if len(g) == 2 else _unpack_I(g, 1)[0] for g in gets]
        if max(where) >= size0:
            return units
        keys = list(map(memo.__getitem__, where))
        if set(map(type, keys)) != _STR_ONLY:
            return units
        # every BINPUT in order: each unit's dict, then its tensors'
        ends = _put_ends(put_mask, count)
        bounds = list(accumulate(per_unit, initial=0))
        joined = b"".join(chain.from_iterable(
            (head.group(2), joined[5 * ends[a]:5 * ends[b]])
            for head, a, b in zip(heads, bounds, bounds[1:])))
        if not _puts_in_order(joined, units + puts, size0):
            return units
        ints = [(op[1], 16) if op[0] == 0x4B else (_unpack_H(op, 1)[0], 48) if op[0] == 0x4D
                else (_unpack_i(op, 1)[0], 48) for op in map(re.Match.group, heads, repeat(1))]
        # the loop's charges: the int, EMPTY_DICT, the dict's BINPUT, MARK, SETITEMS; each
        # tensor's key (a BINGET), the global's BINGET and the tensor itself
        cost = (sum(map(_SECOND, ints)) + units * (96 + 16 + 88 + 64) + 64 * count
                + count * (16 + 16 + 1304 + 96) + 16 * puts + 4 * sum(map(len, names))
                + charged)
        if cost > budget:
            return units  # one opcode at a time: the loop says where it runs out
        done = self.fuse(got, keys)
        if done is None:
            return units
        self.unit_dicts(map(_FIRST, ints), bounds, ends, keys, done, stack)
        if not specs and count >= _SPEC_MIN:
            last = matches[-per_unit[-1]:]
            made = [_entry_spec(m) for m in last]
            if None not in made:
                self.unit_specs = made  # type: ignore[assignment]
        return pos, budget - cost, pos - 1

    def state_run_c(self, pos: int, budget: int, stack: list[Any]
                    ) -> tuple[int, int, int] | int:
        """:meth:`state_run` with the units located and decoded by the compiled scanner
        (:mod:`ckptlab.format._entries`), taken on the same checks as
        :meth:`entry_run_c`'s (the keys: strings stored before the batch)."""
        memo = self.memo
        size0 = len(memo)
        got = _c_units(self.data, pos, BULK_BATCH, size0)  # type: ignore[misc]
        if got is None:
            return 0
        (units, end, ints, per_unit, key_gets, masks, shared, classes, names, numels, offsets,
         sizes, strides, grads, puts, cost) = got
        if units < 2:
            return units
        cols = self.checked_columns(size0, len(key_gets), masks, shared, classes, names,
                                    numels, offsets, sizes, strides, grads, puts)
        if cols is None or max(key_gets) >= size0:
            return units
        keys = list(map(memo.__getitem__, key_gets))
        if set(map(type, keys)) != _STR_ONLY or cost > budget:
            return units  # (the budget: one opcode at a time, the loop says where)
        done = self.fuse(cols, keys)
        if done is None:
            return units
        self.unit_dicts(ints, list(accumulate(per_unit, initial=0)),
                        _put_ends(cols[0], len(keys)), keys, done, stack)
        return end, budget - cost, end - 1

    def unit_dicts(self, ints: Iterable[int], bounds: list[int], ends: list[int],
                   keys: list[Any], done: tuple[list[Any], list[Any]], stack: list[Any]
                   ) -> None:
        """What the loop leaves of a batch of units (:meth:`fuse`'s ``done``): each unit's
        int and its dict pushed, the dict then its tensors' BINPUT values in the memo (unit
        ``u`` holds tensors ``bounds[u]:bounds[u + 1]``, whose values are
        ``stored[ends[a]:ends[b]]``)."""
        memo = self.memo
        results, stored = done
        for key, a, b in zip(ints, bounds, bounds[1:]):
            target: dict[Any, Any] = {}
            target.update(zip(keys[a:b], results[a:b]))
            memo.append(target)
            memo += stored[ends[a]:ends[b]]
            stack += (key, target)

    def checked_columns(self, size0: int, count: int, masks: bytes, shared: tuple[int, ...],
                        classes: list[int], names: list[Any], numels: list[int],
                        offsets: list[int], sizes: list[Any], strides: list[Any],
                        grads: list[bool], puts: int) -> tuple[Any, ...] | None:
        """The columns of a compiled walk's tensors as :meth:`fuse` takes them, when what
        the memo holds is what a batch needs: the four shared BINGETs, the storage classes
        and the storage keys read by BINGET all stored before the batch (``size0``), the
        global torch's tensor rebuild, the hooks' ``OrderedDict``, the keys strings."""
        memo = self.memo
        stored = self.batch_memo(shared, classes, size0)
        if stored is None:
            return None
        tag, location, type_of = stored
        if set(map(type, names)) != _STR_ONLY:  # storage keys by BINGET: strings stored before
            if max(k for k in names if type(k) is int) >= size0:
                return None
            names = [memo[k] if type(k) is int else k for k in names]
        pids = list(zip(repeat(tag), map(type_of.__getitem__, classes), names,
                        repeat(location), numels))
        first = masks[0]
        put_mask = list(_MASKS[first]) if masks.count(first) == count else list(
            map(_MASKS.__getitem__, masks))
        return put_mask, None, puts, offsets, sizes, strides, grads, None, names, pids

    def batch_memo(self, shared: Sequence[int], classes: Iterable[int], size0: int
                   ) -> tuple[str, str, dict[int, Any]] | None:
        """What a batch's BINGETs read, when the memo holds what a batch needs: the four
        every tensor has (``shared``: the global, torch's tensor rebuild; the storage tag
        and the location, strings; the hooks' ``OrderedDict``) and the storage classes
        (``classes``), all of indices stored before the batch (below ``size0``). Returns the
        tag, the location and ``{class index: class}``; None: not a batch."""
        memo = self.memo
        g_global, g_tag, g_location, g_hooks = shared
        if max(shared) >= size0 or memo[g_global] is not self.fast_global or \
                memo[g_hooks] is not self.odict_global or self.odict_handler is None:
            return None
        tag, location = memo[g_tag], memo[g_location]
        if type(tag) is not str or type(location) is not str:
            return None  # (the loop says what is wrong, without hashing what they are)
        class_of = dict.fromkeys(classes)
        if max(class_of) >= size0:
            return None
        for index in class_of:
            class_of[index] = memo[index]
        return tag, location, class_of

    def fuse(self, got: tuple[Any, ...], keys: list[Any], params: bytes | None = None
             ) -> tuple[list[Any], list[Any]] | None:
        """The persistent ids and the handler of a batch's tensors (``got``, from
        :meth:`tensor_columns`; ``keys`` their dict keys), all at once or not at all: the
        results, and what the tensors' BINPUTs store, in memo order. None: nothing changed.
        ``params``: which tensors are Parameters (the compiled walk's column)."""
        put_mask, _, _, offsets, sizes, strides, grads, _, names, pids = got
        both = self.fused_batch(pids, offsets, sizes, strides, grads)  # type: ignore[misc]
        if both is None:
            return None
        refs, results = both
        shared = self.shared_empty
        if shared is None:
            odict = self.odict_handler
            hooks = [odict() for _ in range(len(refs))]  # type: ignore[misc]
        else:
            hooks = [shared] * len(refs)
        args = list(zip(refs, offsets, sizes, strides, grads, hooks))
        values = (keys, names, pids, sizes, strides, hooks, args, results)
        if params is not None:
            return self.parameters(values, put_mask, params)
        if type(put_mask[0]) is bool:  # the same BINPUTs in every tensor
            return results, list(chain.from_iterable(zip(*compress(values, put_mask))))
        return results, list(chain.from_iterable(map(compress, zip(*values), put_mask)))

    def parameters(self, values: tuple[list[Any], ...], put_mask: list[Any], params: bytes
                   ) -> tuple[list[Any], list[Any]]:
        """:meth:`fuse`'s results and memo entries for a batch with Parameters: each tensor
        ``params`` marks (``0x10``; ``0x08`` its requires_grad, bits 0-2 its BINPUTs) goes
        through the ``_rebuild_parameter`` handler as the loop would call it, with its own
        empty hooks dict (the handler never raises: ``ckptlab_batchable``)."""
        tensors = values[7]
        count = len(tensors)
        handler = self.param_handler
        new_hooks = self.new_hooks
        hooks: list[Any] = [None] * count
        args: list[Any] = [None] * count
        results = list(tensors)
        for i in compress(range(count), params):
            hooks[i] = new_hooks()
            args[i] = (tensors[i], params[i] & 0x08 != 0, hooks[i])
            results[i] = handler(*args[i])  # type: ignore[misc]
        tensor_masks = repeat(tuple(put_mask)) if type(put_mask[0]) is bool else put_mask
        masks = map(tuple.__add__, tensor_masks, map(_PARAM_MASKS.__getitem__, params))
        return results, list(chain.from_iterable(map(compress, zip(
            *values, hooks, args, results), masks)))

    def tensor_columns(self, matches: list[re.Match[Any]], used: list[_EntrySpec],
                       size0: int) -> tuple[Any, ...] | None:
        """The columns of a batch's tensors (:data:`_ENTRY_V2` matches, or matches of the
        :class:`_EntrySpec` patterns ``used``, one per match, when it is not empty),
        checked as :meth:`entry_run` says, save the order of the BINPUTs: ``(put_mask,
        joined, puts, offsets, sizes, strides, grads, charged, names, pids)``, where
        ``joined`` is every BINPUT's bytes in order (``puts`` of them), ``put_mask`` says which
        of :data:`_ENTRY_PUTS` each entry has (one list of bools for all, or one tuple each)
        and ``charged`` is what the loop charges for the ints and tuples. None: not taken.
        """
        count = len(matches)
        tuples = self.tuples
        kinds = dict.fromkeys(used)  # the shapes of this batch's entries, when specialised
        if kinds:
            # each shape's constants worked out once; the captured groups (BINPUTs, storage
            # keys) are the only columns read entry by entry
            shared = {tuple(kind.constants[i] for i in _ENTRY_SHARED) for kind in kinds}
            if len(shared) != 1:
                return None
            shared_ops = next(iter(shared))
            type_ops = [used[0].constants[3]] * count if len(kinds) == 1 else list(map(
                dict((kind, kind.constants[3]) for kind in kinds).__getitem__, used))
            # every pattern captures the same groups (_SPEC_GROUPS), b"" for a BINPUT its
            # shape lacks
            cap = dict(zip(_SPEC_GROUPS, zip(*map(_GROUPS, matches))))
            key_ops = cap[4]
            put_cols = [cap[i] for i in _ENTRY_PUTS]
            put_mask, joined, puts = _put_columns(put_cols)
            shape_values = {kind: kind.values() for kind in kinds}
            if None in shape_values.values():
                return None
            if len(kinds) == 1:  # one shape: its values, repeated
                numel, offset, size, stride, grad, charge = (  # type: ignore[misc]
                    shape_values[used[0]])
                numels, offsets, grads = [numel] * count, [offset] * count, [grad] * count
                sizes = [(*size,) for _ in range(count)]  # tuples of their own, as the loop
                strides = [(*stride,) for _ in range(count)]  # builds
                charged = count * charge
            else:
                numels, offsets, size_t, stride_t, grads, charges = map(list, zip(*map(
                    shape_values.__getitem__, used)))
                sizes = [(*t,) for t in size_t]
                strides = [(*t,) for t in stride_t]
                charged = sum(charges)
        else:
            cols = list(zip(*map(_GROUPS, matches)))
            # the same BINGETs in every entry
            if any(len(set(cols[i])) != 1 for i in _ENTRY_SHARED):
                return None
            shared_ops = tuple(cols[i][0] for i in _ENTRY_SHARED)
            type_ops = cols[3]
            key_ops = cols[4]
            put_mask, joined, puts = _put_columns([cols[i] for i in _ENTRY_PUTS])
            # ints, sizes and strides, and what the loop would charge for them
            ints: dict[bytes, tuple[int, int]] = {}
            for op in set(cols[7]) | set(cols[10]):
                ints[op] = _small_int(op)
            numel_ints = list(map(ints.__getitem__, cols[7]))
            offset_ints = list(map(ints.__getitem__, cols[10]))
            numels = list(map(_FIRST, numel_ints))
            offsets = list(map(_FIRST, offset_ints))
            if min(offsets) < 0:
                return None
            for op in set(cols[11]) | set(cols[13]):
                if op not in tuples:
                    tuples[op] = _int_tuple_op(op)
            size_ops = list(map(tuples.__getitem__, cols[11]))
            stride_ops = list(map(tuples.__getitem__, cols[13]))
            for size_op, stride_op in set(zip(cols[11], cols[13])):  # each pair of opcodes once
                (size, _, size_ok), (stride, _, stride_ok) = tuples[size_op], tuples[stride_op]
                if not (size_ok and stride_ok and len(size) == len(stride)):
                    return None
            charged = (sum(map(_SECOND, numel_ints)) + sum(map(_SECOND, offset_ints))
                       + sum(map(_SECOND, size_ops)) + sum(map(_SECOND, stride_ops)))
            sizes = [(*t[0],) for t in size_ops]  # tuples of their own, as the loop builds
            strides = [(*t[0],) for t in stride_ops]
            grads = list(map(b"\x88".__eq__, cols[15]))
        index_of = {op: _memo_index(op) for op in set(type_ops)}  # storage classes, the same
        stored = self.batch_memo(list(map(_memo_index, shared_ops)), index_of.values(), size0)
        if stored is None:
            return None
        tag, location, class_of = stored
        type_of = {op: class_of[index] for op, index in index_of.items()}
        # storage keys: written out (X) in every entry, each of its declared length
        if bytes(map(_FIRST, key_ops)) != b"X" * count:
            return None
        storage_keys = list(map(_AFTER_LENGTH, key_ops))
        if list(map(_SECOND, key_ops)) != list(map(len, storage_keys)) or \
                set(map(_LENGTH_REST, key_ops)) != {b"\x00\x00\x00"}:
            return None
        names = list(map(bytes.decode, storage_keys, repeat("ascii")))
        pids = list(zip(repeat(tag), map(type_of.__getitem__, type_ops), names, repeat(location),
                        numels))
        return put_mask, joined, puts, offsets, sizes, strides, grads, charged, names, pids

    def rare(self, code: int, stack: list[Any], metastack: list[list[Any]]
             ) -> tuple[list[Any], Any]:
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
            self.setitems(self.own(stack), [key, value])
        elif code == 0x62:  # BUILD
            _need(stack, 2, code)
            state = stack.pop()
            self.build(self.own(stack), state)
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
            push(self.unshared(stack[-1]))
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
            push(self.global_(module, name))
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
            push(self.call(self.global_(module, name), tuple(items)))
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
