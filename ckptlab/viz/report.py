"""A self-contained offline HTML report of one checkpoint (``ckptlab report``).

:func:`report_html` takes the byte layout of one torch.save file (its zip records, the
alignment what-if) or any :class:`~ckptlab.checkpoint.Checkpoint` (safetensors files, Hugging
Face, DCP and plain directories). The report is tensor first: a summary with totals by
dtype, a treemap of bytes by module, and the tensor table with a search box (every tensor
searchable in the browser, the rows shown capped, the page says how many are hidden); then
the byte maps (one per file of a multi-file checkpoint, with bytes per file), and the
format's own views. Words follow the format: records, zip64 and padding what-ifs only where
the file is a zip whose writer chooses its alignment. The figures follow the reader's
browser theme (light or dark).
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from ckptlab._words import plural
from ckptlab.checkpoint.query import TensorQuery
from ckptlab.format import ArchiveLayout, alignment_costs
from ckptlab.format.archive import largest_alignment
from ckptlab.viz._style import (
    LANE_COLORS,
    LANE_LABELS,
    PALETTE,
    html_table,
    human_nbytes,
    plain_text,
    style_figure,
)
from ckptlab.viz.alignment import alignment_figure
from ckptlab.viz.bytemap import (
    TINY_FRACTION,
    ByteMap,
    bytemap_figure,
    files_figure,
    overhead_figure,
    union_nbytes,
)
from ckptlab.viz.checkpoint import (
    TensorTable,
    dtype_totals,
    safety_badge,
    tensor_table,
    treemap_figure,
)
from ckptlab.viz.hexview import hex_html
from ckptlab.viz.tensors import storage_figure

__all__ = ["MAX_FILE_MAPS", "MAX_TENSOR_ROWS", "report_html"]

MAX_TABLE_ROWS = 500
MAX_FILE_MAPS = 8  # byte maps of a multi-file checkpoint: the files with the most tensors
MAX_PLACEMENT_ROWS = 60
MAX_FILTER_ROWS = 200_000  # tensors the report's search box can search (all, up to this)
MAX_TENSOR_ROWS = 200  # tensor rows shown at once: a redraw of more takes over 200 ms

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #222;
       padding: 0 16px; }
@media (prefers-color-scheme: dark) {
  body { background: #161616; color: #ddd; }
  th, td { border-bottom-color: #333 !important; }
  .note { color: #aaa !important; }
  input.ckptlab-filter { background: #222; color: #ddd; border-color: #555; }
}
th { text-align: left; }
.ckptlab-figure { width: 100%; }
input.ckptlab-filter { font-size: 14px; padding: 4px 8px; width: min(480px, 90%);
                       margin: 6px 0; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin-top: 20px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; }
.legend span { display: inline-block; padding: 1px 6px; margin: 2px; border-radius: 3px;
               font-size: 12px; color: #fff; }
.note { color: #666; font-size: 12px; }
"""


def _more(total: int) -> str:
    return (f'<p class="note">First {MAX_TABLE_ROWS} of {total:,} rows; '
            "<code>ckptlab inspect --json</code> has them all.</p>"
            if total > MAX_TABLE_ROWS else "")


