"""One pickle, interpreted inertly, with everything it imports and calls written down.

The pickle runs through ckptlab's one interpreter (:func:`ckptlab.format._unpickle.interpreter`)
with handlers that answer every global: each call is recorded and builds an inert record
(:class:`_Made`, a :class:`~ckptlab.format._unpickle.Reduced` whose BUILD and items the scan
sees); persistent ids and BUILDs on anything else are recorded too. Calls, BUILDs and persistent
ids happen in the order of their opcodes, so the k-th of each is the k-th such opcode of the
pickle (:func:`~ckptlab.format._optable.opcode_spans`): that is where each is reported.

The same record then answers both questions of a scan: what each global would do under
``weights_only=False`` (:func:`ckptlab.safety._classes.classify`) and where torch's weights-only
unpickler would stop (:class:`ckptlab.safety._weights_only.Policy`).
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any

from ckptlab.errors import PickleDataError
from ckptlab.format import _pickle
from ckptlab.format._optable import opcode_spans
from ckptlab.format._unpickle import (
    Global,
    OpaqueKey,
    Reduced,
    failure_offset,
    interpreter,
)
from ckptlab.safety._classes import classify
from ckptlab.safety._weights_only import Policy, Refusal

__all__ = ["PickleFindings", "Use", "render", "scan_pickle"]

_CALL_OPS = frozenset(b"R\x81\x92oi")  # REDUCE NEWOBJ NEWOBJ_EX OBJ INST
_BUILD = ord("b")
_PERSID_OPS = frozenset(b"QP")  # BINPERSID PERSID
_APPEND_OPS = frozenset(b"ae")
_SETITEM_OPS = frozenset(b"su")
_GLOBAL_OPS = frozenset(b"c\x93i")  # GLOBAL STACK_GLOBAL INST
_NEW_OPS = frozenset(b"\x81\x92")
_RECONSTRUCTORS = frozenset({"copyreg._reconstructor", "copyreg.__newobj__",
                             "copyreg.__newobj_ex__"})
MAX_RENDER = 160  # characters of a call's arguments shown
MAX_CODE_CALLS = 64  # code calls reported one by one per pickle (the rest counted)
MAX_WALK = 200_000  # objects looked at to find where in the loaded object each call sits


def render(value: Any, limit: int = MAX_RENDER) -> str:
    """A bounded, inert rendering of a pickled value (nothing of it is called)."""
    out: list[str] = []
    room = [limit]

    def put(text: str) -> bool:
        if room[0] <= 0:
            return False
        out.append(text[: room[0]])
        room[0] -= len(text)
        return room[0] > 0

    def walk(v: Any, depth: int) -> None:
        if room[0] <= 0:
            return
        kind = type(v)
        if kind in (str, bytes, bytearray, int, float, bool, complex) or v is None:
            put(repr(v) if kind is not int or v.bit_length() < 128 else f"<int of "
                f"{v.bit_length()} bits>")
        elif isinstance(v, _Made):
            put(f"{v.func.module}.{v.func.name}(")
            if depth < 4:
                for i, item in enumerate(v.args):
                    if i and not put(", "):
                        return
                    walk(item, depth + 1)
            put(")")
        elif isinstance(v, Global):
            put(f"{v.module}.{v.name}")
        elif isinstance(v, Reduced):
            put(f"{v.func.module}.{v.func.name}(...)")
        elif isinstance(v, _Stored):  # what the unpickler would ask persistent_load for
            put("persistent_load(")
            walk(v.pid, depth + 1)
            put(")")
        elif isinstance(v, OpaqueKey):
            walk(v.value, depth)
        elif kind in (tuple, list, set, frozenset) and depth < 4:
            left, right = {tuple: "()", list: "[]"}.get(kind, "{}")
            put(left)
            for i, item in enumerate(v):
                if i and not put(", "):
                    return
                walk(item, depth + 1)
            put("," + right if kind is tuple and len(v) == 1 else right)
        elif kind is dict and depth < 4:
            put("{")
            for i, (key, item) in enumerate(v.items()):
                if i and not put(", "):
                    return
                walk(key, depth + 1)
                put(": ")
                walk(item, depth + 1)
            put("}")
        else:
            put("...")

    walk(value, 0)
    text = "".join(out)
    return text if room[0] > 0 else text[: limit - 3] + "..."


def render_args(args: tuple[Any, ...], limit: int = MAX_RENDER) -> str:
    """A call's arguments as they would be written in the call: ``'ls', 1``."""
    text = ", ".join(render(a, limit) for a in args)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Made(Reduced):
    """What a call made, inert; its BUILD and first APPEND/SETITEM are told to the scan."""

    __slots__ = ("_scan",)

    def __init__(self, scan: _Scan, func: Any, args: tuple[Any, ...],
                 kwargs: Any = None) -> None:
        self._scan = None
        super().__init__(func, args, kwargs)
        self._scan = scan

    def _get_state(self) -> Any:
        return Reduced.state.__get__(self)  # type: ignore[attr-defined]

    def _set_state(self, value: Any) -> None:
        if self._scan is not None:
            self._scan.builds.append(self)
        Reduced.state.__set__(self, value)  # type: ignore[attr-defined]

    def _get_items(self) -> Any:
        return Reduced.items.__get__(self)  # type: ignore[attr-defined]

    def _set_items(self, value: Any) -> None:
        if self._scan is not None:
            self._scan.filled.append(("append", self))
        Reduced.items.__set__(self, value)  # type: ignore[attr-defined]

    def _get_pairs(self) -> Any:
        return Reduced.pairs.__get__(self)  # type: ignore[attr-defined]

    def _set_pairs(self, value: Any) -> None:
        if self._scan is not None:
            self._scan.filled.append(("setitem", self))
        Reduced.pairs.__set__(self, value)  # type: ignore[attr-defined]

    state = property(_get_state, _set_state)  # type: ignore[assignment]
    items = property(_get_items, _set_items)  # type: ignore[assignment]
    pairs = property(_get_pairs, _set_pairs)  # type: ignore[assignment]

    @property
    def qualname(self) -> str:
        return f"{self.func.module}.{self.func.name}"


