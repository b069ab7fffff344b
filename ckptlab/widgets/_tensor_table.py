"""The served app's tensor table: a searchable, sortable table that stays fast at 100k rows.

The rows live on the server as one pandas DataFrame shared by every session
(:func:`tensor_frame`); panel's ``Tabulator`` with ``pagination="remote"`` sends the browser
one page at a time, and the name filter and the sort run on the server with the one tensor
query (:class:`~ckptlab.checkpoint.query.TensorCatalog`, shared with the quick page: tens of
milliseconds over 100,000 names), so the browser never holds more than a page of rows and
finds what the CLI, the quick page and the report find.

At 1280 px every header shows whole (:data:`COLUMN_WIDTHS`; ``name`` takes what is left, the
``file`` column is sized to its longest name); a value wider than its column ends in an
ellipsis and shows whole in its tooltip. In a narrower window the name keeps
:data:`NAME_MIN_WIDTH` and the least needed columns are hidden (:func:`responsive_columns`). Panel's remote pagination maps rows lazily
(:class:`LazyRowsTabulator`): a session's table costs no pass over the 100,000 rows.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import panel as pn

from ckptlab._words import plural
from ckptlab.checkpoint._cache import CheckpointIndex
from ckptlab.checkpoint.query import TensorCatalog
from ckptlab.viz._style import html_table, human_nbytes
from ckptlab.widgets._compat import TabulatorHooks
from ckptlab.widgets._table_rows import COLUMNS, SORT_KEY_OF_COLUMN, tensor_frame

__all__ = ["COLUMNS", "COLUMN_WIDTHS", "TABLE_CSS", "TensorTable", "column_widths",
           "frame_catalog", "index_summary_html", "objects_html", "responsive_columns",
           "stats_columns", "tensor_details_html", "tensor_frame"]

PAGE_SIZE = 20
# the HTML panes draw in their own shadow roots: tables get their spacing from this sheet
TABLE_CSS = (".ckptlab-table{border-collapse:collapse} .ckptlab-table th,"
             ".ckptlab-table td{padding:2px 14px 2px 2px;text-align:left}"
             ".ckptlab-table td:not(:first-child){font-variant-numeric:tabular-nums}")
MAX_VALUES = 200  # non-tensor values listed (the rest counted)
MAX_VALUE_TEXT = 400  # characters of one value's JSON shown
MAX_PARTS = 50  # parts listed in a tensor's details
# column widths in CSS pixels: each fits its header (its sort arrow included) and the usual
# values; ``name`` takes what is left and ``file`` is sized to its longest name (within
# FILE_WIDTH). A longer value ends in an ellipsis and shows whole in the cell's tooltip.
COLUMN_WIDTHS = {"dtype": 110, "shape": 110, "kind": 90, "bytes": 100, "parameters": 135,
                 "offset": 120}
# a cell's value sits in a <div> of its own (panel's formatters): cut that one with an
# ellipsis (the cell's own ``text-overflow`` does not reach it: it was cut without one)
TENSOR_TABLE_CSS = (".tabulator-cell > div, .tabulator-col-title{overflow:hidden;"
                    "text-overflow:ellipsis;white-space:nowrap}")
FILE_WIDTH = (70, 260)
# the name column never gets narrower than this (about 36 characters: ``...h.0.attn.c_attn.weight``
# and ``...c_proj.weight`` stay apart at 1024 px); where the window is too narrow for it and
# every other column, Tabulator hides whole columns in this order (``responsive``: the higher,
# the sooner), and the selected tensor's details still show every field
NAME_MIN_WIDTH = 300
HIDE_FIRST = ("offset", "parameters", "kind", "file", "zeros", "abs_max", "mean", "std", "bytes",
              "inf", "nan", "max", "min")
# the statistics columns a table gains on demand (TensorTable.show_stats), with their widths
STATS_COLUMNS = {"min": 100, "max": 100, "mean": 100, "std": 100, "abs_max": 100, "nan": 70,
                 "inf": 70, "zeros": 80}
STATS_TITLES = {"abs_max": "abs max", "nan": "NaN", "inf": "Inf"}
CHAR_PX = 8  # about one character of the table's font (14 px sans), to size the file column


def column_widths(frame: pd.DataFrame) -> dict[str, int]:
    """The table's column widths in CSS pixels (:data:`COLUMN_WIDTHS`, and the ``file``
    column's from its longest name); ``name`` has none: it takes the rest of the width."""
    files = frame["file"]
    names = files.cat.categories if isinstance(files.dtype, pd.CategoricalDtype) else files
    longest = max((len(str(n)) for n in names), default=0)
    lo, hi = FILE_WIDTH
    return {**COLUMN_WIDTHS, "file": min(max(CHAR_PX * longest + 24, lo), hi)}


