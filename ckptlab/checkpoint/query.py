"""One tensor query for every view: which tensors a search finds, in which order, which page.

Every surface that lists tensors asks this module: ``ckptlab inspect --filter/--sort``, the
notebook explorer (:func:`ckptlab.viz.query_tensors`), both pages of ``ckptlab serve`` (the
quick page's rows and the workbench's table) and the HTML report's search box (its JavaScript
follows the same rules; a test runs both). So one search gives the same rows everywhere.

The rules
---------
Pattern
    Surrounding ASCII whitespace is ignored; an empty pattern finds every tensor. A pattern
    holding ``*``, ``?`` or ``[`` is a *glob* matched against the whole name: ``*`` is any
    run of characters (dots included: ``*.mlp.*``), ``?`` one character, ``[abc]`` one of
    a set, ``[a-z]`` a range (a reversed range matches nothing), ``[!abc]`` one character
    not in the set; a ``]`` right after ``[`` or ``[!`` is in the set, a ``-`` at either end
    of the set is itself, and a ``[`` without a closing ``]`` is an ordinary character. Any
    other pattern finds the names that *contain* it (``mlp``, ``layers.3.``). Both are case
    insensitive: the name and the pattern are compared in lower case (``str.lower``;
    JavaScript's ``toLowerCase``).
Sort keys (:data:`SORT_KEYS`)
    ``order``, the default: the checkpoint's own order, ``Checkpoint.tensors``'s: the state
    dict's order for a torch.save file and a DCP directory (as saved), file then offset for a
    safetensors file and a Hugging Face directory (shards by name). ``name``: natural order
    (``h.2`` before ``h.10``; digit runs compare as numbers). ``size``: bytes in the files,
    largest first. ``parameters``: elements, largest first. ``offset``: file order (file
    path, then offset in it; tensors without bytes last). ``dtype``, ``kind``, ``file``:
    by that text. ``descending`` reverses a key's direction (``None``: the key's own, which is
    descending for ``size`` and ``parameters`` only). Ties keep the checkpoint's order in
    either direction.
Paging
    ``start`` and ``limit`` cut one page from the sorted matches; :class:`TensorSelection`
    also says how many tensors matched and how many there are.

Speed: a :class:`TensorCatalog` holds the columns as arrays and builds what queries need once
(the lower-cased names, each sort order, the last few results), so a query over 100,000
tensors is one C-level pass over the names (a compiled regular expression or ``in``) and
numpy for the rest: tens of milliseconds, a page from a kept result microseconds (the
natural name order costs about 0.3 s the first time it is asked for). The arrays a catalog
keeps and hands out are read-only.
"""

from __future__ import annotations

import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from ckptlab.errors import InvalidArgumentError
from ckptlab.format._bulk import fields

__all__ = ["DESCENDING_FIRST", "GLOB_CHARACTERS", "SORT_KEYS", "TensorCatalog", "TensorQuery",
           "TensorSelection", "glob_regex", "is_glob", "natural_key", "select_tensors"]

SORT_KEYS: tuple[str, ...] = ("order", "name", "size", "parameters", "offset", "dtype", "kind",
                              "file")
DESCENDING_FIRST = frozenset({"size", "parameters"})  # the largest first unless asked otherwise
GLOB_CHARACTERS = "*?["  # a pattern holding any of these is a glob
_BLANK = " \t\n\r\f\v"  # stripped from both ends of a pattern (JavaScript strips the same)
_ESCAPE = frozenset("\\^$.|?*+()[]{}")  # escaped outside a set: the same in Python and JS
_ESCAPE_IN_SET = frozenset("\\]^-[")
_HEX_IN_SET = frozenset("&~|")
_DIGITS = re.compile(r"(\d+)")
RECENT_RESULTS = 16  # full results a catalog keeps (a page of a kept result costs nothing)