class _Stored:
    """A persistent id's object (a storage, in torch's files): inert."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid


@dataclass
class Use:
    """One global of a pickle: how it is used, where first, and its calls."""

    module: str
    name: str
    offset: int  # the opcode that first named it
    hows: set[str] = field(default_factory=set)
    # (offset, rendered args, where: the key path in the loaded object of the value the call
    # makes, "." joined; None where not found)
    calls: list[tuple[int, str, str | None]] = field(default_factory=list)
    ncalls: int = 0

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class PickleFindings:
    """What one pickle imports and calls, and what torch's weights-only unpickler does."""

    end: int | None  # just past its STOP (None: ckptlab could not follow it to the end)
    root: Any  # what it builds (inert), None where it failed
    uses: dict[str, Use]
    error: str | None  # why ckptlab's interpreter stopped, None when it reached STOP
    error_offset: int | None
    refusal: Refusal | None  # where torch's weights-only unpickler stops (None: accepted)
    decided: bool  # False: ckptlab could not follow the pickle far enough to tell
    code_after_error: list[tuple[int, str]] = field(default_factory=list)
    # the bytes given to torch.storage._load_from_bytes (torch.load runs on each), with the
    # offset of the call
    nested: list[tuple[int, bytes]] = field(default_factory=list)
    # a STOP with objects left on the stack (the loaders return the top one; ``root`` is
    # then None, not known)
    lenient_stop: bool = False

    def classes(self, torch_allowed: frozenset[str]) -> dict[str, tuple[str, str]]:
        return {q: classify(u.module, u.name, u.hows, torch_allowed=torch_allowed)
                for q, u in self.uses.items()}


class _Scan:
    """The handlers, persistent_load and build hook of one interpretation."""

    def __init__(self) -> None:
        self.calls: list[_Made] = []  # what each call made, in order
        self.builds: list[Any] = []  # BUILD targets, in order
        self.persids: list[Any] = []
        self.filled: list[tuple[str, _Made]] = []
        self._handlers: dict[tuple[str, str], Any] = {}

    # the handlers mapping: every global answers
    def get(self, key: tuple[str, str]) -> Any:
        handler = self._handlers.get(key)
        if handler is None:
            func = Global(*key)

            def handler(*args: Any) -> _Made:
                made = _Made(self, func, args)
                self.calls.append(made)
                return made
            self._handlers[key] = handler
        return handler

    def __bool__(self) -> bool:
        return True

    def persistent_load(self, pid: Any) -> Any:
        self.persids.append(pid)
        # a legacy torch.save of a whole module names each module class as a persistent id
        # ("module", cls, source file, source): torch's loader gives back the class
        if type(pid) is tuple and len(pid) == 4 and pid[0] in ("module", b"module") and \
                isinstance(pid[1], Global):
            return pid[1]
        return _Stored(pid)

    def build(self, target: Any, state: Any) -> None:
        self.builds.append(target)