def report_html(source: Any, *, hex_bytes: bytes | None = None, hex_file: str | None = None,
                max_file_maps: int = MAX_FILE_MAPS, diff: Any = None,
                histograms: Mapping[str, Mapping[str, Any]] | None = None,
                stats: Mapping[str, Any] | None = None,
                steps: Sequence[tuple[str, str, Any]] | None = None) -> str:
    """One HTML document with the figures, tables and plotly.js inline (works offline).

    Parameters
    ----------
    source
        The :class:`~ckptlab.format.ArchiveLayout` of one file (``ckptlab.inspect``), or a
        :class:`~ckptlab.checkpoint.Checkpoint` (``ckptlab.open``) of any format.
    hex_bytes
        The first bytes of a file (at most 1024 are shown), for a coloured hex view.
    hex_file
        For a checkpoint: the file (relative path, as in ``ck.files``) ``hex_bytes`` come from;
        its first file by default.
    max_file_maps
        For a checkpoint of several files: draw the byte maps of this many, the files with
        the most tensors first, then the largest (the report says when it leaves some out).
    diff
        A :class:`~ckptlab.compare.CheckpointDiff` of this checkpoint (A) against another:
        the report opens with what changed (``ckptlab report A --compare B``).
    histograms
        With ``diff``: tensor name -> {label: :class:`~ckptlab.compare.TensorStats`} (the
        tensor in A, in B, its changes), a figure each.
    stats
        Tensor name -> :class:`~ckptlab.compare.TensorStats` (``ckptlab.stats``): the tensor
        table gains their columns (min, max, mean, std, NaN, Inf) and a section says what
        looks wrong (the health line) and which tensors could not be measured
        (``ckptlab report --stats``).
    steps
        A training run's consecutive diffs (:func:`ckptlab.compare.step_diffs`): a figure of
        how far each module moved between saves (``ckptlab report RUN --steps``).

    Returns
    -------
    str
        The document. Its figures are the same builders the widgets use; plotly.js is
        embedded once, so the file opens with no network access.
    """
    lead, n = _lead(diff, histograms or {}, stats, steps)
    if isinstance(source, ArchiveLayout):
        return _layout_report(source, hex_bytes, lead, n, stats)
    return _checkpoint_report(source, hex_bytes, hex_file, max_file_maps, lead, n, stats)


def _lead(diff: Any, histograms: Mapping[str, Mapping[str, Any]],
          stats: Mapping[str, Any] | None,
          steps: Sequence[tuple[str, str, Any]] | None = None) -> tuple[str, int]:
    """The sections a report opens with (a run's saves, what changed, the statistics) and
    their figure count: they come first, with plotly.js."""
    from ckptlab.compare import health
    from ckptlab.viz.compare import (
        diff_figure,
        diff_table_html,
        health_html,
        hist_figure,
        steps_figure,
    )

    parts, figures = [], 0
    if steps:
        parts.append("<h2>The run's saves</h2>" + _figures_html(
            [("How far each module moved between consecutive saves", steps_figure(steps))]))
        figures += 1
    if diff is not None:
        figs = [("What changed", diff_figure(diff))] + [
            (f"Histograms · {name}", hist_figure(series, title=name))
            for name, series in histograms.items()]
        parts.append(f"<h2>Compared with {html.escape(diff.b)}</h2>"
                     + _figures_html(figs, start=figures)
                     + "<h2>What differs, the largest changes first</h2>"
                     + diff_table_html(diff))
        figures += len(figs)
    if stats is not None:
        unreadable = [[name, s.error] for name, s in stats.items() if s.error]
        parts.append("<h2>Tensor statistics</h2>" + health_html(health(dict(stats)))
                     + f'<p class="note">{plural(len(stats), "tensor")} measured: their '
                     "minimum, maximum, mean, standard deviation and NaN and Inf counts are "
                     "columns of the tensor table below (<code>ckptlab stats --json</code> "
                     "has the histograms too).</p>"
                     + (html_table(["could not be measured", "why"], unreadable)
                        if unreadable else ""))
    return "\n".join(parts), figures


def _figures_html(figures: Sequence[tuple[str, go.Figure]], start: int = 0,
                  legend: str = "") -> str:
    """The figures' divs, numbered from ``start``; plotly.js goes inline with figure 0.

    ``legend`` (the byte maps' lane key) goes under the heading of the first byte map.
    """
    parts = []
    for i, (title, fig) in enumerate(figures, start):
        div = pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False,
                          div_id=f"ckptlab-fig-{i}", default_width="100%",
                          config={"displaylogo": False, "responsive": True})
        key = ""
        if legend and (fig.layout.meta or {}).get("kind") == "bytemap":
            key, legend = legend, ""
        parts.append(f'<h2>{html.escape(title)}</h2>{key}'
                     f'<div class="ckptlab-figure">{div}</div>')
    return "".join(parts)


