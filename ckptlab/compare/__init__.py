"""Comparing and measuring checkpoints: :func:`diff` (what changed between two checkpoints of
any formats), :func:`stats` (each tensor's statistics) and :func:`health` (what looks wrong).

``ckptlab.diff`` and ``ckptlab.stats`` are these; ``ckptlab diff A B`` and ``ckptlab stats
PATH`` their commands.
"""

from ckptlab.compare._diff import CheckpointDiff, TensorDiff, diff
from ckptlab.compare._stats import TensorStats, health, stats

__all__ = ["CheckpointDiff", "TensorDiff", "TensorStats", "diff", "health", "stats"]