_FAMILIES = {"call": _CALL_OPS, "new": _NEW_OPS, "build": frozenset((_BUILD,)),
             "persid": _PERSID_OPS, "append": _APPEND_OPS, "setitem": _SETITEM_OPS,
             "global": frozenset(b"c"), "stop": frozenset(b".")}
_FAMILY_OF = {code: tuple(f for f, codes in _FAMILIES.items() if code in codes)
              for code in set().union(*_FAMILIES.values())}


class _Spans:
    """The opcodes of a pickle, walked by their argument lengths: offsets and codes in two
    compact arrays (9 bytes an opcode: a pickle of one-byte opcodes must not cost more here
    than the interpreter's budget allows), and the offsets of the opcodes the scan places
    events at, by family (:data:`_FAMILIES`)."""

    def __init__(self, data: Any) -> None:
        self.offsets = array("q")
        self.codes = bytearray()
        self.error: str | None = None
        self.families: dict[str, list[int]] = {f: [] for f in _FAMILIES}
        family_of, families = _FAMILY_OF, self.families
        try:
            for at, code in opcode_spans(data):
                self.offsets.append(at)
                self.codes.append(code)
                for family in family_of.get(code, ()):
                    families[family].append(at)
        except ValueError as exc:
            self.error = str(exc)

    def cut(self, limit: int, *, inclusive: bool) -> None:
        """Keep the opcodes before ``limit`` (and the one at it, ``inclusive``)."""
        cut = bisect.bisect_right if inclusive else bisect.bisect_left
        keep = cut(self.offsets, limit)
        del self.offsets[keep:]
        del self.codes[keep:]
        for ats in self.families.values():
            del ats[cut(ats, limit):]

    def __iter__(self) -> Any:
        return zip(self.offsets, self.codes)

    def of(self, family: str) -> list[int]:
        """The offsets of the opcodes of ``family``, in order."""
        return self.families[family]

    def first_not_in(self, codes: frozenset[int]) -> int | None:
        """The offset of the first opcode not in ``codes``."""
        table = bytes(0 if c in codes else 1 for c in range(256))
        i = self.codes.translate(table).find(1)
        return None if i < 0 else self.offsets[i]


def _text_global(data: Any, at: int) -> tuple[str, str] | None:
    """The module and name of the GLOBAL or INST opcode at ``at`` (text arguments)."""
    chunk = bytes(data[at + 1:at + 1 + 8192])
    parts = chunk.split(b"\n", 2)
    if len(parts) < 3:
        return None
    try:
        return parts[0].decode("utf-8"), parts[1].decode("utf-8")
    except UnicodeDecodeError:
        return parts[0].decode("latin-1"), parts[1].decode("latin-1")


def _name(thing: Any) -> str:
    if isinstance(thing, _Made):
        return thing.qualname
    if isinstance(thing, Global):
        return f"{thing.module}.{thing.name}"
    return type(thing).__name__