def responsive_columns() -> list[dict[str, Any]]:
    """Tabulator's per-column settings for a narrow window: ``name`` keeps
    :data:`NAME_MIN_WIDTH` and is never hidden, nor are ``dtype`` and ``shape``; the columns
    of :data:`HIDE_FIRST` go first to last."""
    ranks = {field: len(HIDE_FIRST) - i for i, field in enumerate(HIDE_FIRST)}
    return [{"field": "name", "minWidth": NAME_MIN_WIDTH, "responsive": 0}] + [
        {"field": field, "responsive": ranks.get(field, 0)}
        for field in (*COLUMNS[1:], *STATS_COLUMNS)]


def stats_columns(names: Sequence[str], found: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The :data:`STATS_COLUMNS` of the rows ``names`` from :func:`ckptlab.stats`'s result
    (NaN where a tensor was not measured, could not be read, or has no such value)."""
    out = {}
    for column in STATS_COLUMNS:
        values = [getattr(found.get(n), column, None) for n in names]
        out[column] = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    return out


class _RowLabels(Mapping):
    """Position in the table's current rows -> that row's label in the frame, read from the
    rows' index when asked. Panel's Tabulator rebuilds this mapping as a dict on every filter
    and at creation, once per session: 65 ms over 100,000 rows, twice before a page is sent
    (it is read only to map a click's row)."""

    def __init__(self, index: pd.Index) -> None:
        self._index = index

    def __getitem__(self, position: object) -> Any:
        if type(position) is not int or not 0 <= position < len(self._index):
            raise KeyError(position)
        return self._index[position]

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._index)))


def frame_catalog(frame: pd.DataFrame) -> TensorCatalog:
    """The one tensor query's catalog of :func:`tensor_frame` rows (the quick page's
    ``CheckpointRows.catalog`` is the same, made from the index)."""
    return TensorCatalog(frame["name"].tolist(), nbytes=frame["bytes"].to_numpy(),
                         parameters=frame["parameters"].to_numpy(),
                         files=frame["file"].astype(str).tolist(),
                         offsets=frame["offset"].to_numpy(), dtypes=frame["dtype"].astype(str),
                         kinds=frame["kind"].astype(str))


class LazyRowsTabulator(TabulatorHooks, pn.widgets.Tabulator):
    """panel's Tabulator with its position -> label mapping read lazily (:class:`_RowLabels`)
    and its rows sorted by the one tensor query (:meth:`sort_rows`) instead of panel's own
    sort (lower-cased text, ties by position as text: "10" before "2")."""

    catalog: TensorCatalog | None = None  # the rows' catalog, set by TensorTable

    def sort_rows(self, df: pd.DataFrame) -> pd.DataFrame:
        """``df`` (rows of the table's frame, labelled by position) in the order of the first
        of :attr:`sorters` on a sortable column (:data:`SORT_KEY_OF_COLUMN`), as the one
        tensor query sorts; unsorted, the checkpoint's order."""
        sorter = next((s for s in self.sorters or () if s.get("field") in SORT_KEY_OF_COLUMN
                       or s.get("field") in STATS_COLUMNS), None)
        if sorter is not None and sorter["field"] in STATS_COLUMNS and sorter["field"] in df:
            # a statistic: by its value (NaN, not measured, last), ties in checkpoint order
            return df.sort_values(sorter["field"], ascending=sorter.get("dir") != "desc",
                                  kind="stable", na_position="last")
        if sorter is None or self.catalog is None or sorter["field"] not in SORT_KEY_OF_COLUMN:
            return df
        order = self.catalog.order(SORT_KEY_OF_COLUMN[sorter["field"]],
                                   sorter.get("dir") == "desc")
        keep = np.zeros(len(self.catalog), dtype=bool)
        keep[df.index.to_numpy()] = True
        return df.loc[order[keep[order]]]

    def row_mapping(self, rows: Any) -> Mapping[int, Any] | None:
        """Lazily, over the shown rows' index (:class:`_RowLabels`); panel's own dict for
        anything else (a list)."""
        return _RowLabels(rows.index) if isinstance(rows, pd.DataFrame) else None