# the one tensor query's pattern rules (ckptlab.checkpoint.query) in JavaScript: a glob becomes
# the same regular expression as glob_regex() makes (tests/checkpoint/test_query.py runs both)
_MATCH_JS = r"""
function ckptlabGlob(p) {
  var cs = Array.from(p), out = [], i = 0, n = cs.length;
  var special = "\\^$.|?*+()[]{}", inSetSpecial = "\\]^-[", inSetHex = "&~|";
  function inSet(c) {
    if (inSetSpecial.indexOf(c) >= 0) return "\\" + c;
    if (inSetHex.indexOf(c) >= 0) return "\\x" + c.charCodeAt(0).toString(16);
    return c;
  }
  while (i < n) {
    var c = cs[i++];
    if (c === "*") {
      out.push(".*");
      while (i < n && cs[i] === "*") i++;
    } else if (c === "?") {
      out.push(".");
    } else if (c === "[") {
      var j = i;
      if (j < n && cs[j] === "!") j++;
      if (j < n && cs[j] === "]") j++;
      while (j < n && cs[j] !== "]") j++;
      if (j >= n) { out.push("\\["); continue; }
      var body = cs.slice(i, j), negate = body[0] === "!", items = [];
      i = j + 1;
      if (negate) body = body.slice(1);
      for (var k = 0; k < body.length;) {
        if (k + 2 < body.length && body[k + 1] === "-") {
          if (body[k].codePointAt(0) <= body[k + 2].codePointAt(0))
            items.push(inSet(body[k]) + "-" + inSet(body[k + 2]));
          k += 3;
        } else {
          items.push(inSet(body[k]));
          k += 1;
        }
      }
      out.push(items.length ? "[" + (negate ? "^" : "") + items.join("") + "]"
               : (negate ? "." : "(?!)"));
    } else {
      out.push(special.indexOf(c) >= 0 ? "\\" + c : c);
    }
  }
  return out.join("");
}
function ckptlabMatcher(q) {  // null: every name; else a test of a lower-cased name
  q = q.replace(/^[ \t\n\r\f\v]+|[ \t\n\r\f\v]+$/g, "");
  if (!q) return null;
  var needle = q.toLowerCase();
  if (!/[*?\[]/.test(needle))
    return function (lower) { return lower.indexOf(needle) >= 0; };
  var re = new RegExp("^(?:" + ckptlabGlob(needle) + ")$", "su");
  return function (lower) { return re.test(lower); };
}
"""

_FILTER_JS = r"""
(function () {
@MATCH@
  var rows = JSON.parse(document.getElementById("ckptlab-tensor-rows").textContent);
  var numeric = JSON.parse(document.getElementById("ckptlab-tensor-numeric").textContent);
  var box = document.getElementById("ckptlab-filter");
  var body = document.querySelector("#ckptlab-tensors tbody");
  var count = document.getElementById("ckptlab-filter-count");
  var cap = @CAP@, total = @TOTAL@;
  var lower = rows.map(function (r) { return String(r[0]).toLowerCase(); });
  var fmt = new Intl.NumberFormat("en-US");  // one formatter: toLocaleString per cell is slow
  var esc = function (v) {
    return String(v).replace(/[&<>"]/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]; });
  };
  function matcher(q) {
    var m = ckptlabMatcher(q);
    return m && function (i) { return m(lower[i]); };
  }
  function cell(v, j) {
    return numeric[j] && typeof v === "number"
      ? '<td style="text-align:right">' + fmt.format(v) + "</td>"
      : "<td>" + esc(v) + "</td>";
  }
  function render() {
    var m = matcher(box.value), html = [], hits = 0;
    for (var i = 0; i < rows.length; i++) {
      if (m && !m(i)) continue;
      hits++;
      if (hits <= cap) html.push("<tr>" + rows[i].map(cell).join("") + "</tr>");
    }
    body.innerHTML = html.join("");
    var shown = Math.min(hits, cap), hidden = hits - shown;
    count.textContent = (m ? fmt.format(hits) + " of " : "")
      + fmt.format(total) + " tensors" + (m ? " match" : "")
      + (hidden > 0 ? "; showing the first " + fmt.format(shown) + ", "
         + fmt.format(hidden) + " hidden (refine the search)" : "");
  }
  var timer = null;
  box.addEventListener("input", function () {
    clearTimeout(timer); timer = setTimeout(render, 50); });
})();
"""