def _clean(pattern: str) -> str:
    return pattern.strip(_BLANK)


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` is a glob (holds ``*``, ``?`` or ``[``) rather than a name part."""
    return any(c in pattern for c in GLOB_CHARACTERS)


def _set_regex(body: str) -> str:
    """A glob's set (between ``[`` and ``]``, without them) as a regular expression."""
    negate = body.startswith("!")
    if negate:
        body = body[1:]
    items, k = [], 0
    while k < len(body):
        a = body[k]
        if k + 2 < len(body) and body[k + 1] == "-":
            b = body[k + 2]
            if a <= b:  # a reversed range matches nothing
                items.append(_in_set(a) + "-" + _in_set(b))
            k += 3
        else:
            items.append(_in_set(a))
            k += 1
    if not items:
        return "." if negate else "(?!)"
    return "[" + "^" * negate + "".join(items) + "]"


def _in_set(c: str) -> str:
    if c in _ESCAPE_IN_SET:
        return "\\" + c
    if c in _HEX_IN_SET:  # "&&", "~~", "||" in a set read as set operations to Python's re
        return f"\\x{ord(c):02x}"
    return c


def _glob_pieces(pattern: str) -> list[str]:
    """Glob ``pattern`` as the regular expressions of its pieces between stars: ``a*b?``
    is ``["a", "b."]``, ``*x*`` is ``["", "x", ""]`` (a run of stars is one star)."""
    pieces: list[str] = []
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            pieces.append("".join(out))
            out = []
            while i < n and pattern[i] == "*":
                i += 1
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing ]: an ordinary [
                out.append("\\[")
            else:
                out.append(_set_regex(pattern[i:j]))
                i = j + 1
        else:
            out.append("\\" + c if c in _ESCAPE else c)
    pieces.append("".join(out))
    return pieces


def glob_regex(pattern: str) -> str:
    """The regular expression of glob ``pattern``, to be matched against a whole name with
    ``re.DOTALL`` (``*`` crosses dots and any character).

    The pattern is taken as it is (lower-case both it and the name for the query's case
    rule). ``*`` becomes ``.*``, ``?`` ``.``, a set a character class (see the module's
    rules); everything else matches itself.

    Examples
    --------
    >>> glob_regex("*.mlp.*")
    '.*\\\\.mlp\\\\..*'
    >>> glob_regex("h.[!0-4]")
    'h\\\\.[^0-4]'
    """
    return ".*".join(_glob_pieces(pattern))


def _compiled_glob(pattern: str) -> re.Pattern[str]:
    """``glob_regex(pattern)`` compiled for ``fullmatch``. With three stars or more, each
    ``*`` but the last is an atomic lazy run (as :func:`fnmatch.translate` makes), so that
    ``*a*a*a*b`` cannot backtrack for ever: each piece between stars has a fixed length, so
    its leftmost match is the one to take. Up to two stars stay greedy runs (``*.mlp.*``):
    at most quadratic in a name's length, and twice as fast as atomic runs."""
    pieces = _glob_pieces(pattern)
    if len(pieces) <= 3:
        return re.compile(".*".join(pieces), re.DOTALL)
    middle = "".join(f"(?>.*?{p})" for p in pieces[1:-1])
    return re.compile(f"{pieces[0]}{middle}.*{pieces[-1]}", re.DOTALL)


def natural_key(name: str) -> list[Any]:
    """``name``'s key in natural order: its digit runs compare as numbers (``h.2`` < ``h.10``).

    The key alternates text and numbers, text first, so any two keys compare.
    """
    parts: list[Any] = _DIGITS.split(name)
    parts[1::2] = map(int, parts[1::2])
    return parts


@dataclass(frozen=True, slots=True)
class TensorQuery:
    """A search of a checkpoint's tensors: which names, in which order, which page.

    The rules (glob or name part, case, sort keys, ties) are the module's
    (:mod:`ckptlab.checkpoint.query`).

    Parameters
    ----------
    pattern
        A name part (``mlp``) or a glob (``*.mlp.*``); "" finds every tensor. Stored without
        surrounding whitespace.
    sort
        One of :data:`SORT_KEYS`; ``"order"`` (the checkpoint's own) by default.
    descending
        Reverse the key's direction; None: the key's own (descending for ``size`` and
        ``parameters`` only).
    start
        Position, among the sorted matches, of the page's first tensor.
    limit
        The most tensors a page holds; None: all from ``start``.

    Raises
    ------
    InvalidArgumentError
        A field of the wrong type, an unknown sort key, a negative ``start`` or ``limit``.

    Examples
    --------
    >>> TensorQuery("*.MLP.*", sort="size", limit=20).apply(ck).rows  # doctest: +SKIP
    """

    pattern: str = ""
    sort: str = "order"
    descending: bool | None = None
    start: int = 0
    limit: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise InvalidArgumentError(
                f"pattern: expected text, got {type(self.pattern).__name__}")
        if self.sort not in SORT_KEYS:
            raise InvalidArgumentError(
                f"sort: expected one of {', '.join(SORT_KEYS)}, got {self.sort!r}")
        if self.descending is not None and not isinstance(self.descending, bool):
            raise InvalidArgumentError(
                f"descending: expected True, False or None, got {self.descending!r}")
        if type(self.start) is not int or self.start < 0:
            raise InvalidArgumentError(f"start: expected an integer >= 0, got {self.start!r}")
        if self.limit is not None and (type(self.limit) is not int or self.limit < 0):
            raise InvalidArgumentError(
                f"limit: expected an integer >= 0 or None, got {self.limit!r}")
        object.__setattr__(self, "pattern", _clean(self.pattern))

    @property
    def glob(self) -> bool:
        """Whether :attr:`pattern` is a glob (else a name part)."""
        return is_glob(self.pattern)

    @property
    def reverse(self) -> bool:
        """Whether the order is descending (:attr:`descending`, or the key's own)."""
        return self.sort in DESCENDING_FIRST if self.descending is None else self.descending

    def matches(self, name: str) -> bool:
        """Whether tensor ``name`` matches :attr:`pattern` (one name; a
        :class:`TensorCatalog` matches many at once)."""
        if not self.pattern:
            return True
        if self.glob:
            return _compiled_glob(self.pattern.lower()).fullmatch(name.lower()) is not None
        return self.pattern.lower() in name.lower()

    def apply(self, source: Any) -> TensorSelection:
        """:func:`select_tensors` of ``source`` with this query."""
        return select_tensors(source, self)


@dataclass(frozen=True, slots=True)
class TensorSelection:
    """One page of a query's answer.

    ``rows`` are positions in the source's own order (row ``i`` is its ``i``-th tensor), in
    the query's order, from its ``start``, at most ``limit`` of them.
    """

    query: TensorQuery
    rows: np.ndarray  # int64 positions of this page's tensors
    matched: int  # tensors whose name matches, over all pages
    total: int  # tensors in the source

    def __len__(self) -> int:
        return len(self.rows)

    def names(self, catalog: TensorCatalog) -> list[str]:
        """The page's tensor names (``catalog`` is the source the rows index)."""
        return [catalog.names[i] for i in self.rows.tolist()]


def _int_column(values: Any, n: int, what: str) -> np.ndarray | None:
    if values is None:
        return None
    column = np.asarray(values, dtype=np.int64).reshape(-1)
    if len(column) != n:
        raise InvalidArgumentError(f"{what}: expected {n} values (one per name), "
                                   f"got {len(column)}")
    return column


def _text_column(values: Any, n: int, what: str) -> tuple[str, ...] | None:
    if values is None:
        return None
    column = tuple(values)
    if len(column) != n:
        raise InvalidArgumentError(f"{what}: expected {n} values (one per name), "
                                   f"got {len(column)}")
    return column


def _text_ranks(values: Sequence[str]) -> np.ndarray:
    """Each value's rank among the distinct values in text order (equal values, one rank:
    a stable sort of the ranks keeps ties in row order). For columns of few distinct values."""
    rank = {v: r for r, v in enumerate(sorted(set(values)))}
    return np.fromiter(map(rank.__getitem__, values), dtype=np.int64, count=len(values))


def _natural_ranks(names: Sequence[str]) -> np.ndarray:
    """Each name's rank in natural order (:func:`natural_key`; ``h.02`` and ``h.2`` share
    one). One key and one sort of every name: about 0.3 s at 100,000 names, made once."""
    keys = list(map(natural_key, names))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    n = len(order)
    if not n:
        return np.zeros(0, dtype=np.int64)
    new = np.ones(n, dtype=bool)  # where the sorted keys change
    new[1:] = np.fromiter(map(operator.ne, map(keys.__getitem__, order[:-1]),
                              map(keys.__getitem__, order[1:])), dtype=bool, count=n - 1)
    ranks = np.empty(n, dtype=np.int64)
    ranks[np.array(order, dtype=np.int64)] = np.maximum.accumulate(
        np.where(new, np.arange(n, dtype=np.int64), 0))
    return ranks


class TensorCatalog:
    """The columns a query reads, one row per tensor in the checkpoint's order, and what
    queries build from them once (lower-cased names, sort orders, recent results).

    A cache, explicit and shared: one per opened checkpoint (the served app's sessions share
    theirs). Safe to use from several threads. Make one with :meth:`of` (a
    :class:`~ckptlab.checkpoint.Checkpoint`, a ``CheckpointIndex`` or a catalog) or from the
    columns themselves.

    Parameters
    ----------
    names
        The tensor names, in the checkpoint's order.
    nbytes, parameters
        Bytes in the files and elements per tensor (for the ``size`` and ``parameters``
        keys).
    files, offsets
        The file (relative path) and offset of each tensor's first byte; ``""`` and -1 for a
        tensor without bytes (for ``offset`` and ``file``).
    dtypes, kinds
        For the ``dtype`` and ``kind`` keys.

    A column left out (None) only makes its sort keys unavailable.
    """

    def __init__(self, names: Sequence[str], *, nbytes: Any = None, parameters: Any = None,
                 files: Sequence[str] | None = None, offsets: Any = None,
                 dtypes: Sequence[str] | None = None, kinds: Sequence[str] | None = None) -> None:
        self.names: tuple[str, ...] = tuple(names)
        n = len(self.names)
        self.nbytes = _int_column(nbytes, n, "nbytes")
        self.parameters = _int_column(parameters, n, "parameters")
        self.offsets = _int_column(offsets, n, "offsets")
        self.files = _text_column(files, n, "files")
        self.dtypes = _text_column(dtypes, n, "dtypes")
        self.kinds = _text_column(kinds, n, "kinds")
        self._lock = threading.Lock()
        self._lower: list[str] | None = None
        self._orders: dict[tuple[str, bool], np.ndarray] = {}
        self._recent: OrderedDict[tuple[str, str, bool], np.ndarray] = OrderedDict()

    @classmethod
    def of(cls, source: Any) -> TensorCatalog:
        """The catalog of a :class:`~ckptlab.checkpoint.Checkpoint`, of a
        :class:`~ckptlab.checkpoint._cache.CheckpointIndex`, or ``source`` itself.

        Raises
        ------
        InvalidArgumentError
            ``source`` is none of these.
        """
        from ckptlab.checkpoint._cache import CheckpointIndex
        from ckptlab.checkpoint.model import Checkpoint

        if isinstance(source, TensorCatalog):
            return source
        if isinstance(source, CheckpointIndex):
            paths = [f[0] for f in source.files]
            return cls(source.names, nbytes=source.nbytes, parameters=source.parameters,
                       files=[paths[i] if i >= 0 else "" for i in source.file],
                       offsets=source.offset, dtypes=source.dtypes, kinds=source.kinds)
        if isinstance(source, Checkpoint):
            entries = list(source.tensors.values())
            if not entries:
                return cls(())
            names, nbytes, params, files, offsets, dtypes, kinds = fields(
                entries, ("name", "nbytes", "parameters", "file", "offset", "dtype", "kind"))
            return cls(names, nbytes=nbytes, parameters=params, files=files,
                       offsets=[-1 if o is None else o for o in offsets], dtypes=dtypes,
                       kinds=kinds)
        raise InvalidArgumentError(f"expected a Checkpoint, a CheckpointIndex or a "
                                   f"TensorCatalog, got {type(source).__name__}")

    def __len__(self) -> int:
        return len(self.names)

    def _lowered(self) -> list[str]:
        lower = self._lower
        if lower is None:
            with self._lock:
                if self._lower is None:
                    self._lower = list(map(str.lower, self.names))
                lower = self._lower
        return lower

    def prepare(self) -> None:
        """Build what every search reads (the lower-cased names: 25 ms at 100,000 tensors)
        now, so that the first search costs only its own pass."""
        self._lowered()

    def matches(self, pattern: str) -> np.ndarray:
        """Positions (ascending) of the tensors whose name matches ``pattern`` (the module's
        rules: a glob over the whole name or a name part, case-insensitive)."""
        if not isinstance(pattern, str):
            raise InvalidArgumentError(f"pattern: expected text, got {type(pattern).__name__}")
        pattern = _clean(pattern)
        n = len(self.names)
        if not pattern:
            return np.arange(n, dtype=np.int64)
        lower = self._lowered()
        needle = pattern.lower()
        if is_glob(needle):
            found = map(bool, map(_compiled_glob(needle).fullmatch, lower))
        else:
            found = map(operator.contains, lower, repeat(needle))
        return np.flatnonzero(np.fromiter(found, dtype=bool, count=n))

    def _key_ranks(self, sort: str) -> np.ndarray:
        """Per-row ranks of sort key ``sort`` (equal keys, equal ranks)."""
        def need(column: Any, what: str) -> Any:
            if column is None:
                raise InvalidArgumentError(
                    f"sort: this table has no {what} column, so it cannot sort by {sort!r}")
            return column

        if sort == "order":
            return np.arange(len(self.names), dtype=np.int64)
        if sort == "name":
            return _natural_ranks(self.names)
        if sort == "size":
            return need(self.nbytes, "nbytes")
        if sort == "parameters":
            return need(self.parameters, "parameters")
        if sort == "offset":
            files = _text_ranks(need(self.files, "files"))
            offsets = need(self.offsets, "offsets")
            files = np.where(offsets < 0, len(self.names) + 1, files)  # without bytes: last
            order = np.lexsort((offsets, files))
            ranks = np.empty(len(order), dtype=np.int64)
            ranks[order] = np.arange(len(order), dtype=np.int64)
            return ranks
        column = {"dtype": self.dtypes, "kind": self.kinds, "file": self.files}[sort]
        return _text_ranks(need(column, sort + "s"))

    def order(self, sort: str = "order", descending: bool | None = None) -> np.ndarray:
        """Every row's position, sorted by key ``sort`` (:data:`SORT_KEYS`); ``descending``
        None is the key's own direction. Ties keep the checkpoint's order. Made once."""
        query = TensorQuery(sort=sort, descending=descending)
        key = (sort, query.reverse)
        order = self._orders.get(key)
        if order is None:
            ranks = self._key_ranks(sort)
            order = np.argsort(-ranks if query.reverse else ranks, kind="stable")
            order = order.astype(np.int64, copy=False)
            order.setflags(write=False)  # kept and handed out: nobody changes it
            with self._lock:
                self._orders[key] = order
        return order

    def _matches_in_order(self, query: TensorQuery) -> np.ndarray:
        key = (query.pattern, query.sort, query.reverse)
        with self._lock:
            found = self._recent.get(key)
            if found is not None:
                self._recent.move_to_end(key)
                return found
        hits = self.matches(query.pattern)
        if query.sort == "order" and not query.reverse:
            found = hits
        else:
            order = self.order(query.sort, query.reverse)
            if len(hits) == len(self.names):
                found = order
            else:
                mask = np.zeros(len(self.names), dtype=bool)
                mask[hits] = True
                found = order[mask[order]]
        found.setflags(write=False)
        with self._lock:
            self._recent[key] = found
            while len(self._recent) > RECENT_RESULTS:
                self._recent.popitem(last=False)
        return found

    def select(self, query: TensorQuery) -> TensorSelection:
        """The page of ``query``'s answer (see :func:`select_tensors`)."""
        if not isinstance(query, TensorQuery):
            raise InvalidArgumentError(f"query: expected a TensorQuery, "
                                       f"got {type(query).__name__}")
        found = self._matches_in_order(query)
        stop = None if query.limit is None else query.start + query.limit
        return TensorSelection(query, found[query.start:stop], len(found), len(self.names))


def select_tensors(source: Any, query: TensorQuery | str = "") -> TensorSelection:
    """The tensors of ``source`` that ``query`` finds, in its order, one page of them.

    This is the one tensor query of ckptlab: the CLI, the notebook explorer, the served app's
    pages and the report all call it (see the module's rules).

    Parameters
    ----------
    source
        A :class:`TensorCatalog` (keep one per checkpoint to reuse what queries build), a
        :class:`~ckptlab.checkpoint.Checkpoint` or a ``CheckpointIndex``.
    query
        A :class:`TensorQuery`, or a pattern (every match, in the checkpoint's order).

    Returns
    -------
    TensorSelection
        ``rows``: positions in ``source``'s order; ``matched`` and ``total`` counts.

    Examples
    --------
    >>> ck = ckptlab.open("model.safetensors")  # doctest: +SKIP
    >>> sel = select_tensors(ck, TensorQuery("mlp", sort="size", limit=10))  # doctest: +SKIP
    >>> [list(ck.tensors)[i] for i in sel.rows]  # doctest: +SKIP
    """
    if isinstance(query, str):
        query = TensorQuery(query)
    return TensorCatalog.of(source).select(query)
