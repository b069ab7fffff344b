"""ckptlab: see and use PyTorch checkpoint internals.

The public API is what ``__all__`` lists; everything else is private.

``import ckptlab`` imports the public names at once, except when it starts the ``ckptlab``
command (``python -m ckptlab``, or the console script): then each is imported on first use
(module ``__getattr__``), so ``--version`` and argument errors answer without compiling the
format and planning code, and no verb loads numpy or torch before it needs them.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from ckptlab import errors
from ckptlab._lazy import lazy_attributes

# the root error in __all__; the common ones beside it, so `except ckptlab.ArchiveError` works
from ckptlab.errors import ArchiveError as ArchiveError
from ckptlab.errors import CkptlabError
from ckptlab.errors import CorruptArchiveError as CorruptArchiveError
from ckptlab.errors import InvalidArgumentError as InvalidArgumentError
from ckptlab.errors import TruncatedArchiveError as TruncatedArchiveError
from ckptlab.errors import UnsupportedFormatError as UnsupportedFormatError

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from ckptlab import checkpoint, format, gds, plan, samples, viz, widgets, write
    from ckptlab import dcp as dcp
    from ckptlab._inspect import inspect
    from ckptlab.checkpoint import open_checkpoint as open
    from ckptlab.compare import diff, stats
    from ckptlab.format import predict_layout, storage_offsets
    from ckptlab.safety import scan
    from ckptlab.write.convert import convert

__version__ = "0.1.0"

# The whole public surface: six verbs, the root error, the subpackages. Everything else is a
# name of its subpackage (ckptlab.format.ArchiveLayout, ckptlab.checkpoint.Checkpoint, ...).
__all__ = [
    "CkptlabError",
    "__version__",
    "checkpoint",
    "convert",
    "diff",
    "errors",
    "format",
    "gds",
    "inspect",
    "open",
    "plan",
    "predict_layout",
    "samples",
    "scan",
    "stats",
    "storage_offsets",
    "viz",
    "widgets",
    "write",
]

# imported on first use: viz and widgets need the [widgets] extra, gds imports torch (and
# when the command starts, all of them, format and checkpoint too). dcp is a
# subpackage too, reached through ckptlab.open more often than by name.
_LAZY_MODULES = ("checkpoint", "dcp", "format", "gds", "plan", "samples", "viz", "widgets",
                 "write")
# name -> "module:attribute", imported on first use
_LAZY_NAMES = {
    "convert": "ckptlab.write.convert:convert",
    "diff": "ckptlab.compare:diff",
    "inspect": "ckptlab._inspect:inspect",
    "open": "ckptlab.checkpoint:open_checkpoint",
    "predict_layout": "ckptlab.format:predict_layout",
    "scan": "ckptlab.safety:scan",
    "stats": "ckptlab.compare:stats",
    "storage_offsets": "ckptlab.format:storage_offsets",
}
# names that were top-level before the public surface was cut to __all__: still there, with a
# DeprecationWarning naming where they live now
_MOVED = {
    **{name: "ckptlab.checkpoint" for name in ("Checkpoint", "FileEntry", "Part", "TensorEntry")},
    **{name: "ckptlab.format" for name in (
        "AlignmentCost", "ArchiveLayout", "Record", "Segment", "SegmentKind", "StorageInfo",
        "StorageOffsets", "TensorInfo", "alignment_costs", "archive_name_for", "realign")},
}

_lazy_getattr, __dir__ = lazy_attributes(
    __name__, globals(), {**{m: f"ckptlab.{m}" for m in _LAZY_MODULES}, **_LAZY_NAMES})


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        return _lazy_getattr(name)
    warnings.warn(f"ckptlab.{name} moved to {home}.{name}; the top level keeps ckptlab.__all__",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


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