class TensorTable:
    """A search box over a :class:`panel.widgets.Tabulator` of :func:`tensor_frame` rows.

    ``on_select(row)`` is called with the selected tensor's row (its position in the
    checkpoint) when the user clicks a row. ``frame`` is shared: it is never changed here.
    """

    def __init__(self, frame: pd.DataFrame, *, on_select: Callable[[int], None] | None = None,
                 page_size: int = PAGE_SIZE, catalog: TensorCatalog | None = None) -> None:
        from bokeh.models.widgets.tables import NumberFormatter

        self.frame = frame
        self.catalog = catalog if catalog is not None else frame_catalog(frame)
        self.on_select = on_select
        self.search = pn.widgets.TextInput(
            placeholder="find a tensor by name: a part of it, or a glob such as *.mlp.*",
            sizing_mode="stretch_width", css_classes=["ckptlab-search"])
        number = NumberFormatter(format="0,0")
        self.table = LazyRowsTabulator(
            frame, pagination="remote", page_size=page_size, disabled=True, show_index=False,
            selectable=1, sizing_mode="stretch_width", css_classes=["ckptlab-tensors"],
            formatters={"bytes": number, "parameters": number, "offset": number},
            header_align={"bytes": "right", "parameters": "right", "offset": "right"},
            text_align={"bytes": "right", "parameters": "right", "offset": "right"},
            widths=column_widths(frame), layout="fit_columns", stylesheets=[TENSOR_TABLE_CSS],
            sortable={c: c in SORT_KEY_OF_COLUMN for c in frame.columns},
            # a value cut to its column's width (an ellipsis) shows whole on hover
            configuration={"columnDefaults": {"tooltip": True}, "responsiveLayout": "hide",
                           "columns": responsive_columns()})
        self.table.catalog = self.catalog
        self.count = pn.pane.HTML(self._count_text(len(frame)), css_classes=["ckptlab-count"],
                                  sizing_mode="stretch_width")
        self.table.add_filter(pn.bind(self._filter, pattern=self.search.param.value_input))
        self._watchers = [self.table.param.watch(self._on_selection, "selection")]
        self.view = pn.Column(self.search, self.count, self.table, sizing_mode="stretch_width",
                              css_classes=["ckptlab-tensor-table"])

    def show_stats(self, found: Mapping[str, Any]) -> None:
        """Add the :data:`STATS_COLUMNS` of :func:`ckptlab.stats`'s result ``found`` to the
        table (sortable by value; this session's rows only: the shared frame is not
        changed)."""
        from bokeh.models.widgets.tables import NumberFormatter, ScientificFormatter

        columns = stats_columns(self.frame["name"].tolist(), found)
        real = ScientificFormatter(precision=4, power_limit_high=5, power_limit_low=-3,
                                   nan_format="")
        count = NumberFormatter(format="0,0", nan_format="")
        self.table.param.update(
            widths={**self.table.widths, **STATS_COLUMNS},
            titles={**self.table.titles, **STATS_TITLES},
            formatters={**self.table.formatters,
                        **{c: count if c in ("nan", "inf", "zeros") else real
                           for c in STATS_COLUMNS}},
            value=self.frame.assign(**columns))

    def _count_text(self, shown: int) -> str:
        total = len(self.frame)
        what = plural(total, "tensor") if shown == total else \
            f"{shown:,} of {plural(total, 'tensor')}"
        return f'<span class="ckptlab-count-text">{what}</span>'

    def _filter(self, df: pd.DataFrame, pattern: str | None = "") -> pd.DataFrame:
        if not pattern or not pattern.strip():
            out = df
        else:  # df's index is the rows' positions in the frame (filters come before sorts)
            keep = np.zeros(len(self.frame), dtype=bool)
            keep[self.catalog.matches(pattern)] = True
            out = df[keep[df.index.to_numpy()]]
        if self.count is not None:
            self.count.object = self._count_text(len(out))
        return out

    def find(self, pattern: str) -> pd.DataFrame:
        """Filter the table as typing ``pattern`` in the search box does; the rows shown, in
        the order shown (the table's sort, else the checkpoint's order)."""
        self.search.value_input = pattern
        self.search.value = pattern
        return self.table.sort_rows(self.table.current_view)

    def _on_selection(self, event: Any) -> None:
        rows = event.new or []
        if rows and self.on_select is not None:
            self.on_select(int(self.frame.index[rows[0]]))

    def close(self) -> None:
        """Stop reacting to the table."""
        for watcher in self._watchers:
            watcher.inst.param.unwatch(watcher)
        self._watchers = []
        self.on_select = None


