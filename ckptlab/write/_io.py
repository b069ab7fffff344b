"""Earlier home of the async writer's byte movers, kept so old imports work.

Staging memory is :mod:`ckptlab.write._staging`, placement :mod:`ckptlab.write._placement`,
the workers :mod:`ckptlab.write._worker`, and the direct I/O itself :mod:`ckptlab._io`.
"""

from __future__ import annotations

from ckptlab._io import BLOCK, align_up
from ckptlab.write._placement import Extent, FileJob, place_item
from ckptlab.write._staging import SLAB_MIN_NBYTES, StagingArena, StagingState
from ckptlab.write._worker import (
    BOUNCE_NBYTES,
    DIRECT_MIN_NBYTES,
    WRITE_NBYTES,
    IoHook,
    WorkerPool,
)
from ckptlab.write._worker import FileWriter as _FileWriter

Segment = Extent  # its name before the split (one Segment is ckptlab.format.layout.Segment)

__all__ = ["BLOCK", "BOUNCE_NBYTES", "DIRECT_MIN_NBYTES", "SLAB_MIN_NBYTES", "WRITE_NBYTES",
           "FileJob", "IoHook", "Segment", "StagingArena", "StagingState", "WorkerPool",
           "_FileWriter", "align_up", "place_item"]
