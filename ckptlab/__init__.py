"""ckptlab: see and use PyTorch checkpoint internals.

The public API is what ``__all__`` lists; everything else is private.
"""

from ckptlab import errors, samples
from ckptlab.errors import (
    ArchiveError,
    CkptlabError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format import (
    ArchiveLayout,
    Record,
    Segment,
    SegmentKind,
    StorageInfo,
    StorageOffsets,
    TensorInfo,
    archive_name_for,
    inspect,
    predict_layout,
    storage_offsets,
)

__version__ = "0.1.0"

__all__ = [
    "ArchiveError",
    "ArchiveLayout",
    "CkptlabError",
    "CorruptArchiveError",
    "Record",
    "Segment",
    "SegmentKind",
    "StorageInfo",
    "StorageOffsets",
    "TensorInfo",
    "TruncatedArchiveError",
    "UnsupportedFormatError",
    "__version__",
    "archive_name_for",
    "errors",
    "inspect",
    "predict_layout",
    "samples",
    "storage_offsets",
]
