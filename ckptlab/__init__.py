"""ckptlab: see and use PyTorch checkpoint internals.

The public API is what ``__all__`` lists; everything else is private.
"""

from ckptlab import errors, samples
from ckptlab._inspect import inspect
from ckptlab.checkpoint import Checkpoint, FileEntry, Part, TensorEntry
from ckptlab.checkpoint import open_checkpoint as open
from ckptlab.errors import (
    ArchiveError,
    CkptlabError,
    CorruptArchiveError,
    InvalidArgumentError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
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

# imported on first use: viz and widgets need the [widgets] extra, gds imports torch
_LAZY_MODULES = ("gds", "plan", "viz", "widgets", "write")


def __getattr__(name: str) -> object:
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"ckptlab.{name}")
    raise AttributeError(f"module 'ckptlab' has no attribute {name!r}")
