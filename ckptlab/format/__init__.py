"""torch.save zip archives (and safetensors) byte by byte: layouts, offsets, predictions."""

from ckptlab.format.inspect import detect_format, inspect
from ckptlab.format.layout import (
    ArchiveLayout,
    Record,
    Segment,
    SegmentKind,
    StorageInfo,
    TensorInfo,
)
from ckptlab.format.offsets import StorageOffsets, storage_offsets
from ckptlab.format.predict import archive_name_for, predict_layout

__all__ = [
    "ArchiveLayout",
    "Record",
    "Segment",
    "SegmentKind",
    "StorageInfo",
    "StorageOffsets",
    "TensorInfo",
    "archive_name_for",
    "detect_format",
    "inspect",
    "predict_layout",
    "storage_offsets",
]
