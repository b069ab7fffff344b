"""What every view needs: a layout from whatever the user has, and small HTML tables."""

from __future__ import annotations

import html
import os
from typing import Any

from ckptlab.errors import InvalidArgumentError
from ckptlab.format import ArchiveLayout, inspect
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


def summary_html(layout: ArchiveLayout) -> str:
    """One line: file, size, records, storages, tensors, alignment, overhead."""
    name = html.escape(layout.path.rsplit("/", 1)[-1])
    pct = 100 * layout.overhead_nbytes / max(layout.file_nbytes, 1)
    return (f'<div class="ckptlab-summary"><b>{name}</b> · {layout.format} · '
            f"{human_nbytes(layout.file_nbytes)} · {len(layout.records)} records · "
            f"{len(layout.storages)} storages · {len(layout.tensors)} tensors · "
            f"alignment {layout.alignment} · overhead {human_nbytes(layout.overhead_nbytes)} "
            f"({pct:.2f}%), FB padding {human_nbytes(layout.padding_nbytes)}"
            f"{' · zip64' if layout.zip64 else ''}</div>")


def item_tensor_rows(layout: ArchiveLayout, record_name: str) -> list[list[Any]]:
    """Rows (path, dtype, shape, stride, storage_offset) of the tensors viewing a record."""
    keys = {s.key for s in layout.storages if s.record == record_name}
    return [[".".join(map(str, t.path)), t.dtype, list(t.shape), list(t.stride),
             t.storage_offset] for t in layout.tensors if t.storage_key in keys]
