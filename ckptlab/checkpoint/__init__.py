"""The checkpoint model: any checkpoint, tensor first (``ckptlab.open``).

See :class:`Checkpoint` and :func:`open_checkpoint` (``ckptlab.open``); the one tensor query
every view uses is :class:`TensorQuery` and :func:`select_tensors`
(:mod:`ckptlab.checkpoint.query`); the ``inspect --json`` object is :func:`inspect_json`.
"""

from ckptlab.checkpoint._json import inspect_json
from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    Part,
    Scratch,
    TensorEntry,
    plain_value,
)
from ckptlab.checkpoint.open import as_checkpoint, open_checkpoint
from ckptlab.checkpoint.query import TensorCatalog, TensorQuery, TensorSelection, select_tensors

__all__ = ["Checkpoint", "FileEntry", "Part", "Scratch", "TensorCatalog", "TensorEntry",
           "TensorQuery", "TensorSelection", "as_checkpoint", "inspect_json", "open_checkpoint",
           "plain_value", "select_tensors"]
