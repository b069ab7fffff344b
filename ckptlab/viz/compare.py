"""Figures and tables of a comparison (:func:`ckptlab.diff`, :func:`ckptlab.compare.step_diffs`)
and of tensor statistics (:func:`ckptlab.stats`): core objects in, plotly figures or HTML out.

- :func:`diff_figure`: how far each module moved (``||a - b|| / ||a||`` over its tensors, on a
  log axis), unchanged modules drawn apart in grey, changed shapes in red;
- :func:`diff_table_html`: the tensors that differ, the largest changes first;
- :func:`hist_figure`: histograms side by side (a tensor in A and in B, or its changes);
- :func:`stats_table_html` and :func:`health_html`: the statistics and what looks wrong;
- :func:`steps_figure`: a run's modules against its consecutive saves, coloured by change;
- :class:`DiffBrowser`: what a view of a diff does on a search, a click or a pick.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from ckptlab._words import plural
from ckptlab.viz._style import PALETTE, html_table, plain_text, style_figure, theme_colors

__all__ = ["DiffBrowser", "counts_text", "diff_figure", "diff_table_html", "health_html",
           "hist_figure", "stats_table_html", "steps_figure"]

MAX_ROWS = 300  # table rows shown (the JSON of the CLI has them all)
IDENTICAL = "#b8b8b8"
BROKEN = "#d62728"  # dtype or shape differs, or a side could not be read
SCALE = "Viridis"


def _rel_text(rel: float) -> str:
    if rel == 0:
        return "no change in value"
    if math.isinf(rel):
        return "a shape differs, or a tensor is unreadable"
    return f"{rel:.3g}"


def diff_figure(d: Any, *, depth: int | None = None, theme: str | None = None) -> go.Figure:
    """How far each module moved between the two sides of ``d`` (a
    :class:`~ckptlab.compare.CheckpointDiff`): a bar per module (``d.by_module(depth)``), at
    its relative change (``||a - b|| / ||a||`` over its tensors) on a log axis, coloured by it;
    modules whose values did not change are grey bars at the axis floor, modules with a
    tensor whose shape differs (or that could not be read) red bars to the end of the
    axis."""
    rows = d.by_module(depth)
    moved = [r for _, r, _, _ in rows if 0 < r < math.inf]
    low = min(moved) / 10 if moved else 1e-8
    high = max(moved) * 10 if moved else 1.0
    x = [low if r == 0 else high if math.isinf(r) else r for _, r, _, _ in rows]
    logs = [math.log10(r) for r in moved]
    lo, span = (min(logs), (max(logs) - min(logs)) or 1.0) if logs else (0.0, 1.0)
    colors = [IDENTICAL if r == 0 else BROKEN if math.isinf(r) else
              _viridis((math.log10(r) - lo) / span) for _, r, _, _ in rows]
    bar = go.Bar(
        x=x, y=[plain_text(m) for m, _, _, _ in rows], orientation="h",
        marker={"color": colors}, customdata=[[_rel_text(r), c, n] for _, r, c, n in rows],
        hovertemplate="%{y}: %{customdata[0]} · %{customdata[1]} of %{customdata[2]} "
                      "tensors changed<extra></extra>")
    fig = go.Figure(bar)
    counts = d.counts()
    title = (f"How far each module moved: {counts['changed']:,} of "
             f"{plural(len(d.tensors), 'compared tensor')} changed")
    extra = [f"{counts['only_a']:,} only in A" if counts["only_a"] else "",
             f"{counts['only_b']:,} only in B" if counts["only_b"] else ""]
    if any(extra):
        title += "<br><sup>" + ", ".join(e for e in extra if e) + "</sup>"
    fig.update_layout(
        title=title, height=max(220, 120 + 18 * len(rows)),
        xaxis={"title": "relative change of the module, ||a - b|| / ||a|| (log)",
               "type": "log", "range": [math.log10(low / 10), math.log10(high)]},
        yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
        margin={"l": 20, "r": 20, "b": 50}, showlegend=False,
        meta={"kind": "diff", "modules": [m for m, _, _, _ in rows],
              "rel_l2": [r for _, r, _, _ in rows], "changed": [c for _, _, c, _ in rows]})
    return style_figure(fig, theme=theme)


_VIRIDIS = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779",
            "#6ece58", "#b5de2b", "#fde725")


def _viridis(t: float) -> str:
    """A colour of the viridis scale at ``t`` in [0, 1] (ten steps: enough to rank bars)."""
    return _VIRIDIS[min(len(_VIRIDIS) - 1, max(0, int(t * len(_VIRIDIS))))]


def _num(x: float | None, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def _status(t: Any) -> str:
    """A compared tensor in a word or two (its error where it could not be read)."""
    if t.error:
        return t.error
    if t.identical:
        return "identical"
    return "changed" if t.changed else "within tolerance"


def counts_text(d: Any) -> str:
    """The counts of a diff in a line: identical, changed, within tolerance, on one side
    only, and the name rule."""
    c = d.counts()
    return (f"{c['identical']:,} identical · {c['changed']:,} changed · "
            f"{c['within_tolerance']:,} within tolerance · {c['only_a']:,} only in A · "
            f"{c['only_b']:,} only in B · names matched: {d.mapping}")


def diff_table_html(d: Any, *, limit: int = MAX_ROWS) -> str:
    """The tensors that differ (changed, then within the tolerances), the largest changes
    first, then those on one side only and the renamed ones; identical ones counted in a
    line above the table."""
    changed = [(n, t) for n, t in d.largest(len(d.tensors))]
    within = [(n, t) for n, t in d.tensors.items() if not t.identical and not t.changed]
    rows: list[list[Any]] = []
    for name, t in changed + within:
        shape = t.shape[0] if t.shape[0] == t.shape[1] else f"{t.shape[0]} → {t.shape[1]}"
        dtype = t.dtype[0] if t.dtype[0] == t.dtype[1] else f"{t.dtype[0]} → {t.dtype[1]}"
        rel = "inf (A all zero)" if t.rel_l2 == math.inf and t.norm_a == 0 else \
            _num(t.rel_l2)
        rows.append([name, _status(t), dtype, str(shape),
                     _num(t.max_abs), rel, _num(t.cosine, ".6g"),
                     t.n_diff if t.n_diff is not None else "—",
                     f"{t.nan_a:,} / {t.nan_b:,}" if t.nan_a or t.nan_b else ""])
    rows += [[n, f"renamed → {d.renamed[n]}", "", "", "", "", "", "", ""] for n in d.renamed]
    rows += [[n, "only in A", "", "", "", "", "", "", ""] for n in d.only_a
             if n not in d.renamed]
    gone = set(d.renamed.values())
    rows += [[n, "only in B", "", "", "", "", "", "", ""] for n in d.only_b if n not in gone]
    head = f'<p class="ckptlab-diff-counts">{html.escape(counts_text(d))}</p>'
    if not rows:
        return head + "<p>Every compared tensor is identical.</p>"
    more = (f'<p class="note">First {limit:,} of {len(rows):,} rows; <code>ckptlab diff '
            "--json</code> has them all.</p>" if len(rows) > limit else "")
    return head + html_table(
        ["tensor", "status", "dtype", "shape", "max |a - b|", "rel_l2", "cosine",
         "elements differ", "NaN A / B"], rows[:limit]) + more


def hist_figure(series: Mapping[str, Any], *, title: str = "",
                theme: str | None = None) -> go.Figure:
    """The histograms of ``series`` (label -> :class:`~ckptlab.compare.TensorStats`) as
    steps over their own bins, one colour each, counts on a log axis (tails stay visible);
    a series without finite values is named in the title instead."""
    fig = go.Figure()
    empty = []
    for i, (label, s) in enumerate(series.items()):
        if not s.counts:
            empty.append(label)
            continue
        x = list(s.edges)
        y = list(s.counts) + [s.counts[-1]]
        fig.add_trace(go.Scatter(
            x=x, y=[v if v else None for v in y], mode="lines", line_shape="hv",
            name=plain_text(label), line={"color": PALETTE[i % len(PALETTE)], "width": 2},
            connectgaps=False,
            hovertemplate=f"{html.escape(plain_text(label))}: from %{{x:.4g}}: "
                          "%{y:,} elements<extra></extra>"))
    note = f" ({', '.join(empty)}: no finite value)" if empty else ""
    fig.update_layout(
        title=(title or "Histogram") + note, height=300,
        xaxis={"title": "value"}, yaxis={"title": "elements", "type": "log"},
        legend={"orientation": "h", "y": -0.25}, margin={"l": 20, "r": 20, "b": 60},
        meta={"kind": "hist", "series": [k for k in series if k not in empty]})
    return style_figure(fig, theme=theme)


def health_html(lines: Sequence[str]) -> str:
    """The health lines of :func:`~ckptlab.compare.health` as one paragraph."""
    if not lines:
        return '<p class="ckptlab-health">Health: nothing looks wrong.</p>'
    return ('<p class="ckptlab-health"><b>Health:</b> '
            + "; ".join(html.escape(line) for line in lines) + "</p>")


def stats_table_html(found: Mapping[str, Any], *, limit: int = MAX_ROWS) -> str:
    """A row of statistics per tensor (name order as given), unreadable ones saying why."""
    rows: list[list[Any]] = []
    for name, s in found.items():
        if s.error:
            rows.append([name, s.dtype, "", s.error, "", "", "", "", "", "", ""])
            continue
        rows.append([name, s.dtype, s.numel, _num(s.min), _num(s.max), _num(s.mean),
                     _num(s.std), _num(s.abs_max), s.nan, s.inf, s.zeros])
    more = (f'<p class="note">First {limit:,} of {len(rows):,} tensors; <code>ckptlab stats '
            "--json</code> has them all.</p>" if len(rows) > limit else "")
    return html_table(["tensor", "dtype", "elements", "min", "max", "mean", "std", "abs max",
                       "NaN", "Inf", "zeros"], rows[:limit]) + more


def steps_figure(steps: Sequence[tuple[str, str, Any]], *, depth: int | None = None,
                 theme: str | None = None) -> go.Figure:
    """A training run's modules (rows) against its consecutive saves (columns: ``earlier →
    later``, from :func:`~ckptlab.compare.step_diffs`), each cell the module's relative
    change between the two saves (``CheckpointDiff.by_module``) on a log colour scale;
    unchanged cells blank."""
    modules: dict[str, None] = {}
    columns = []
    for earlier, later, d in steps:
        rows = {m: r for m, r, _, _ in d.by_module(depth)}
        modules.update(dict.fromkeys(rows))
        columns.append((f"{earlier} → {later}", rows))
    names = list(modules)
    z = [[_log(col.get(m)) for _, col in columns] for m in names]
    text = [[_rel_text(col[m]) if m in col else "not in both" for _, col in columns]
            for m in names]
    fig = go.Figure(go.Heatmap(
        z=z, x=[c for c, _ in columns], y=[plain_text(m) for m in names], text=text,
        colorscale=SCALE, colorbar={"title": "log10 rel"}, hoverongaps=False,
        hovertemplate="%{y} · %{x}: %{text}<extra></extra>"))
    fig.update_layout(
        title=f"How far each module moved between saves ({len(steps) + 1 if steps else 0} "
              "saves)", height=max(260, 120 + 16 * len(names)),
        yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
        xaxis={"type": "category"}, margin={"l": 20, "r": 20, "b": 60},
        plot_bgcolor=theme_colors(theme)["empty"],
        meta={"kind": "steps", "modules": names, "steps": [c for c, _ in columns]})
    return style_figure(fig, theme=theme)


def _log(rel: float | None) -> float | None:
    """A cell's colour value: log10 of a change; None (blank) for none or no change."""
    if rel is None or rel == 0 or math.isnan(rel):
        return None
    return 3.0 if math.isinf(rel) else math.log10(rel)


