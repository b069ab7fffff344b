"""Comparing checkpoints: :func:`diff` (what changed between two checkpoints of any formats).

``ckptlab.diff`` is this module's :func:`diff`; ``ckptlab diff A B`` its command.
"""

from ckptlab.compare.diff import CheckpointDiff, TensorDiff, diff

__all__ = ["CheckpointDiff", "TensorDiff", "diff"]