def _dark_js() -> str:
    """A script that redraws every figure in the dark theme's colours when the reader's
    browser asks for a dark page (``prefers-color-scheme: dark``)."""
    from ckptlab.viz._style import THEMES

    light, dark = THEMES["light"], THEMES["dark"]
    script = r"""
(function () {
  if (!window.matchMedia || !window.matchMedia("(prefers-color-scheme: dark)").matches) return;
  var light = @LIGHT@, dark = @DARK@;
  function darken() {
    document.querySelectorAll(".js-plotly-plot").forEach(function (gd) {
      if (!gd.layout || !window.Plotly) return;
      var update = {"plot_bgcolor": dark.plot, "paper_bgcolor": dark.paper,
                    "font.color": dark.font, "modebar.color": dark.muted,
                    "modebar.activecolor": dark.font};
      Object.keys(gd.layout).forEach(function (k) {
        if (/^[xy]axis\d*$/.test(k)) {
          update[k + ".gridcolor"] = dark.grid;
          update[k + ".zerolinecolor"] = dark.grid;
        }
      });
      Plotly.relayout(gd, update);
      (gd.data || []).forEach(function (t, i) {
        if (t.type === "heatmap" && Array.isArray(t.colorscale)) {
          var scale = t.colorscale.map(function (s) {
            return [s[0], s[1] === light.empty ? dark.empty : s[1]]; });
          Plotly.restyle(gd, {colorscale: [scale]}, [i]);
        }
      });
    });
    document.body.classList.add("ckptlab-dark");
  }
  if (document.readyState === "complete") darken();
  else window.addEventListener("load", darken);
})();
"""
    return (script.replace("@LIGHT@", _json_for_script(light))
            .replace("@DARK@", _json_for_script(dark)))


def _json_for_script(value: Any) -> str:
    """JSON that cannot end the script element it sits in."""
    import json

    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).replace("<", "\\u003c")


def _tensor_section(table: TensorTable, multi: bool,
                    stats: Mapping[str, Any] | None = None) -> str:
    """The tensor table with a search box: the first rows in the page, all of them (up to
    ``MAX_FILTER_ROWS``) searchable in the browser, the shown rows capped at
    ``MAX_TENSOR_ROWS`` with a count of the hidden ones. The rows are in the one tensor
    query's default order and the box follows its rules (:data:`_MATCH_JS`), so a search
    finds what ``ckptlab inspect --filter`` and the served app find. With ``stats``
    (:func:`ckptlab.stats`'s result), :data:`STATS_HEADER`'s columns follow."""
    header = ["name", "dtype", "shape", "kind", "bytes", "params", *(["file"] * multi),
              "offset", *(STATS_HEADER if stats is not None else ())]
    numeric = [h in ("bytes", "params", "offset", "NaN", "Inf") for h in header]
    rows: list[list[Any]] = []
    shown = table.catalog.select(TensorQuery(limit=MAX_FILTER_ROWS)).rows
    for i in shown.tolist():
        off = int(table.offsets[i])
        row: list[Any] = [table.names[i], table.dtypes[i], table.shapes[i], table.kinds[i],
                          int(table.nbytes[i]), int(table.parameters[i])]
        if multi:
            row.append(table.files[i] or "—")
        row.append("—" if off < 0 else off)
        if stats is not None:
            row += _stats_cells(stats.get(table.names[i]))
        rows.append(row)
    n = len(table)
    hidden = n - min(n, MAX_TENSOR_ROWS)
    count = (plural(n, "tensor") + (f"; showing the first {MAX_TENSOR_ROWS:,}, {hidden:,} hidden "
                                 "(search to find any)" if hidden else ""))
    searchable = ("" if n <= MAX_FILTER_ROWS else
                  f" The search covers the first {MAX_FILTER_ROWS:,} tensors; "
                  "<code>ckptlab inspect --filter</code> searches them all.")
    return (
        "<h2>Tensors</h2>"
        '<input id="ckptlab-filter" class="ckptlab-filter" type="search" '
        'placeholder="search tensors: a name part, or a glob like *.mlp.*" '
        'aria-label="search tensors" autocomplete="off"> '
        f'<span id="ckptlab-filter-count" class="note">{count}</span>'
        + (f'<p class="note">{searchable}</p>' if searchable else "")
        + f'<div id="ckptlab-tensors">{html_table(header, rows[:MAX_TENSOR_ROWS])}</div>'
        f'<script type="application/json" id="ckptlab-tensor-rows">{_json_for_script(rows)}'
        "</script>"
        f'<script type="application/json" id="ckptlab-tensor-numeric">'
        f"{_json_for_script(numeric)}</script>"
        "<script>" + _FILTER_JS.replace("@CAP@", str(MAX_TENSOR_ROWS)).replace("@TOTAL@", str(n))
        .replace("@MATCH@", _MATCH_JS) + "</script>")