MAX_OPTIONS = 2000  # tensors a picker lists at once (the search narrows them)


def listing(names: Sequence[str], pattern: str) -> tuple[list[str], str]:
    """A picker's options: the ``names`` the search ``pattern`` matches (a substring or a
    glob, as everywhere in ckptlab: :class:`~ckptlab.checkpoint.TensorQuery`), in their
    order, at most :data:`MAX_OPTIONS`, and a line saying how many match."""
    from ckptlab.checkpoint.query import TensorQuery

    if pattern.strip():
        matches = TensorQuery(pattern).matches
        names = [n for n in names if matches(n)]
    shown = list(names[:MAX_OPTIONS])
    line = f"{plural(len(names), 'tensor')} match" + (
        f"; the first {len(shown):,} listed" if len(shown) < len(names) else "")
    return shown, line


class DiffBrowser:
    """What a view of a diff does when the user searches, clicks a module or picks a tensor,
    without any widget: the notebook's :class:`~ckptlab.widgets.DiffExplorer` and the served
    page (``ckptlab serve A --compare B``) are thin layers over it.

    Parameters
    ----------
    d
        The :class:`~ckptlab.compare.CheckpointDiff`.
    a, b
        Its two sides opened (:class:`~ckptlab.checkpoint.Checkpoint`), or None: opened from
        ``d.a`` / ``d.b`` when a histogram first needs them.
    depth
        The module bars' depth (see :meth:`~ckptlab.compare.CheckpointDiff.by_module`).
    """

    def __init__(self, d: Any, a: Any = None, b: Any = None, *,
                 depth: int | None = None) -> None:
        self.diff, self.depth = d, depth
        self._sides = [a, b]
        self._modules = [m for m, _, _, _ in d.by_module(depth)]
        # the changed tensors, the largest changes first, then the others in A's order
        self.order = [n for n, _ in d.largest(len(d.tensors))] + [
            n for n, t in d.tensors.items() if not t.changed]

    def figure(self, theme: str | None = None) -> go.Figure:
        return diff_figure(self.diff, depth=self.depth, theme=theme)

    def listing(self, pattern: str) -> tuple[list[str], str]:
        """The picker's options for ``pattern`` (see :func:`listing`)."""
        return listing(self.order, pattern)

    def module_search(self, bar: int) -> str:
        """The search that lists the tensors of the module of bar ``bar`` (clicked)."""
        module = self._modules[bar]
        return "" if module == "(top)" else module + "."

    def side(self, i: int) -> Any:
        """Side ``i`` (0: A, 1: B), opened on first use."""
        if self._sides[i] is None:
            from ckptlab.checkpoint import open_checkpoint

            self._sides[i] = open_checkpoint(self.diff.b if i else self.diff.a)
        return self._sides[i]

    def histogram(self, name: str, theme: str | None = None) -> go.Figure:
        """Tensor ``name`` (A's) on both sides and its changes (``B - A``), as
        :func:`hist_figure`; a side that cannot be read is said in the title."""
        from ckptlab.compare._stats import side_by_side

        t = self.diff.tensors[name]
        try:
            series = side_by_side(self.diff, self.side(0), self.side(1), name)
            title = f"{plain_text(name)}: {_status(t)}"
        except Exception as exc:  # a side that cannot be read: said, not raised
            series, title = {}, f"{plain_text(name)}: cannot be read: {exc}"[:200]
        return hist_figure(series, title=title, theme=theme)
