"""Writing checkpoints: bucket assignment (pure), an async DCP StorageWriter, save timelines.

``import ckptlab.write`` does not import torch; :class:`AsyncWriter` (a subclass of torch's
``StorageWriter``) is loaded on first use.

What a save through :class:`AsyncWriter` does, in order, and the module that does it:

1. ``prepare_local_plan`` / ``prepare_global_plan`` pick the data file names
   (:mod:`~ckptlab.write._files`: the next *generation* in a directory that holds a
   checkpoint, so the committed one is never written over);
2. ``write_data`` (its work: :mod:`~ckptlab.write._save`) assigns the items to buckets
   (:mod:`~ckptlab.write.buckets`), places each at a 4096-aligned offset of its bucket's
   file (:mod:`~ckptlab.write._placement`), hands the files to persistent worker threads
   (:mod:`~ckptlab.write._worker`, which open their files at once and write through
   :mod:`ckptlab._io` once the copy is done), copies the tensors into reused page-aligned,
   huge-page backed staging memory (:mod:`~ckptlab.write._staging`) and returns;
3. ``finish`` pickles the metadata and commits in the background
   (:mod:`~ckptlab.write._commit`): every rank reports through marker files, and the
   coordinator renames ``.metadata`` in only after every bucket of every rank succeeded,
   then removes the files it no longer refers to;
4. :meth:`AsyncWriter.wait` (or the :class:`SaveHandle`, :mod:`~ckptlab.write._state`)
   returns the :class:`Timeline` or raises :class:`~ckptlab.errors.WriterError`.

Examples
--------
>>> import torch.distributed.checkpoint as dcp                      # doctest: +SKIP
>>> from ckptlab.write import AsyncWriter                           # doctest: +SKIP
>>> writer = AsyncWriter("ckpt/step_100")                           # doctest: +SKIP
>>> dcp.save(state_dict, storage_writer=writer)                     # doctest: +SKIP
>>> writer.wait().nbytes                    # committed, or raises WriterError  # doctest: +SKIP
"""

from ckptlab._lazy import lazy_attributes
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

__getattr__, __dir__ = lazy_attributes(__name__, globals(), {
    "AsyncWriter": "ckptlab.write.writer:AsyncWriter",
    "SaveHandle": "ckptlab.write.writer:SaveHandle",
})