STATS_HEADER = ("min", "max", "mean", "std", "NaN", "Inf")  # a tensor's statistics columns


def _stats_cells(found: Any) -> list[Any]:
    """A tensor's :data:`STATS_HEADER` cells: "—" where it was not measured, "unreadable"
    where it could not be read (the statistics section lists why)."""
    if found is None:
        return ["—"] * len(STATS_HEADER)
    if found.error:
        return ["unreadable", "—", "—", "—", "—", "—"]
    return [*(format(v, ".4g") if v is not None else "—"
              for v in (found.min, found.max, found.mean, found.std)), found.nan, found.inf]


def _dtype_html(source: Any) -> str:
    totals = dtype_totals(source)
    if not totals:
        return ""
    return "<h3>By dtype</h3>" + html_table(
        ["dtype", "tensors", "parameters", "bytes"],
        [[t.dtype, t.tensors, t.parameters, t.nbytes] for t in totals])


def _legend(lanes: Iterable[str]) -> str:
    """The byte maps' key: a colour chip per lane, in a ``div.legend`` ("" for no lane)."""
    keys = "".join(f'<span style="background:{LANE_COLORS[k]}">{LANE_LABELS[k]}</span>'
                   for k in lanes)
    if not keys:
        return ""
    return ('<div class="legend">' + keys + '<span class="note" style="color:#666">shade: the '
            f"share of a bin a kind covers; a thin tick: present but under "
            f"{TINY_FRACTION:.0%} of the bin</span></div>")


