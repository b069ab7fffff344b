"""Comparing and measuring widgets: :class:`DiffExplorer` (what changed between two
checkpoints) and :class:`StatsExplorer` (each tensor's statistics and health). Views over
:mod:`ckptlab.compare`: the figures and tables are :mod:`ckptlab.viz.compare`'s."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from ckptlab._words import plural
from ckptlab.checkpoint import as_checkpoint
from ckptlab.compare import CheckpointDiff, TensorStats, diff, health, stats
from ckptlab.compare._stats import wanted
from ckptlab.viz.compare import (
    DiffBrowser,
    diff_table_html,
    health_html,
    hist_figure,
    listing,
    stats_table_html,
)
from ckptlab.widgets._common import progress
from ckptlab.widgets._figure import FigureWidget, replace_figure

__all__ = ["DiffExplorer", "StatsExplorer"]

class DiffExplorer(w.VBox):
    """What changed between two checkpoints of any formats.

    On top, how far each module moved (:func:`~ckptlab.viz.compare.diff_figure`: click a
    bar to list that module's tensors); under it a tensor picker (the changed tensors, the
    largest changes first; the search takes a substring or a glob) and, for the tensor
    picked (at first the largest change), the histograms of its values on both sides and of
    its changes (``b - a``); at the bottom the table of every difference. A view over
    :class:`~ckptlab.viz.compare.DiffBrowser`, as the served page is.

    Parameters
    ----------
    a, b
        Paths, URLs or :class:`~ckptlab.checkpoint.Checkpoint` objects; or ``a`` a
        :class:`~ckptlab.compare.CheckpointDiff` already computed (``b`` then omitted: the
        histograms open its two sides again by path).
    depth
        Group the module bars at this many name components (``2``: ``layers.0``).
    **options
        For :func:`ckptlab.diff` (``atol``, ``rtol``, ``rename``, ``names``).

    Attributes
    ----------
    diff : CheckpointDiff
    """

    def __init__(self, a: Any, b: Any = None, *, depth: int | None = None,
                 **options: Any) -> None:
        if isinstance(a, CheckpointDiff):
            self.browser = DiffBrowser(a, depth=depth)
        else:
            sides = [as_checkpoint(a), as_checkpoint(b)]
            self.browser = DiffBrowser(diff(sides[0], sides[1], **options), *sides,
                                       depth=depth)
        self.diff = d = self.browser.diff
        self.figure = FigureWidget(self.browser.figure())
        self.figure.data[0].on_click(self._module_clicked)
        self.search = w.Text(placeholder="tensor: a substring or a glob (*.mlp.*)",
                             layout=w.Layout(width="320px"))
        self.picker = w.Dropdown(description="tensor", layout=w.Layout(width="560px"))
        self.note = w.HTML()
        self.hist = FigureWidget(hist_figure({}, title="Pick a tensor"))
        self.table = w.HTML(diff_table_html(d))
        self.search.observe(lambda _: self._list(), names="value")
        self.picker.observe(lambda c: self._show(c["new"]), names="value")
        header = w.HTML(f"<b>{html.escape(d.a)}</b> (A) vs <b>{html.escape(d.b)}</b> (B)")
        super().__init__([header, self.figure, w.HBox([self.search, self.picker]), self.note,
                          self.hist, self.table])
        self.add_class("ckptlab-diff-explorer")
        self._list()
        if self.picker.options:  # open on the largest change
            self.picker.value = self.picker.options[0]

    def _module_clicked(self, trace: Any, points: Any, state: Any) -> None:
        if points.point_inds:
            self.search.value = self.browser.module_search(points.point_inds[0])

    def _list(self) -> None:
        names, line = self.browser.listing(self.search.value)
        self.picker.options = names
        self.note.value = f'<span style="font-size:12px">{html.escape(line)}</span>'

    def select(self, name: str) -> None:
        """Show tensor ``name`` (A's name) in the histograms."""
        if name not in self.diff.tensors:
            raise KeyError(f"{name!r} is not a tensor both sides have")
        self.search.value = ""
        self.picker.value = name

    def _show(self, name: str | None) -> None:
        if name is not None:
            replace_figure(self.hist, self.browser.histogram(name))


class StatsExplorer(w.VBox):
    """Each tensor's statistics (:func:`ckptlab.stats`) and what looks wrong
    (:func:`ckptlab.compare.health`): the health line, a tensor picker with the histogram of
    the tensor picked (at first the first tensor with a NaN or an Inf, else the first), and
    the table of statistics.

    Parameters
    ----------
    source
        A path, a URL or a :class:`~ckptlab.checkpoint.Checkpoint`.
    names
        Only these tensors (a list of names, or a test of a name).

    Attributes
    ----------
    checkpoint : Checkpoint
    stats : dict of str to TensorStats
    health : list of str
    """

    def __init__(self, source: Any, names: Any = None) -> None:
        self.checkpoint = ck = as_checkpoint(source)
        chosen = wanted(ck, names)
        with progress(len(chosen), "measuring tensors") as bar:
            self.stats: dict[str, TensorStats] = stats(ck, chosen,
                                                       measured=lambda _: bar.update(1))
        self.health = health(self.stats)
        self.search = w.Text(placeholder="tensor: a substring or a glob (*.mlp.*)",
                             layout=w.Layout(width="320px"))
        self.picker = w.Dropdown(description="tensor", layout=w.Layout(width="560px"))
        self.hist = FigureWidget(hist_figure({}, title="Pick a tensor"))
        self.table = w.HTML(stats_table_html(self.stats))
        self.search.observe(lambda _: self._list(), names="value")
        self.picker.observe(lambda c: self._show(c["new"]), names="value")
        super().__init__([w.HTML(f"<b>{html.escape(ck.path)}</b>: "
                                 f"{plural(len(self.stats), 'tensor')}"),
                          w.HTML(health_html(self.health)),
                          w.HBox([self.search, self.picker]), self.hist, self.table])
        self.add_class("ckptlab-stats-explorer")
        self._list()
        bad = [n for n, st in self.stats.items() if st.nan or st.inf or st.error]
        if bad or self.stats:  # open on the first tensor that looks wrong, else the first
            self.picker.value = (bad or list(self.stats))[0]

    def _list(self) -> None:
        self.picker.options = listing(list(self.stats), self.search.value)[0]

    def select(self, name: str) -> None:
        """Show tensor ``name``'s histogram."""
        if name not in self.stats:
            raise KeyError(f"{name!r} was not measured")
        self.search.value = ""
        self.picker.value = name

    def _show(self, name: str | None) -> None:
        if name is None:
            return
        s = self.stats[name]
        title = name if s.error is None else f"{name}: {s.error}"
        extra = [f"{s.nan:,} NaN" if s.nan else "", f"{s.inf:,} Inf" if s.inf else ""]
        if any(extra):
            title += " · " + ", ".join(e for e in extra if e)
        replace_figure(self.hist, hist_figure({name: s} if s.error is None else {},
                                              title=title))