def scan_pickle(data: Any, policy: Policy | None, *, impl: str | None = None) -> PickleFindings:
    """Interpret the pickle at the start of ``data`` inertly and record what it names, calls
    and builds (``impl``: the interpreter, as :func:`~ckptlab.format._unpickle.interpreter`
    picks it; default the one :mod:`ckptlab.format._pickle` uses)."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")
    spans = _Spans(view)
    scan = _Scan()
    run = interpreter(_pickle._IMPL if impl is None else impl)
    error = None
    error_at = None
    root = None
    end = None
    named: list[tuple[str, str, int]] = []
    try:
        result = run(view, handlers=scan, persistent_load=scan.persistent_load,
                     build=scan.build)
    except PickleDataError as exc:
        error, error_at = str(exc), failure_offset(exc)
        named = list(getattr(exc, "named", None) or [])
    except RecursionError:
        error, error_at = "objects nested too deeply", None
    else:
        root, end = result.root, result.end
        named = result.named
    lenient_stop = False
    if error is not None and error.startswith("STOP with") and error_at is not None:
        # the standard unpickler and torch's weights-only loop take the top of the stack and
        # ignore the rest: the pickle ends here for them (what it returns is not known here)
        end, error, lenient_stop = error_at + 1, None, True
    limit = end if end is not None else (error_at if error_at is not None else len(view))
    spans.cut(limit, inclusive=end is None)

    uses: dict[str, Use] = {}
    for module, name, at in named:
        uses[f"{module}.{name}"] = Use(module, name, at, {"name"})

    call_at = spans.of("call")
    new_at = set(spans.of("new"))
    code_calls = 0
    shown: list[tuple[Use, int, _Made]] = []  # the calls reported one by one
    per_use: dict[str, int] = {}  # how many of each global's calls are in it
    for k, made in enumerate(scan.calls):
        at = call_at[k] if k < len(call_at) else -1
        qualname = made.qualname
        use = uses.get(qualname)
        if use is None:  # (a handler key is canonical, as the interpreter's globals are)
            use = uses[qualname] = Use(made.func.module, made.func.name, at, {"name"})
        how = "new" if at in new_at else "call"
        if qualname in _RECONSTRUCTORS:
            how = "new"
            first = made.args[0] if made.args else None
            if isinstance(first, Global):
                target = uses.get(f"{first.module}.{first.name}")
                if target is not None:
                    target.hows.add("new")
        use.hows.add(how)
        use.ncalls += 1
        listed = per_use.get(qualname, 0)
        if listed < 1 or code_calls < MAX_CODE_CALLS:
            shown.append((use, at, made))
            per_use[qualname] = listed + 1
            code_calls += listed >= 1
    where = _paths_of(root, {id(made) for _, _, made in shown}) if root is not None else {}
    for use, at, made in shown:
        use.calls.append((at, render_args(made.args), where.get(id(made))))
    build_at = spans.of("build")
    for target in scan.builds:
        if isinstance(target, Global):
            use = uses.get(f"{target.module}.{target.name}")
            if use is not None:
                use.hows.add("build")

    # what ckptlab could not follow: what the rest of the pickle names and calls
    code_after: list[tuple[int, str]] = []
    if end is None and error_at is not None and error_at < len(view):
        if "not a global" in (error or ""):  # REDUCE of a call's result: getattr-style
            code_after.append((error_at, "<the result of another call, called>"))
        rest = _Spans(view[error_at:])
        for at, code in itertools.islice(rest, 1, None):
            if code in _GLOBAL_OPS:
                named = _text_global(view, error_at + at) if code != 0x93 else None
                code_after.append((error_at + at, f"{named[0]}.{named[1]}" if named else
                                   "<a global named on the stack (STACK_GLOBAL)>"))

    nested = []
    for k, made in enumerate(scan.calls):
        if made.qualname == "torch.storage._load_from_bytes" and made.args:
            value = _bytes_value(made.args[0])
            if value is not None:
                nested.append((call_at[k] if k < len(call_at) else -1, value))
    refusal, decided = _weights_only(view, spans, scan, policy, build_at, call_at, end,
                                     error, error_at, spans.error)
    return PickleFindings(end, root, uses, error, error_at, refusal, decided, code_after,
                          nested, lenient_stop)


def _key_text(key: Any) -> str:
    """A dict key as a path part: its text for a string or a number, else what it is."""
    if isinstance(key, OpaqueKey):
        key = key.value
    if isinstance(key, (str, int, float, bool)) or key is None:
        return str(key)
    return f"<{type(key).__name__} key>"


def _paths_of(root: Any, wanted: set[int], budget: int = MAX_WALK) -> dict[int, str]:
    """Where in the loaded object each object of ``wanted`` (ids of what calls made) sits: the
    keys from the root to the container entry holding it (a call nested in another call's
    arguments sits where the outer value does), "." joined; ``"<root>"`` for the root itself.
    Depth first, each object once, at most ``budget`` objects looked at; the ones not found
    are left out."""
    found: dict[int, str] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while stack and budget > 0 and len(found) < len(wanted):
        value, path = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        budget -= 1
        if id(value) in wanted:
            found[id(value)] = ".".join(path) if path else "<root>"
        children: list[tuple[Any, tuple[str, ...]]] = []
        if isinstance(value, dict):
            children = [(v, (*path, _key_text(k))) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            children = [(v, (*path, str(i))) for i, v in enumerate(value)]
        elif isinstance(value, Reduced):
            pairs = value.pairs or ()
            children = ([(v, (*path, _key_text(k))) for k, v in pairs]
                        + [(v, (*path, str(i))) for i, v in enumerate(value.items or ())]
                        + [(v, path) for v in (*value.args, value.state, value.kwargs)])
        elif isinstance(value, OpaqueKey):
            children = [(value.value, path)]
        stack.extend(reversed(children))  # (in order: the first key is looked at first)
    return found


def _bytes_value(value: Any) -> bytes | None:
    """The bytes a pickled bytes value stands for: bytes, or protocol 2's
    ``_codecs.encode(text, "latin1")`` worked out here (a pure string function)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, _Made) and value.qualname in ("_codecs.encode", "codecs.encode") \
            and len(value.args) == 2 and type(value.args[0]) is str and \
            value.args[1] in ("latin1", "latin-1", "iso-8859-1"):
        try:
            return value.args[0].encode("latin-1")
        except UnicodeEncodeError:
            return None
    return None


