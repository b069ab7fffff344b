"""Writing checkpoints: bucket assignment (pure), an async DCP StorageWriter, save timelines.

``import ckptlab.write`` does not import torch; :class:`AsyncWriter` (a subclass of torch's
``StorageWriter``) is loaded on first use.

Examples
--------
>>> import torch.distributed.checkpoint as dcp                      # doctest: +SKIP
>>> from ckptlab.write import AsyncWriter                           # doctest: +SKIP
>>> writer = AsyncWriter("ckpt/step_100")                           # doctest: +SKIP
>>> dcp.save(state_dict, storage_writer=writer)                     # doctest: +SKIP
>>> writer.wait().nbytes                    # committed, or raises WriterError  # doctest: +SKIP
"""

from typing import Any

from ckptlab.write.buckets import (
    Bucket,
    BucketAssignment,
    SizedItem,
    assign_buckets,
    item_nbytes,
    sized_items,
)
from ckptlab.write.timeline import PHASES, Timeline, TimelineEvent

__all__ = ["PHASES", "AsyncWriter", "Bucket", "BucketAssignment", "SaveHandle", "SizedItem",
           "Timeline", "TimelineEvent", "assign_buckets", "item_nbytes", "sized_items"]

_LAZY = {"AsyncWriter", "SaveHandle"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ckptlab.write import writer

        return getattr(writer, name)
    raise AttributeError(f"module 'ckptlab.write' has no attribute {name!r}")