def _page(name: str, nbytes: int, body: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ckptlab report · {name}</title>
<style>{_CSS}</style></head>
<body class="ckptlab-report">
<h1>ckptlab report · {name}</h1>
<p class="note">{human_nbytes(nbytes)} · generated {stamp} · self-contained: no
network access needed.</p>
{body}
<script>{_dark_js()}</script>
</body></html>
"""


_ZIP_WORDS = {"header + name": "header", "FB padding": "header padding"}


def _fitting_overhead(fig: go.Figure, fmt: str) -> go.Figure:
    """The overhead figure in the words of a format that is not a zip (safetensors: the
    header and its padding; no records, no FB padding)."""
    if fmt == "torch-zip":
        return fig
    for trace in fig.data:
        label = _ZIP_WORDS.get(trace.name, trace.name)
        trace.update(name=label, hovertemplate=f"{label}: " + "%{y:,.0f} B<extra></extra>")
    unit = "tensor" if fmt == "safetensors" else "item"
    fig.update_layout(xaxis={"title": f"{unit} (in file order; the header first)"})
    return fig


def _layout_report(layout: ArchiveLayout, hex_bytes: bytes | None, lead: str = "",
                   lead_figures: int = 0, stats: Mapping[str, Any] | None = None) -> str:
    """One file's byte layout: records and alignment what-if for a torch.save zip."""
    zip_ = layout.format == "torch-zip"
    bm = ByteMap.from_layout(layout)
    name = plain_text(layout.path.rsplit("/", 1)[-1])
    title = None if zip_ else (f"{name} · {human_nbytes(layout.file_nbytes)} · "
                               f"{plural(len(layout.tensors), 'tensor')} · data alignment "
                               f"{layout.alignment}")
    figures: list[tuple[str, go.Figure]] = [
        ("Byte map", bytemap_figure(bm, title=title)),
        ("Overhead", _fitting_overhead(overhead_figure(bm), layout.format))]
    if zip_:
        figures.append(("Alignment cost", alignment_figure(alignment_costs(layout),
                                                           current=layout.storage_alignment)))
    if layout.tensors:
        figures.append(("Tensors → storages → bytes" if zip_ else "Tensors → bytes",
                        storage_figure(layout)))
    table = tensor_table(layout)
    pct = 100 * layout.overhead_nbytes / max(layout.file_nbytes, 1)
    facts: list[list[Any]] = [["format", layout.format], ["file", layout.path],
                              ["size", layout.file_nbytes]]
    if zip_:
        facts += [["records", len(layout.records)], ["storages", len(layout.storages)],
                  ["tensors", len(layout.tensors)],
                  ["alignment (largest dividing every storage)", layout.alignment],
                  ["storage_alignment record", layout.storage_alignment or "—"],
                  ["zip64", layout.zip64],
                  ["overhead", f"{layout.overhead_nbytes:,} B ({pct:.3f}%)"],
                  ["FB padding", layout.padding_nbytes]]
    else:
        facts += [["tensors", len(layout.tensors)],
                  ["data alignment (largest power of two ≤ 4096 dividing every tensor's "
                   "offset)", layout.alignment],
                  ["header and padding", f"{layout.overhead_nbytes:,} B ({pct:.3f}%)"],
                  ["header padding", layout.padding_nbytes]]
    facts += [["parameters", table.total_parameters]]
    head: list[tuple[str, go.Figure]] = (
        [("Bytes by module", treemap_figure(table))] if layout.tensors else [])
    body = [safety_badge(layout.path) if os.path.isfile(layout.path) else "",
            html_table(["", ""], facts), lead, _dtype_html(table),
            _figures_html(head, start=lead_figures), _tensor_section(table, multi=False, stats=stats),
            _figures_html(figures, start=lead_figures + len(head), legend=_legend(bm.lanes))]
    if zip_:
        records = [[r.short_name, r.header_offset, r.data_offset, r.data_nbytes,
                    r.padding_nbytes, r.zip64_extra_nbytes, r.descriptor_nbytes,
                    f"{r.crc32:#010x}"] for r in layout.records]
        body.append("<h2>Records</h2>" + html_table(
            ["record", "header", "data offset", "data bytes", "FB padding", "zip64 extra",
             "descriptor", "crc32"], records[:MAX_TABLE_ROWS]) + _more(len(records)))
    if hex_bytes:
        body.append("<h2>First bytes</h2>" + hex_html(hex_bytes[:1024], 0, layout))
    return _page(name, layout.file_nbytes, "\n".join(body))


# -- any checkpoint ------------------------------------------------------------------------------
def _file_layout(entry: Any, offsets: list[int]) -> ArchiveLayout:
    """The file's own layout, or one made of its segments (a DCP data file, a JSON index)."""
    if isinstance(entry.layout, ArchiveLayout):
        return entry.layout
    return ArchiveLayout(format=entry.format, path=entry.path, file_nbytes=entry.nbytes,
                         archive_name="", records=(), storages=(), tensors=(),
                         segments=tuple(entry.segments),
                         alignment=largest_alignment(offsets) if offsets else 4096, zip64=False)


def _shape(shape: Any) -> str:
    if shape is None:
        return "?"
    return "x".join("j" if d < 0 else str(d) for d in shape) or "scalar"


def _placement_figure(parts: Sequence[tuple[str, Any]], multi: bool) -> go.Figure:
    """One bar per tensor part at its bytes in its file (the largest first)."""
    ordered = sorted(parts, key=lambda kp: (-kp[1].nbytes, kp[0]))
    shown = ordered[:MAX_PLACEMENT_ROWS]
    files = list(dict.fromkeys(p.file for _, p in shown))
    color = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(files)}
    labels = [plain_text(f"{k} · {p.file}" if multi else k) for k, p in shown]
    fig = go.Figure(go.Bar(
        y=labels, x=[max(p.nbytes, 1) for _, p in shown], base=[p.offset for _, p in shown],
        orientation="h", marker={"color": [color[p.file] for _, p in shown]},
        customdata=[[p.offset, p.offset + p.nbytes, p.nbytes] for _, p in shown],
        text=[plain_text(f"{p.dtype}{list(p.shape)}") for _, p in shown], textposition="none",
        hovertemplate=("%{y}<br>%{text}<br>file bytes [%{customdata[0]:,}, "
                       "%{customdata[1]:,}) · %{customdata[2]:,} B<extra></extra>")))
    fig.update_layout(
        title=(f"Tensors in their file{'s' * multi} · the largest {len(shown)} of "
               f"{len(parts)}" if len(parts) > len(shown) else
               f"Tensors in their file{'s' * multi} · {len(parts)}"),
        xaxis={"title": "file offset (bytes)", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True}, showlegend=False,
        height=max(280, 110 + 18 * len(shown)), margin={"l": 20, "r": 20, "t": 76, "b": 45},
        meta={"kind": "placement", "rows": [k for k, _ in shown],
              "omitted": len(parts) - len(shown)})
    return style_figure(fig)


