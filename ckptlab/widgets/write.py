"""Async writing widgets: bucket assignment what-ifs, a save's timeline, a save's progress bar."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from typing import Any

import ipywidgets as w

from ckptlab.errors import CkptlabError, InvalidArgumentError
from ckptlab.plan.simulate import CONFIGS
from ckptlab.viz._style import html_table, human_nbytes
from ckptlab.viz.write import bucket_figure, timeline_figure
from ckptlab.widgets._figure import FigureWidget, replace_figure
from ckptlab.write.buckets import BucketAssignment, SizedItem, assign_buckets, sized_items
from ckptlab.write.timeline import Timeline

__all__ = ["BucketExplorer", "TimelineView", "save_progress", "sized_items"]  # sized_items: re-exported

STATE_DICT = "state dict"  # the source option for the state dict given to BucketExplorer
MAX_BUCKETS = 32


def _assignment_html(assignment: BucketAssignment, items: list[SizedItem]) -> str:
    """Totals, imbalance and the largest item, then a row per bucket."""
    tensors = [i for i in items if i.is_tensor]
    largest = max(tensors, key=lambda i: i.nbytes, default=None)
    n = len(assignment.buckets)
    head = (f"<b>{len(items):,} items</b> ({len(items) - len(tensors):,} bytes items) · "
            f"{human_nbytes(assignment.nbytes)} of tensors in {n} bucket{'s' if n != 1 else ''}"
            f" · <b>imbalance {assignment.imbalance:.3f}</b> (fullest / ideal)")
    if largest is not None:
        head += (f" · largest item <code>{html.escape(largest.key)}</code> "
                 f"{human_nbytes(largest.nbytes)}")
        group = next((b.group for b in assignment.buckets if any(i is largest for i in b.items)),
                     0)
        ideal = assignment.ideal_nbytes(group)
        if ideal > 0 and largest.nbytes > ideal:
            head += " (larger than the ideal share: it alone sets the fullest bucket)"
    if assignment.separation_hint is not None and len({b.group for b in assignment.buckets}) > 1:
        even = assignment.nbytes / n
        fullest = max(assignment.bucket_nbytes)
        head += (f" · items starting with <code>{html.escape(assignment.separation_hint)}"
                 "</code> in buckets of their own (group 1); the fullest bucket holds "
                 f"{fullest / even if even else 1.0:.2f}× an even split of all bytes")
    rows = []
    for b in assignment.buckets:
        ideal = assignment.ideal_nbytes(b.group)
        rows.append([b.index, b.group, len(b.items), b.nbytes, human_nbytes(b.nbytes),
                     f"{b.nbytes / ideal:.3f}" if ideal > 0 else "-"])
    table = html_table(["bucket", "group", "items", "bytes", "", "× ideal"], rows)
    return (f'<div class="ckptlab-summary">{head}</div>'
            f'<div style="max-height:220px;overflow-y:auto">{table}</div>')


class BucketExplorer(w.VBox):
    """What-if bucket assignment: pick the items, the bucket count and a separation hint.

    Each bucket is one data file written by one worker, so the fullest bucket sets how long
    the save's disk phase takes. The figure is :func:`ckptlab.viz.bucket_figure` of
    :func:`ckptlab.write.assign_buckets` over the chosen items; the summary lists bytes per
    bucket, the imbalance and the largest item.

    Parameters
    ----------
    state_dict
        A state dict to offer as a source (flattened by :func:`sized_items`); without it
        only the model configs of :data:`ckptlab.plan.CONFIGS` are offered.
    config
        The config selected first when no state dict is given.
    optimizer
        Whether a config's items include Adam's state.
    buckets
        The bucket count selected first (1..32).
    separation_hint
        The key prefix of the separation toggle (``"optim."`` matches the configs' Adam
        state).
    separate
        Whether the separation hint is on at first.

    Attributes
    ----------
    source : ipywidgets.Dropdown
        ``"state dict"`` or a config name.
    optimizer : ipywidgets.Checkbox
        Disabled for a state dict.
    buckets : ipywidgets.IntSlider
        1..32 (2..32 while the separation hint is on: its items get buckets of their own).
    separate : ipywidgets.Checkbox
    hint : ipywidgets.Text
        The separation prefix.
    figure : plotly.graph_objects.FigureWidget
    summary : ipywidgets.HTML
    items : list of SizedItem
        The current source's items.
    assignment : BucketAssignment
        The assignment shown.
    """

    def __init__(self, state_dict: Mapping[str, Any] | None = None, *,
                 config: str = "llama3-8b", optimizer: bool = True, buckets: int = 8,
                 separation_hint: str = "optim.", separate: bool = False) -> None:
        if config not in CONFIGS:
            raise InvalidArgumentError(
                f"unknown model config {config!r}; expected one of {sorted(CONFIGS)}")
        if type(buckets) is not int or not 1 <= buckets <= MAX_BUCKETS:
            raise InvalidArgumentError(
                f"buckets must be an int in 1..{MAX_BUCKETS}, got {buckets!r}")
        self._state_dict = state_dict
        options = ([STATE_DICT] if state_dict is not None else []) + list(CONFIGS)
        self.source = w.Dropdown(options=options,
                                 value=STATE_DICT if state_dict is not None else config,
                                 description="items")
        self.optimizer = w.Checkbox(value=optimizer, description="with Adam state",
                                    indent=False)
        self.buckets = w.IntSlider(value=buckets, min=1, max=MAX_BUCKETS, description="buckets",
                                   continuous_update=False)
        self.separate = w.Checkbox(value=separate, description="separate keys starting with",
                                   indent=False)
        self.hint = w.Text(value=separation_hint, layout=w.Layout(width="120px"),
                           continuous_update=False)
        self._cache: dict[tuple[str, bool], list[SizedItem]] = {}
        self._refreshing = False
        self._sync_controls()
        self.items = self._items()
        self.assignment = assign_buckets(self.items, self.buckets.value, self._hint())
        self.figure = FigureWidget(bucket_figure(self.assignment))
        self.summary = w.HTML(_assignment_html(self.assignment, self.items))
        for control in (self.source, self.optimizer, self.buckets, self.separate, self.hint):
            control.observe(self._on_change, names="value")
        controls = w.HBox([self.source, self.optimizer, self.buckets, self.separate, self.hint])
        super().__init__([controls, self.figure, self.summary])
        self.add_class("ckptlab-bucket-explorer")

    def _hint(self) -> str | None:
        return self.hint.value if self.separate.value and self.hint.value else None

    def _items(self) -> list[SizedItem]:
        key = (self.source.value, self.optimizer.value and self.source.value != STATE_DICT)
        if key not in self._cache:
            self._cache[key] = (sized_items(self._state_dict)  # type: ignore[arg-type]
                                if key[0] == STATE_DICT else
                                sized_items(key[0], optimizer=key[1]))
        return self._cache[key]

    def _sync_controls(self) -> None:
        """The optimizer box only applies to configs; a separation hint needs 2 buckets."""
        self.optimizer.disabled = self.source.value == STATE_DICT
        self.buckets.min = 2 if self.separate.value else 1  # moves a value of 1 up to 2

    def _on_change(self, change: dict[str, Any]) -> None:
        if not self._refreshing:
            self.refresh()

    def refresh(self) -> None:
        """Re-read the controls: new items, new assignment, figure and summary updated."""
        self._refreshing = True  # _sync_controls may move the slider: one refresh, not two
        try:
            self._sync_controls()
        finally:
            self._refreshing = False
        self.items = self._items()
        try:
            assignment = assign_buckets(self.items, self.buckets.value, self._hint())
        except CkptlabError as exc:
            self.summary.value = (f'<div class="ckptlab-error"><b>Not assigned:</b> '
                                  f"{html.escape(str(exc))}</div>")
            return
        self.assignment = assignment
        replace_figure(self.figure, bucket_figure(assignment))
        self.summary.value = _assignment_html(assignment, self.items)


def _timeline_html(timeline: Timeline, meta: Mapping[str, Any]) -> str:
    """Time to return, total time, bytes, GB/s, outcome; then the files and the phases.

    ``meta`` is :func:`timeline_figure`'s ``layout.meta`` for the same timeline.
    """

    def ms(s: float | None) -> str:
        return "-" if s is None else f"{1e3 * s:.1f} ms"

    def rate(gbps: float | None) -> str:
        return "-" if gbps is None else f"{gbps:.2f} GB/s"

    outcome = meta["outcome"] + (f": {timeline.error}" if timeline.error else "")
    facts = [["returned to the caller after", ms(timeline.returned_s)],
             ["finished after", ms(timeline.finished_s)],
             ["bytes written", f"{human_nbytes(timeline.nbytes)} ({timeline.nbytes:,} B) "
                               f"in {len(timeline.files)} file"
                               f"{'s' if len(timeline.files) != 1 else ''}"],
             ["disk phase (first write to last fsync)",
              f"{ms(meta['write_span_s'])} · {rate(meta['write_gbps'])}"],
             ["whole save", rate(meta["gbps"])],
             ["outcome", outcome]]
    files = []
    per_bucket = {b["bucket"]: b for b in meta["buckets"]}
    for bucket, name, nbytes, io_path in timeline.files:
        files.append([bucket, name, nbytes, io_path, rate(per_bucket.get(bucket, {}).get("gbps"))])
    phases = [[p, v["events"], f"{1e3 * v['seconds']:.2f}", v["nbytes"]]
              for p, v in meta["phases"].items()]
    return (f'<div class="ckptlab-summary"><b>{html.escape(timeline.path)}</b> · rank '
            f"{timeline.rank}</div>" + html_table(["", ""], facts)
            + "<b>Files</b>" + html_table(["bucket", "file", "bytes", "I/O path", "write GB/s"],
                                          files)
            + "<b>Phases</b> (milliseconds summed over buckets)"
            + html_table(["phase", "events", "ms", "bytes"], phases))


class TimelineView(w.VBox):
    """One save: :func:`ckptlab.viz.timeline_figure` and a summary (times, GB/s, files).

    Parameters
    ----------
    timeline
        What :meth:`ckptlab.write.AsyncWriter.wait` returned (or ``SaveHandle.timeline``).

    Attributes
    ----------
    timeline : Timeline
    figure : plotly.graph_objects.FigureWidget
    summary : ipywidgets.HTML
        Time to return, total time, bytes written, GB/s, outcome; a row per data file with
        its I/O path (``O_DIRECT`` or ``POSIX``); seconds per phase.
    """

    def __init__(self, timeline: Timeline) -> None:
        if not isinstance(timeline, Timeline):
            raise InvalidArgumentError(
                f"TimelineView needs a ckptlab.write.Timeline, got {type(timeline).__name__}")
        self.timeline = timeline
        fig = timeline_figure(timeline)
        self.figure = FigureWidget(fig)
        self.summary = w.HTML(_timeline_html(timeline, fig.layout.meta))
        super().__init__([self.figure, self.summary])
        self.add_class("ckptlab-timeline-view")

    def show(self, timeline: Timeline) -> None:
        """Show another (or a later snapshot of the same) save."""
        if not isinstance(timeline, Timeline):
            raise InvalidArgumentError(
                f"TimelineView needs a ckptlab.write.Timeline, got {type(timeline).__name__}")
        self.timeline = timeline
        fig = timeline_figure(timeline)
        replace_figure(self.figure, fig)
        self.summary.value = _timeline_html(timeline, fig.layout.meta)


def save_progress(target: Any, *, interval_s: float = 0.1, desc: str | None = None,
                  **tqdm_kwargs: Any) -> Timeline:
    """A tqdm progress bar (``tqdm.auto``: a widget in Jupyter) over a save in flight.

    Polls the save's events every ``interval_s`` and shows the bytes written so far, until
    the save is committed or failed; then waits for it.

    Parameters
    ----------
    target
        A :class:`ckptlab.write.SaveHandle`, or an :class:`ckptlab.write.AsyncWriter`
        (its most recent save).
    interval_s
        Seconds between polls.
    desc
        The bar's label (default: the checkpoint directory's name).
    **tqdm_kwargs
        Passed to ``tqdm.auto.tqdm`` (``file=``, ``disable=``, ``leave=``, ...).

    Returns
    -------
    Timeline
        What ``wait()`` returns.

    Raises
    ------
    WriterError
        If the save failed (the bar is closed first).
    InvalidArgumentError
        For a writer that has not saved anything, or ``interval_s <= 0``.

    Notes
    -----
    The bar follows :meth:`SaveHandle.progress`: bytes written so far out of the bytes the
    save's data files take (tensor bytes plus each item's ``torch.save`` header, in whole
    4096-byte blocks).
    """
    if not (isinstance(interval_s, (int, float)) and interval_s > 0):
        raise InvalidArgumentError(f"interval_s must be a positive number, got {interval_s!r}")
    handle = target.last if hasattr(target, "last") and not hasattr(target, "done") else target
    if handle is None or not (hasattr(handle, "done") and hasattr(handle, "wait")):
        raise InvalidArgumentError(
            "save_progress needs a SaveHandle or an AsyncWriter that has started a save, got "
            f"{type(target).__name__}" + (" with no save" if handle is None else ""))
    from tqdm.auto import tqdm

    first = handle.timeline
    name = desc if desc is not None else (first.path.rstrip("/").rsplit("/", 1)[-1] or "save")
    kwargs = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "desc": name,
              **tqdm_kwargs}
    written, total = handle.progress()
    bar = tqdm(total=max(total, first.assignment.nbytes, 1), **kwargs)
    try:
        while not handle.done():
            written, total = handle.progress()
            if total and total != bar.total:
                bar.total = total
            bar.update(written - bar.n)
            time.sleep(interval_s)
        timeline: Timeline = handle.wait()
        bar.total = max(timeline.nbytes, 1)
        bar.update(timeline.nbytes - bar.n)
        bar.set_postfix_str("committed" if timeline.committed else "written", refresh=False)
    finally:
        bar.close()
    return timeline
