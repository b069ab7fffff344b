"""Tensor-first views of any checkpoint: the tensor table, the module tree, totals by dtype.

Users arrive with a model, not a zip record: these views start from the tensors of a
:class:`~ckptlab.checkpoint.Checkpoint` (``ckptlab.open``; any format) or of an
:class:`~ckptlab.format.ArchiveLayout` (a predicted layout has tensors too). The data functions
(:func:`tensor_table`, :func:`query_tensors`, :func:`module_tree`, :func:`dtype_totals`,
:func:`checkpoint_summary`) are pure and plotly-free, for the notebook widgets, the served
app, the report and the CLI alike; the ``*_figure`` functions draw them.

A :class:`TensorTable` holds one column per field (numpy arrays for the numbers), and its
:attr:`TensorTable.catalog` answers searches and sorts with the one tensor query of
:mod:`ckptlab.checkpoint.query` (the CLI's, the served app's and the report's too): over
100,000 tensors well under the 200 ms a search box may take; a view shows one page of it.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ckptlab._words import plural
from ckptlab.checkpoint.model import is_checkpoint
from ckptlab.checkpoint.query import SORT_KEYS, TensorCatalog, TensorQuery
from ckptlab.errors import InvalidArgumentError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import ArchiveLayout
from ckptlab.viz._style import PALETTE, TABLE_CSS, human_nbytes, plain_text, style_figure

# the treemap's levels drawn at once (deeper ones open on a click) and its colours: light for
# small prefixes, dark for large (text stays readable on both: plotly picks its colour)
TREEMAP_DEPTH = 7
TREEMAP_SCALE = [[0.0, "#c6dbef"], [0.5, "#4292c6"], [1.0, "#08306b"]]

__all__ = [
    "SORT_KEYS",
    "DtypeTotal",
    "ModuleNode",
    "TensorTable",
    "checkpoint_summary",
    "dtype_figure",
    "dtype_totals",
    "filter_tensors",
    "module_tree",
    "object_rows",
    "query_tensors",
    "sort_tensors",
    "tensor_parts",
    "tensor_table",
    "tensor_table_html",
    "treemap_figure",
]



def _shape_text(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "?"
    return "x".join("j" if d < 0 else str(d) for d in shape) or "scalar"


@dataclass(frozen=True, eq=False)
class TensorTable:
    """The tensors of a checkpoint as columns, in the checkpoint's own order.

    ``offsets`` is -1 for a tensor without bytes; ``files`` is "" for a single-file layout.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[str, ...]  # "64x32", "scalar", "?" (unknown), "j" for a ragged dimension
    kinds: tuple[str, ...]  # dense | sparse | quantized | nested | subclass
    nbytes: np.ndarray  # int64: bytes of the tensor's parts in their files
    parameters: np.ndarray  # int64: elements of the stored values
    files: tuple[str, ...]  # the file of the first part
    offsets: np.ndarray  # int64: file offset of the first part (-1: no bytes)
    parts: tuple[int, ...]  # number of parts
    tied: np.ndarray | None = None  # bool: the tensor is another's bytes (Checkpoint.tied)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def catalog(self) -> TensorCatalog:
        """The table's columns for the one tensor query (made on first use, then kept)."""
        catalog = self.__dict__.get("_catalog")
        if catalog is None:
            catalog = TensorCatalog(self.names, nbytes=self.nbytes, parameters=self.parameters,
                                    files=self.files, offsets=self.offsets, dtypes=self.dtypes,
                                    kinds=self.kinds)
            object.__setattr__(self, "_catalog", catalog)  # a memo of frozen data
        return catalog

    @property
    def own(self) -> np.ndarray:
        """bool: the tensors that are not another's bytes (the ones totals count)."""
        return np.ones(len(self.names), dtype=bool) if self.tied is None else ~self.tied

    @property
    def total_nbytes(self) -> int:
        """Bytes of the tensors, a tied tensor's once."""
        return int(self.nbytes[self.own].sum())

    @property
    def total_parameters(self) -> int:
        """Parameters of the tensors, a tied tensor's once."""
        return int(self.parameters[self.own].sum())

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as a dict: name, dtype, shape, kind, nbytes, parameters, file, offset."""
        offset = int(self.offsets[i])
        return {"name": self.names[i], "dtype": self.dtypes[i], "shape": self.shapes[i],
                "kind": self.kinds[i], "nbytes": int(self.nbytes[i]),
                "parameters": int(self.parameters[i]), "file": self.files[i],
                "offset": None if offset < 0 else offset, "parts": self.parts[i]}

    def rows(self, indices: Iterable[int]) -> list[dict[str, Any]]:
        return [self.row(int(i)) for i in indices]

    def index(self, name: str) -> int:
        """Position of tensor ``name``."""
        cache = self.__dict__.get("_positions")
        if cache is None:
            cache = {n: i for i, n in enumerate(self.names)}
            object.__setattr__(self, "_positions", cache)  # a memo of frozen data
        try:
            return cache[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r}") from None


def tensor_table(source: Any) -> TensorTable:
    """The tensor table of a :class:`~ckptlab.checkpoint.Checkpoint` or an
    :class:`~ckptlab.format.ArchiveLayout` (one pass over the tensors).

    Raises
    ------
    InvalidArgumentError
        ``source`` is neither.
    """
    if isinstance(source, TensorTable):
        return source
    if is_checkpoint(source):
        ts = list(source.tensors.values())
        names = tuple(t.name for t in ts)
        offsets = [t.parts[0].offset if t.parts else -1 for t in ts]
        tied = source.tied() if hasattr(source, "tied") else {}
        return TensorTable(
            names, tuple(t.dtype for t in ts), tuple(_shape_text(t.shape) for t in ts),
            tuple(t.kind for t in ts),
            np.fromiter((t.nbytes for t in ts), dtype=np.int64, count=len(ts)),
            np.fromiter((t.parameters for t in ts), dtype=np.int64, count=len(ts)),
            tuple(t.parts[0].file if t.parts else "" for t in ts),
            np.array(offsets, dtype=np.int64), tuple(len(t.parts) for t in ts),
            np.fromiter((n in tied for n in names), dtype=bool, count=len(ts))
            if tied else None)
    if isinstance(source, ArchiveLayout):
        storages = {s.key: s for s in source.storages}
        names_l, nbytes, offsets = [], [], []
        for t in source.tensors:
            names_l.append(".".join(map(str, t.path)))
            size = DTYPE_ITEMSIZE.get(t.dtype, 1)
            span = 0 if t.numel == 0 else (
                sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=False)) + 1) * size
            nbytes.append(span)
            s = storages.get(t.storage_key)
            offsets.append(-1 if s is None else s.data_offset + t.storage_offset * size)
        n = len(names_l)
        return TensorTable(
            tuple(names_l), tuple(t.dtype for t in source.tensors),
            tuple(_shape_text(t.shape) for t in source.tensors), ("dense",) * n,
            np.array(nbytes, dtype=np.int64),
            np.array([t.numel for t in source.tensors], dtype=np.int64),
            ("",) * n, np.array(offsets, dtype=np.int64), (1,) * n)
    raise InvalidArgumentError(
        f"expected a Checkpoint (ckptlab.open) or an ArchiveLayout, got {type(source).__name__}")


def filter_tensors(table: TensorTable, pattern: str = "") -> np.ndarray:
    """Indices of the tensors whose name matches ``pattern``, in table order: a glob over the
    whole name when it holds ``*``, ``?`` or ``[``, else a name part; case-insensitive (the
    rules of :mod:`ckptlab.checkpoint.query`). An empty pattern keeps every tensor."""
    return table.catalog.matches(pattern)


def sort_tensors(table: TensorTable, indices: np.ndarray | None = None, by: str = "order",
                 descending: bool | None = None) -> np.ndarray:
    """``indices`` (all tensors by default) ordered by key ``by``, one of :data:`SORT_KEYS`
    (:mod:`ckptlab.checkpoint.query`: ``size`` and ``parameters`` the largest first unless
    ``descending=False``; ties keep table order)."""
    order = table.catalog.order(by, descending)
    if indices is None:
        return order
    keep = np.zeros(len(table), dtype=bool)
    keep[np.asarray(indices, dtype=np.int64)] = True
    return order[keep[order]]


def query_tensors(table: TensorTable, pattern: str = "", sort: str = "order",
                  descending: bool | None = None) -> np.ndarray:
    """The indices a table view shows: the one tensor query
    (:func:`ckptlab.checkpoint.query.select_tensors`) of ``pattern`` in ``sort`` order."""
    return table.catalog.select(TensorQuery(pattern, sort, descending)).rows


@dataclass(frozen=True, slots=True)
class DtypeTotal:
    """Tensors, parameters and bytes of one dtype."""

    dtype: str
    tensors: int
    parameters: int
    nbytes: int


def dtype_totals(source: Any) -> list[DtypeTotal]:
    """Totals per dtype, the most bytes first (sums of the table's columns; a tied tensor
    counts as a tensor, its bytes and parameters once)."""
    table = tensor_table(source)
    acc: dict[str, list[int]] = {}
    for dt, n, p, own in zip(table.dtypes, table.nbytes.tolist(), table.parameters.tolist(),
                             table.own.tolist(), strict=True):
        row = acc.setdefault(dt, [0, 0, 0])
        row[0] += 1
        row[1] += p * own
        row[2] += n * own
    return sorted((DtypeTotal(d, *v) for d, v in acc.items()), key=lambda t: (-t.nbytes, t.dtype))


@dataclass(frozen=True, slots=True)
class ModuleNode:
    """One name prefix (``model.layers.3.mlp``) with the totals of the tensors under it."""

    prefix: str  # "" for the root
    parent: str | None  # None for the root
    depth: int  # 0 for the root
    tensors: int
    parameters: int
    nbytes: int
    leaf: bool  # a tensor's own name (no tensor below it)


def module_tree(source: Any, *, max_depth: int | None = None) -> list[ModuleNode]:
    """Totals of bytes and parameters by name prefix, parents before their children.

    Names split at ``.``; ``model.layers.3.mlp.weight`` adds to ``model``, ``model.layers``,
    ``model.layers.3``, ``model.layers.3.mlp`` and to its own leaf. ``max_depth`` stops the
    tree at that many components (deeper tensors count in their ancestor at that depth).
    The root (``""``) holds every tensor, so its totals equal the table's.
    """
    if max_depth is not None and (type(max_depth) is not int or max_depth < 1):
        raise InvalidArgumentError(f"max_depth must be an int >= 1 or None, got {max_depth!r}")
    tree = _Tree(tensor_table(source), max_depth)
    return [tree.node(i) for i in range(len(tree.keys))]


class _Tree:
    """The prefix tree as parallel lists, sorted by depth then prefix (so the children of a
    prefix at the next depth are one contiguous, bisectable range). ModuleNodes are made
    only for the nodes asked for: a treemap of 100,000 tensors keeps 1,500."""

    def __init__(self, table: TensorTable, max_depth: int | None) -> None:
        names = table.names
        if max_depth is not None:
            names = tuple(n if n.count(".") < max_depth else ".".join(n.split(".")[:max_depth])
                          for n in names)
        n = len(names)
        vals = (np.stack([np.ones(n, dtype=np.int64), table.parameters.astype(np.int64),
                          table.nbytes.astype(np.int64)], axis=1) if n
                else np.zeros((0, 3), np.int64))
        # leaves first, then one level up at a time, each level grouped by numpy (a sort
        # and sums): 100,000 names cost a few vectorised passes
        keys, sums = _group(np.array(names, dtype=object), vals)
        all_keys, all_sums, parents_seen = [], [], []
        while len(keys):
            all_keys.append(keys)
            all_sums.append(sums)
            up = keys != ""
            parents = np.array([k.rpartition(".")[0] for k in keys[up].tolist()], dtype=object)
            parents_seen.append(parents)
            keys, sums = _group(parents, sums[up])
        if all_keys:
            keys, sums = _group(np.concatenate(all_keys), np.concatenate(all_sums))
        if not len(keys) or keys[0] != "":  # an empty checkpoint: the root alone
            keys = np.concatenate([np.array([""], dtype=object), keys])
            sums = np.concatenate([np.zeros((1, 3), dtype=np.int64), sums])
        self.has_child = set(np.concatenate(parents_seen).tolist()) if parents_seen else set()
        key_list = keys.tolist()
        depth = np.array([k.count(".") + 1 if k else 0 for k in key_list], dtype=np.int64)
        order = np.argsort(depth, kind="stable")  # keys were sorted: depth, then prefix
        self.keys: list[str] = [key_list[i] for i in order.tolist()]
        self.depth: list[int] = depth[order].tolist()
        self.sums = sums[order]
        self.level_start = {d: i for i, d in reversed(list(enumerate(self.depth)))}
        self.level_end = {d: i + 1 for i, d in enumerate(self.depth)}
        self.max_depth = self.depth[-1] if self.depth else 0

    def node(self, i: int) -> ModuleNode:
        key = self.keys[i]
        t, p, b = self.sums[i].tolist()
        return ModuleNode(key, None if not key else key.rpartition(".")[0], self.depth[i],
                          t, p, b, key not in self.has_child)

    def under(self, i: int, depth: int) -> range:
        """Indices of the nodes at ``depth`` below node ``i``."""
        import bisect

        lo, hi = self.level_start.get(depth), self.level_end.get(depth)
        if lo is None or hi is None:
            return range(0)
        key = self.keys[i]
        if not key:
            return range(lo, hi)
        first = bisect.bisect_left(self.keys, key + ".", lo, hi)
        last = bisect.bisect_left(self.keys, key + "/", lo, hi)  # "/" follows "."
        return range(first, last)

    def descendants(self, i: int) -> int:
        return sum(len(self.under(i, d)) for d in range(self.depth[i] + 1, self.max_depth + 1))


def _group(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``keys`` (sorted) and the column sums of ``vals`` for each."""
    if not len(keys):
        return keys, vals
    uniq, inverse = np.unique(keys, return_inverse=True)
    out = np.zeros((len(uniq), vals.shape[1]), dtype=np.int64)
    np.add.at(out, inverse.ravel(), vals)
    return uniq, out


def object_rows(checkpoint: Any, *, limit: int = 200) -> list[tuple[str, str]]:
    """The checkpoint's non-tensor values (step, lr, config) as ``(name, text)`` rows,
    each text cut at 200 characters; at most ``limit`` rows."""
    import json

    rows = []
    for name, value in list(getattr(checkpoint, "objects", {}).items())[:limit]:
        try:
            text = json.dumps(value, default=str, ensure_ascii=False)
        except (TypeError, ValueError):
            text = repr(value)
        rows.append((str(name), text if len(text) <= 200 else text[:200] + "…"))
    return rows


def tensor_parts(source: Any, name: str, file: str | None = None) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of tensor ``name``'s parts (in ``file`` when given): what a byte
    map outlines when the tensor is selected."""
    if is_checkpoint(source):
        entry = source.tensors.get(name)
        if entry is None:
            raise KeyError(f"no tensor {name!r}")
        return [(p.offset, p.nbytes) for p in entry.parts if file is None or p.file == file]
    table = tensor_table(source)
    i = table.index(name)
    off = int(table.offsets[i])
    return [] if off < 0 else [(off, int(table.nbytes[i]))]


def checkpoint_summary(source: Any) -> dict[str, Any]:
    """What a view says first: format, path, files, tensors, parameters, bytes, by dtype."""
    table = tensor_table(source)
    if is_checkpoint(source):
        fmt, path, files, nbytes = (source.format, source.path, len(source.files),
                                    int(source.nbytes))
        objects = len(getattr(source, "objects", {}))
    else:
        fmt, path, files, nbytes, objects = (source.format, source.path, 1,
                                             int(source.file_nbytes), len(source.objects))
    return {"format": fmt, "path": path, "files": files, "nbytes": nbytes,
            "tensors": len(table), "parameters": table.total_parameters,
            "tensor_nbytes": table.total_nbytes, "objects": objects,
            "dtypes": [{"dtype": d.dtype, "tensors": d.tensors, "parameters": d.parameters,
                        "nbytes": d.nbytes} for d in dtype_totals(table)]}


_VERDICT_COLOURS = {"weights-only": "#1b7f3b", "data": "#9a6700", "code": "#c62828",
                    "unreadable": "#555"}


def safety_html(report: Any) -> str:
    """Is it safe to load? A badge with the verdict and its one line, then the code calls
    (``report``: a :class:`~ckptlab.safety.SafetyReport`); every text escaped."""
    verdict = report.verdict
    colour = _VERDICT_COLOURS.get(verdict, "#555")
    headline = report.headline().split(": ", 1)[-1]
    badge = (f'<span class="ckptlab-verdict ckptlab-verdict-{html.escape(verdict)}" '
             f'style="background:{colour};color:#fff;border-radius:4px;padding:1px 8px;'
             f'font-weight:600;font-size:12px">{html.escape(verdict.upper())}</span>')
    out = [f'<div class="ckptlab-safety" style="margin:4px 0">{badge} '
           f'<span style="font-size:13px">safe to load? {html.escape(headline)}</span></div>']
    calls = [c for f in report.files for c in f.code_calls]
    if calls:
        rows = "".join(
            f"<li><code>{html.escape(c.global_)}({html.escape(c.args or '')})</code> · "
            f"{html.escape(c.pickle)}, byte {c.offset:,} · {html.escape(c.why)}</li>"
            for c in calls[:20])
        more = f"<li>… {len(calls) - 20:,} more</li>" if len(calls) > 20 else ""
        out.append(f'<ul class="ckptlab-safety-code" style="font-size:12px;margin:2px 0">'
                   f"{rows}{more}</ul>")
    return "".join(out)


def safety_badge(source: Any) -> str:
    """:func:`safety_html` of :func:`ckptlab.scan` of ``source`` (a path, a ``Checkpoint``),
    or a line saying why there is none: what the report, the app and the explorer show."""
    from ckptlab.errors import CkptlabError
    from ckptlab.safety import scan

    try:
        report = scan(source)
    except CkptlabError as exc:
        return f'<p class="note">Not scanned for code: {html.escape(str(exc))}</p>'
    return safety_html(report)


def summary_html(source: Any) -> str:
    """The summary as a short HTML block: one line, then a table of totals by dtype."""
    s = checkpoint_summary(source)
    name = html.escape(str(s["path"]).rstrip("/").rsplit("/", 1)[-1] or str(s["path"]))
    head = (f'<div class="ckptlab-summary"><b>{name}</b> · {html.escape(s["format"])} · '
            f"{s['files']} file{'s' * (s['files'] != 1)} · {human_nbytes(s['nbytes'])} · "
            f"<b>{s['tensors']:,}</b> tensors · <b>{s['parameters']:,}</b> parameters · "
            f"{human_nbytes(s['tensor_nbytes'])} of tensors"
            + (f" · {s['objects']} other values" if s["objects"] else "") + "</div>")
    rows = "".join(
        f"<tr><td>{html.escape(d['dtype'])}</td><td style='text-align:right'>{d['tensors']:,}"
        f"</td><td style='text-align:right'>{d['parameters']:,}</td>"
        f"<td style='text-align:right'>{human_nbytes(d['nbytes'])}</td></tr>"
        for d in s["dtypes"])
    return (head + TABLE_CSS + '<table class="ckptlab-table ckptlab-dtypes" style="border-collapse:'
            'collapse;font-size:12px"><thead><tr><th>dtype</th><th>tensors</th>'
            f"<th>parameters</th><th>bytes</th></tr></thead><tbody>{rows}</tbody></table>")


TABLE_COLUMNS = ("name", "dtype", "shape", "kind", "bytes", "parameters", "file", "offset")


def tensor_table_html(table: TensorTable, indices: Sequence[int] | np.ndarray | None = None, *,
                      limit: int = 500, css_class: str = "ckptlab-tensors",
                      show_file: bool = True) -> str:
    """An HTML table of rows ``indices`` (all by default), at most ``limit``, every cell
    escaped; a note says how many rows are not shown."""
    idx = np.arange(len(table)) if indices is None else np.asarray(indices, dtype=np.int64)
    shown = idx[:limit]
    cols = [c for c in TABLE_COLUMNS if show_file or c != "file"]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = []
    for i in shown.tolist():
        r = table.row(i)
        cells = {"name": html.escape(r["name"]), "dtype": html.escape(r["dtype"]),
                 "shape": html.escape(r["shape"]), "kind": html.escape(r["kind"]),
                 "bytes": f"{r['nbytes']:,}", "parameters": f"{r['parameters']:,}",
                 "file": html.escape(r["file"]),
                 "offset": "—" if r["offset"] is None else f"{r['offset']:,}"}
        body.append("<tr>" + "".join(
            f'<td class="num">{cells[c]}</td>' if c in ("bytes", "parameters", "offset")
            else f"<td>{cells[c]}</td>" for c in cols) + "</tr>")
    more = len(idx) - len(shown)
    note = (f'<p class="note ckptlab-hidden-rows">{len(shown):,} of {len(idx):,} rows shown; '
            f"{more:,} hidden.</p>" if more > 0 else "")
    return (TABLE_CSS + f'<table class="{css_class}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>{note}")


def treemap_figure(source: Any, *, max_nodes: int = 1500, theme: str | None = None
                   ) -> go.Figure:
    """Bytes by name prefix as a treemap (``model`` → ``model.layers`` → ...).

    Parameters
    ----------
    source
        A :class:`~ckptlab.checkpoint.Checkpoint`, an :class:`~ckptlab.format.ArchiveLayout` or a
        :class:`TensorTable`.
    max_nodes
        At most this many boxes: the largest prefixes are opened first, and where a prefix
        has more children than fit, its smallest ones are folded into one "… N more" box (a
        browser draws 100,000 rectangles slowly and nobody reads them).
    theme
        ``"light"``, ``"dark"`` or None for the notebook's.

    Returns
    -------
    plotly.graph_objects.Figure
        One treemap trace; ``fig.layout.meta`` has ``kind="treemap"``, ``nodes``, ``folded``
        (tree nodes drawn inside an "… N more" box instead of their own) and ``nbytes`` (the
        root's total, the sum of the tensors' bytes).
    """
    if type(max_nodes) is not int or max_nodes < 2:
        raise InvalidArgumentError(f"max_nodes must be an int >= 2, got {max_nodes!r}")
    table = tensor_table(source)
    nodes, folded = _largest_subtree(_Tree(table, None), max_nodes)
    root_label = "all tensors"
    # ids are escaped like every name (an injective mapping, so they stay unique)
    ids = [plain_text(n.prefix) if n.prefix else "ckptlab:all" for n in nodes]
    parents = ["" if n.parent is None else (plain_text(n.parent) if n.parent else "ckptlab:all")
               for n in nodes]
    labels = [plain_text(root_label if not n.prefix else n.prefix.rsplit(".", 1)[-1])
              for n in nodes]
    # colour by bytes (log scale: a layer norm next to an embedding still shows), so that
    # siblings of one parent differ; every level of the tree is drawn (up to TREEMAP_DEPTH)
    nbytes = np.array([n.nbytes for n in nodes], dtype=np.float64)
    shade = np.log2(np.maximum(nbytes, 1.0))
    low, top = (float(shade.min()), float(shade.max())) if len(shade) else (0.0, 1.0)
    top = max(top, low + 1.0)
    # ticks at whole units (1 KiB, 1 MiB...) inside the range, else the range's ends
    ticks = [10.0 * k for k in range(7) if low <= 10.0 * k <= top] or [low, top]
    fig = go.Figure(go.Treemap(
        ids=ids, parents=parents, labels=labels, values=nbytes.astype(np.int64).tolist(),
        branchvalues="total",
        customdata=[[plain_text(n.prefix or root_label), n.tensors, n.parameters,
                     human_nbytes(n.nbytes)] for n in nodes],
        hovertemplate=("<b>%{customdata[0]}</b><br>%{customdata[3]} in %{customdata[1]:,} "
                       "tensors · %{customdata[2]:,} parameters<extra></extra>"),
        marker={"colors": shade.tolist(), "colorscale": TREEMAP_SCALE, "cmin": low,
                "cmax": top, "showscale": True,
                "colorbar": {"title": {"text": "bytes"}, "tickvals": ticks, "thickness": 12,
                             "ticktext": [human_nbytes(round(2 ** t)) for t in ticks]}},
        maxdepth=min(max(n.depth for n in nodes) + 1, TREEMAP_DEPTH) if nodes else 2,
        tiling={"pad": 2}))
    fig.update_layout(
        title=f"Bytes by module · {plural(len(table), 'tensor')} · "
              f"{human_nbytes(table.total_nbytes)}"
              + (f" · {folded:,} small names folded" if folded else ""),
        height=520, margin={"l": 10, "r": 10, "t": 76, "b": 10},
        meta={"kind": "treemap", "folded": folded, "nodes": len(nodes),
              "nbytes": int(nodes[0].nbytes) if nodes else 0})
    return style_figure(fig, theme=theme)


def _largest_subtree(tree: _Tree, max_nodes: int) -> tuple[list[ModuleNode], int]:
    """At most ``max_nodes`` nodes of ``tree``, opening the largest prefixes first; the
    children that do not fit fold into one "… N more" node per parent. Returns the nodes
    (parents first) and how many tree nodes were folded."""
    import heapq

    if len(tree.keys) <= max_nodes:
        return [tree.node(i) for i in range(len(tree.keys))], 0
    nbytes = tree.sums[:, 2]
    keep = [tree.node(0)]
    budget = max_nodes - 1
    heap: list[tuple[int, str, int]] = [(-int(nbytes[0]), tree.keys[0], 0)]
    folded = 0
    while heap and budget > 0:
        _, _, i = heapq.heappop(heap)
        kids = sorted(tree.under(i, tree.depth[i] + 1),
                      key=lambda j: (-int(nbytes[j]), tree.keys[j]))
        if not kids:
            continue
        take = kids if len(kids) <= budget else kids[:budget - 1]
        rest = kids[len(take):]
        for j in take:
            keep.append(tree.node(j))
            heapq.heappush(heap, (-int(nbytes[j]), tree.keys[j], j))
        budget -= len(take)
        if rest:
            folded += sum(1 + tree.descendants(j) for j in rest)
            t, p, b = tree.sums[rest].sum(axis=0).tolist()
            key = tree.keys[i]
            keep.append(ModuleNode(f"{key}.… {len(rest):,} more" if key else
                                   f"… {len(rest):,} more", key, tree.depth[i] + 1,
                                   t, p, b, True))
            budget -= 1
    for _, _, i in heap:  # opened no further: its subtree is inside it
        folded += tree.descendants(i)
    return keep, folded


def dtype_figure(source: Any, *, theme: str | None = None) -> go.Figure:
    """Bytes per dtype (bars) with tensors and parameters in the hover."""
    totals = dtype_totals(source)
    fig = go.Figure(go.Bar(
        x=[t.nbytes for t in totals], y=[plain_text(t.dtype) for t in totals], orientation="h",
        marker={"color": [PALETTE[i % len(PALETTE)] for i in range(len(totals))]},
        customdata=[[t.tensors, t.parameters, human_nbytes(t.nbytes)] for t in totals],
        hovertemplate=("%{y}: %{customdata[2]} · %{customdata[0]:,} tensors · "
                       "%{customdata[1]:,} parameters<extra></extra>")))
    fig.update_layout(
        title="Bytes by dtype", xaxis={"title": "bytes", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True},
        height=max(200, 130 + 26 * len(totals)), margin={"l": 20, "r": 20, "t": 76, "b": 45},
        meta={"kind": "dtypes", "dtypes": [t.dtype for t in totals],
              "nbytes": [t.nbytes for t in totals],
              "parameters": [t.parameters for t in totals]})
    return style_figure(fig, theme=theme)