def _checkpoint_report(ck: Any, hex_bytes: bytes | None, hex_file: str | None,
                       max_file_maps: int, lead: str = "", lead_figures: int = 0,
                       stats: Mapping[str, Any] | None = None) -> str:
    from ckptlab.gds.readiness import tensor_ranges

    multi = len(ck.files) > 1
    owned = [(p, len(t.parts) > 1) for t in ck.tensors.values() for p in t.parts]
    parts = [(r.name, p) for r, (p, _) in zip(tensor_ranges(ck), owned, strict=True)]
    by_file: dict[str, list[Any]] = {}
    for _, p in parts:
        by_file.setdefault(p.file, []).append(p)
    tensors_in = {f.path: len({t.name for t in ck.tensors.values()
                               if any(p.file == f.path for p in t.parts)}) for f in ck.files}
    data_offsets = [p.offset for _, p in parts if p.nbytes and p.compression is None]
    figures: list[tuple[str, go.Figure]] = []
    file_rows = sorted(((f.path, f.nbytes, union_nbytes((p.offset, p.nbytes)
                                                         for p in by_file.get(f.path, ())))
                        for f in ck.files), key=lambda r: (-r[1], r[0]))
    table = tensor_table(ck)
    head: list[tuple[str, go.Figure]] = (
        [("Bytes by module", treemap_figure(table))] if ck.tensors else [])
    if multi:
        figures.append(("Bytes per file", files_figure(ck, max_files=MAX_PLACEMENT_ROWS)))
    # the files that hold tensor bytes (an index or .metadata is one run of bytes: the table
    # says all there is), the ones with the most tensors first (a one-tensor shard's map is
    # one bar, eight of them say less than one shard with structure), then the largest; any
    # file when none holds tensors
    drawable = [f for f in sorted(ck.files, key=lambda f: (-tensors_in.get(f.path, 0),
                                                           -f.nbytes, f.path))
                if f.nbytes and f.segments]
    drawable = [f for f in drawable if f.path in by_file] or drawable
    mapped = drawable[:max(max_file_maps, 0)]
    lanes: dict[str, None] = {}
    zip_layout = None
    for f in mapped:
        offsets = [p.offset for p in by_file.get(f.path, ()) if p.nbytes]
        layout = _file_layout(f, offsets)
        bm = ByteMap.from_checkpoint(ck, f.path)
        lanes.update(dict.fromkeys(bm.lanes))
        title = (f"{plain_text(f.path)} · {human_nbytes(f.nbytes)} · "
                 f"{plural(tensors_in.get(f.path, 0), 'tensor')}" +
                 (f" · data alignment {largest_alignment(offsets)}" if offsets else ""))
        figures.append((f"Byte map · {f.path}" if multi else "Byte map",
                        bytemap_figure(bm, title=title)))
        if not multi:
            figures.append(("Overhead", _fitting_overhead(overhead_figure(bm), f.format)))
            if layout.format == "torch-zip":
                zip_layout = layout
                figures.append(("Alignment cost", alignment_figure(
                    alignment_costs(layout), current=layout.storage_alignment)))
    if parts:
        figures.append(("Tensors in their files" if multi else "Tensors in the file",
                        _placement_figure(parts, multi)))
    maps_note = ""
    if multi and len(mapped) < len(ck.files):
        n = len(drawable)
        which = (f"file{'s' * (n != 1)}" + (f" that hold{'s' * (n == 1)} tensor bytes"
                                            if n < len(ck.files) else ""))
        shown = (f"Byte maps of the {len(mapped)} with the most tensors of the {n} {which}"
                 if len(mapped) < n else
                 f"Byte map{'s' * (n != 1)} of the {'one' if n == 1 else n} {which}")
        maps_note = f'<p class="note">{shown}; the table above lists every file.</p>'

    name = html.escape(ck.path.rstrip("/").rsplit("/", 1)[-1] or ck.path)
    facts: list[list[Any]] = [
        ["format", ck.format], ["path", ck.path], ["size", ck.nbytes],
        ["files", len(ck.files)], ["tensors", len(ck.tensors)],
        ["parameters", ck.parameters], ["bytes of tensors", table.total_nbytes],
        *([["tied tensors (another's bytes, counted once)", len(ck.tied())]]
          if ck.tied() else []),
        ["data alignment (largest power of two ≤ 4096 dividing every tensor's offset)",
         largest_alignment(data_offsets) if data_offsets else "—"]]
    if any(p.compression for _, p in parts):
        facts.append(["compressed parts", sum(bool(p.compression) for _, p in parts)])
    body = [safety_badge(ck), html_table(["", ""], facts), lead, _dtype_html(table),
            _figures_html(head, start=lead_figures), _tensor_section(table, multi, stats)]
    if ck.notes:
        body.append("<ul class=\"note\">" + "".join(f"<li>{html.escape(n)}</li>"
                                                    for n in ck.notes) + "</ul>")
    if multi:
        body.append("<h2>Files</h2>" + html_table(
            ["file", "format", "bytes", "tensors", "tensor bytes", "share of the checkpoint"],
            [[f.path, f.format, f.nbytes, tensors_in.get(f.path, 0),
              next(r[2] for r in file_rows if r[0] == f.path),
              f"{100 * f.nbytes / max(ck.nbytes, 1):.2f}%"] for f in ck.files][:MAX_TABLE_ROWS])
            + _more(len(ck.files)))
    body.append(_figures_html(figures, start=lead_figures + len(head), legend=_legend(lanes)))
    body.append(maps_note)
    if zip_layout is not None:
        records = [[r.short_name, r.header_offset, r.data_offset, r.data_nbytes,
                    r.padding_nbytes, r.zip64_extra_nbytes, r.descriptor_nbytes,
                    f"{r.crc32:#010x}"] for r in zip_layout.records]
        body.append("<h2>Records</h2>" + html_table(
            ["record", "header", "data offset", "data bytes", "FB padding", "zip64 extra",
             "descriptor", "crc32"], records[:MAX_TABLE_ROWS]) + _more(len(records)))
    several = [(k, p) for (k, p), (_, many) in zip(parts, owned) if many]
    if several:
        prow = [[k, p.role, ",".join(map(str, p.chunk_offsets or ())) or "—", p.file,
                 p.offset, p.nbytes, p.compression or "—"] for k, p in several]
        body.append("<h2>Parts of tensors stored in several pieces</h2>" + html_table(
            ["part", "role", "chunk offsets", "file", "offset", "bytes", "compression"],
            prow[:MAX_TABLE_ROWS]) + _more(len(prow)))
    if hex_bytes:
        entry = next((f for f in ck.files if f.path == hex_file), ck.files[0] if ck.files
                     else None)
        if entry is not None:
            offsets = [p.offset for p in by_file.get(entry.path, ()) if p.nbytes]
            title = f"First bytes of {entry.path}" if multi else "First bytes"
            body.append(f"<h2>{html.escape(title)}</h2>" + hex_html(
                hex_bytes[:1024], 0, _file_layout(entry, offsets) if entry.segments else None))
    return _page(name, ck.nbytes, "\n".join(body))