def _tied_words(index: CheckpointIndex) -> str:
    """" · N tied tensors (another's bytes) counted once" when some are, else ""."""
    tied = index.tied_rows()
    if not tied:
        return ""
    first = min(tied)
    return (f" · {len(tied):,} tied tensor{'s' * (len(tied) != 1)} (another's bytes, e.g. "
            f"{html.escape(index.names[first])}) counted once")


def index_summary_html(index: CheckpointIndex) -> str:
    """The header: name, format, files, tensors, parameters and bytes, then totals by dtype."""
    name = html.escape(index.path.rstrip("/").rsplit("/", 1)[-1] or index.path)
    nfiles = len(index.files)
    line = (f'<div class="ckptlab-summary"><b>{name}</b> · {html.escape(index.format)} · '
            f"{nfiles:,} file{'s' * (nfiles != 1)} · {len(index):,} tensors · "
            f"{index.total_parameters:,} parameters · {human_nbytes(index.file_nbytes)} "
            f"({index.file_nbytes:,} B) on disk, {human_nbytes(index.tensor_nbytes)} of "
            f"tensor bytes{_tied_words(index)}</div>")
    rows = [[dtype, n, params, human_nbytes(nb)]
            for dtype, (n, params, nb) in index.totals_by_dtype().items()]
    table = html_table(["dtype", "tensors", "parameters", "bytes"], rows,
                       css_class="ckptlab-table ckptlab-dtypes") if rows else ""
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in index.notes[:10])
    return line + table + (f'<ul class="ckptlab-notes">{notes}</ul>' if notes else "")


def objects_html(objects: dict[str, Any]) -> str:
    """The non-tensor values (step, lr, config), one row each, as inert JSON text."""
    if not objects:
        return '<i class="ckptlab-values">No values besides tensors.</i>'
    rows = []
    for i, (name, value) in enumerate(objects.items()):
        if i >= MAX_VALUES:
            rows.append(["…", f"{len(objects) - MAX_VALUES:,} more values"])
            break
        text = json.dumps(value, default=str, ensure_ascii=False)
        if len(text) > MAX_VALUE_TEXT:
            text = text[:MAX_VALUE_TEXT] + "…"
        rows.append([name, text])
    return html_table(["name", "value (inert JSON)"], rows,
                      css_class="ckptlab-table ckptlab-values")


def tensor_details_html(index: CheckpointIndex, row: int) -> str:
    """One tensor: name, dtype, shape, kind, bytes, parameters and its parts."""
    parts = index.parts_of(row)
    head = (f'<div class="ckptlab-tensor-title"><b>{html.escape(index.names[row])}</b> · '
            f"{html.escape(index.dtypes[row])}{html.escape(index.shapes[row])} · "
            f"{html.escape(index.kinds[row])} · {human_nbytes(index.nbytes[row])} · "
            f"{index.parameters[row]:,} parameters</div>")
    if not parts:
        return head + "<i>No bytes in the files (an empty tensor).</i>"
    rows = [[role, file, offset, nbytes] for role, file, offset, nbytes in parts[:MAX_PARTS]]
    more = (f"<i>… {len(parts) - MAX_PARTS:,} more parts</i>" if len(parts) > MAX_PARTS
            else "")
    return head + html_table(["part", "file", "offset", "bytes"], rows) + more
