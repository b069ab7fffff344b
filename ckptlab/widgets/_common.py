"""What every view needs: a layout from whatever the user has, small HTML tables, and a
progress bar for work that may take over a second."""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Iterator
from typing import Any

from ckptlab._words import plural
from ckptlab.errors import InvalidArgumentError
from ckptlab.format import ArchiveLayout, inspect
from ckptlab.viz import ByteMap
from ckptlab.viz._style import human_nbytes

LayoutSource = ArchiveLayout | str | os.PathLike[str] | bytes


def as_layout(source: LayoutSource) -> ArchiveLayout:
    """An ArchiveLayout as is; a path or bytes inspected (safely: nothing is unpickled)."""
    if isinstance(source, ArchiveLayout):
        return source
    if isinstance(source, (str, os.PathLike, bytes, bytearray)):
        return inspect(source)
    raise InvalidArgumentError(
        f"expected an ArchiveLayout, a path or bytes of a checkpoint, got {type(source).__name__}")


PROGRESS_DELAY_S = 1.0  # a bar shows only for work still running after this long


@contextlib.contextmanager
def progress(total: int, desc: str) -> Iterator[Any]:
    """A progress bar (``tqdm.auto``: a widget in a notebook, text elsewhere) for ``total``
    steps, shown only once the work has run for ``PROGRESS_DELAY_S`` and removed when done.
    Call ``bar.update(1)`` after each step."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, delay=PROGRESS_DELAY_S, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def summary_html(layout: ArchiveLayout) -> str:
    """One line: file, size, records, storages, tensors, alignment, overhead. A layout
    :func:`~ckptlab.format.realign` or :func:`~ckptlab.format.predict_layout` made says it is
    a what-if, not a file."""
    path, what_if = layout.path, ""
    if path.startswith("<realigned from ") and path.endswith(">"):
        path = path[len("<realigned from "):-1]
        what_if = (f"what-if, not a file: as torch.save would lay it out at storage_alignment "
                   f"{layout.storage_alignment or layout.alignment} · ")
    elif path == "<predicted>":
        what_if = "what-if, not a file: the layout torch.save would write · "
    name = html.escape(path.rsplit("/", 1)[-1])
    pct = 100 * layout.overhead_nbytes / max(layout.file_nbytes, 1)
    return (f'<div class="ckptlab-summary">{what_if}<b>{name}</b> · {layout.format} · '
            f"{human_nbytes(layout.file_nbytes)} · {len(layout.records)} records · "
            f"{plural(len(layout.storages), 'storage')} · "
            f"{plural(len(layout.tensors), 'tensor')} · "
            f"alignment {layout.alignment} · overhead {human_nbytes(layout.overhead_nbytes)} "
            f"({pct:.2f}%), FB padding {human_nbytes(layout.padding_nbytes)}"
            f"{' · zip64' if layout.zip64 else ''}</div>")


def item_tensor_rows(layout: ArchiveLayout, record_name: str) -> list[list[Any]]:
    """Rows (path, dtype, shape, stride, storage_offset) of the tensors viewing a record."""
    keys = {s.key for s in layout.storages if s.record == record_name}
    return [[".".join(map(str, t.path)), t.dtype, list(t.shape), list(t.stride),
             t.storage_offset] for t in layout.tensors if t.storage_key in keys]


HEX_NBYTES = 512  # bytes of a selected item shown in the hex view (its header and first data)
MAX_LISTED = 1000  # an item list longer than this is a chore to scroll and slow to send


def item_options(bytemap: ByteMap, lo: int = 0, hi: int | None = None, *,
                 around: int | None = None, limit: int = MAX_LISTED) -> list[tuple[str, int]]:
    """(label, item) for the items with bytes in ``[lo, hi)``, at most ``limit`` of them.

    With more in view, the list is the ``limit`` items nearest ``around`` (the selection) or
    the first ones; ``around`` is always listed.
    """
    hi = bytemap.file_nbytes if hi is None else hi
    view = bytemap.items_in(lo, hi)
    if around is not None and around not in view:
        view = range(min(view.start, around), max(view.stop, around + 1))
    if len(view) > limit:
        start = view.start if around is None else max(view.start, around - limit // 2)
        start = min(start, view.stop - limit)
        view = range(start, start + limit)
    spans = bytemap.item_starts
    return [(f"#{i} {bytemap.item_names[i]} · {human_nbytes(int(spans[i + 1] - spans[i]))}", i)
            for i in view]
