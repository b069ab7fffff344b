"""torch.save zip archives (and safetensors) byte by byte: layouts, offsets, predictions."""

from ckptlab.format.inspect import detect_format, inspect, read_range
from ckptlab.format.layout import (
    ArchiveLayout,
    Record,
    Segment,
    SegmentKind,
    StorageInfo,
    TensorInfo,
)
from ckptlab.format.offsets import StorageOffsets, storage_offsets
from ckptlab.format.predict import (
    AlignmentCost,
    alignment_costs,
    archive_name_for,
    predict_layout,
    realign,
)

__all__ = [
    "AlignmentCost",
    "ArchiveLayout",
    "Record",
    "Segment",
    "SegmentKind",
    "StorageInfo",
    "StorageOffsets",
    "TensorInfo",
    "alignment_costs",
    "archive_name_for",
    "detect_format",
    "inspect",
    "predict_layout",
    "read_range",
    "realign",
    "storage_offsets",
]