def _weights_only(view: Any, spans: _Spans, scan: _Scan, policy: Policy | None,
                  build_at: list[int], call_at: list[int], end: int | None, error: str | None,
                  error_at: int | None, span_error: str | None
                  ) -> tuple[Refusal | None, bool]:
    """Where torch's weights-only unpickler stops in this pickle (None: it reaches STOP), and
    whether that is decided (False: ckptlab could not follow the pickle that far)."""
    if policy is None:
        return None, False
    builds = dict(zip(build_at, scan.builds))
    persid_at = spans.of("persid")
    persids = dict(zip(persid_at, scan.persids))
    filled_from: dict[int, str] = {}
    # a call's result filled by APPEND/SETITEM: refused at the first such opcode after it
    made_at = {id(made): call_at[k] for k, made in enumerate(scan.calls)
               if k < len(call_at)}
    fill_at = {"append": spans.of("append"), "setitem": spans.of("setitem")}
    for kind, made in scan.filled:
        after = made_at.get(id(made), -1)
        ats = fill_at[kind]
        i = bisect.bisect_right(ats, after)
        if i == len(ats):
            continue
        at = ats[i]
        if kind == "append" or not policy.sets_items(policy_name(policy, made)):
            filled_from.setdefault(at, f"{kind.upper()} on {made.qualname}")
    # the opcodes where torch's loop could stop, in order: one pass over those, not over all
    events: list[tuple[int, int, Any]] = []
    bad = spans.first_not_in(policy.opcodes)
    if bad is not None:
        events.append((bad, 0, None))
    events += [(at, 1, None) for at in spans.of("global")]
    events += [(at, 2, target) for at, target in builds.items()]
    events += [(at, 3, pid) for at, pid in persids.items()]
    events += [(at, 4, what) for at, what in filled_from.items()]
    events += [(at, 5, None) for at in spans.of("stop")[:1]]
    events.sort(key=lambda e: (e[0], e[1]))
    for at, kind, value in events:
        if kind == 0:
            return policy.opcode(view[at], at), True
        if kind == 1:
            named = _text_global(view, at)
            if named is None:
                break
            refusal = policy.global_(named[0], named[1], at)
            if refusal is not None:
                return refusal, True
        elif kind == 2:
            if not (isinstance(value, _Made) and policy.builds(policy_name(policy, value))):
                return Refusal(at, f"BUILD of {_name(value)}",
                               f"Can only build Tensor, Parameter, OrderedDict or types "
                               f"allowlisted via `add_safe_globals`, but got {_name(value)}"), True
        elif kind == 3:
            if type(value) not in (tuple, int):
                return Refusal(at, "persistent id", "persistent_load id must be tuple or int"), True
            if type(value) is tuple and value and _ascii(value[0]) != "storage":
                return Refusal(at, "persistent id",
                               "Only persistent_load of storage is allowed"), True
        elif kind == 4:
            return Refusal(at, value, f"torch refuses {value}"), True
        else:
            return None, True
    if error is not None:
        where = error_at if error_at is not None else 0
        if span_error is not None or _fails_for_torch_too(error):
            return Refusal(where, "malformed pickle", f"the pickle is malformed at byte "
                                                        f"{where}: {error}"), True
        return Refusal(where, "not decided", f"ckptlab cannot follow the pickle past byte "
                                             f"{where}: {error}"), False
    return None, end is not None


def policy_name(policy: Policy, made: _Made) -> str:
    module, name = policy.mapped(made.func.module, made.func.name)
    return f"{module}.{name}"


def _ascii(value: Any) -> Any:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


# errors where the standard unpickler fails at the same opcode ckptlab's interpreter does
# (not "unsupported pickle protocol": torch's weights-only loop reads PROTO and goes on)
_SHARED_FAILURES = ("ends without a STOP", "declares", "never stored", "underflow",
                    "no newline", "unknown opcode", "not valid UTF-8", "MARK", "stack")


def _fails_for_torch_too(error: str) -> bool:
    return any(text in error for text in _SHARED_FAILURES)

