"""Comparing and measuring checkpoints: :func:`diff` (what changed between two checkpoints of
any formats), :func:`step_diffs` (each save of a training run against the one before),
:func:`stats` (each tensor's statistics), :func:`health` (what looks wrong) and
:func:`difference` (the statistics of one tensor's changes).

``ckptlab.diff`` and ``ckptlab.stats`` are these; ``ckptlab diff A B`` and ``ckptlab stats
PATH`` their commands.
"""

from ckptlab.compare._diff import CheckpointDiff, TensorDiff, diff, step_diffs
from ckptlab.compare._stats import TensorStats, difference, health, stats

__all__ = ["CheckpointDiff", "TensorDiff", "TensorStats", "diff", "difference", "health",
           "stats", "step_diffs"]
