"""ckptlab: see and use PyTorch checkpoint internals.

The public API is what ``__all__`` lists; everything else is private.

``import ckptlab`` imports the public names at once, except when it starts the ``ckptlab``
command (``python -m ckptlab``, or the console script): then each is imported on first use
(module ``__getattr__``), so ``--version`` and argument errors answer without compiling the
format and planning code, and no verb loads numpy or torch before it needs them.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ckptlab import errors
from ckptlab._lazy import lazy_attributes
from ckptlab.errors import (
    ArchiveError,
    CkptlabError,
    CorruptArchiveError,
    InvalidArgumentError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from ckptlab import gds, plan, samples, viz, widgets, write
    from ckptlab._inspect import inspect
    from ckptlab.checkpoint import Checkpoint, FileEntry, Part, TensorEntry
    from ckptlab.checkpoint import open_checkpoint as open
    from ckptlab.format import (
        AlignmentCost,
        ArchiveLayout,
        Record,
        Segment,
        SegmentKind,
        StorageInfo,
        StorageOffsets,
        TensorInfo,
        alignment_costs,
        archive_name_for,
        predict_layout,
        realign,
        storage_offsets,
    )

__version__ = "0.1.0"

__all__ = [
    "AlignmentCost",
    "ArchiveError",
    "ArchiveLayout",
    "Checkpoint",
    "CkptlabError",
    "CorruptArchiveError",
    "FileEntry",
    "InvalidArgumentError",
    "Part",
    "Record",
    "Segment",
    "SegmentKind",
    "StorageInfo",
    "StorageOffsets",
    "TensorEntry",
    "TensorInfo",
    "TruncatedArchiveError",
    "UnsupportedFormatError",
    "__version__",
    "alignment_costs",
    "archive_name_for",
    "errors",
    "gds",
    "inspect",
    "open",
    "plan",
    "predict_layout",
    "realign",
    "samples",
    "storage_offsets",
    "viz",
    "widgets",
    "write",
]

# imported on first use: viz and widgets need the [widgets] extra, gds imports torch (and
# when the command starts, all of them, format and checkpoint too)
_LAZY_MODULES = ("checkpoint", "format", "gds", "plan", "samples", "viz", "widgets", "write")
# name -> "module:attribute", imported on first use
_LAZY_NAMES = {
    "inspect": "ckptlab._inspect:inspect",
    "open": "ckptlab.checkpoint:open_checkpoint",
    **{name: f"ckptlab.checkpoint:{name}" for name in ("Checkpoint", "FileEntry", "Part",
                                                       "TensorEntry")},
    **{name: f"ckptlab.format:{name}" for name in (
        "AlignmentCost", "ArchiveLayout", "Record", "Segment", "SegmentKind", "StorageInfo",
        "StorageOffsets", "TensorInfo", "alignment_costs", "archive_name_for",
        "predict_layout", "realign", "storage_offsets")},
}

__getattr__, __dir__ = lazy_attributes(
    __name__, globals(), {**{m: f"ckptlab.{m}" for m in _LAZY_MODULES}, **_LAZY_NAMES})


def _starting_the_command() -> bool:
    """Whether this import starts the command: ``python -m`` sets ``sys.argv[0]`` to "-m"
    while it imports the package; the console script is named ``ckptlab``."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) in ("ckptlab", "ckptlab.exe")


if not _starting_the_command():  # a library import: every public name now, as always
    from ckptlab import samples
    for _name in _LAZY_NAMES:
        __getattr__(_name)
    del _name
