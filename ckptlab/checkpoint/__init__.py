"""The checkpoint model: any checkpoint, tensor first (``ckptlab.open``).

See :class:`Checkpoint` and :func:`open_checkpoint` (``ckptlab.open``).
"""

from ckptlab.checkpoint.model import Checkpoint, FileEntry, Part, TensorEntry, plain_value
from ckptlab.checkpoint.open import open_checkpoint

__all__ = ["Checkpoint", "FileEntry", "Part", "TensorEntry", "open_checkpoint", "plain_value"]
