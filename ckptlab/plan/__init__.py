"""torch.distributed.checkpoint (DCP): real checkpoint directories read safely.

Planning primitives, the plan cache, resharding and the N-rank simulation come next
(issue 4); this package starts with the inspector.
"""

from ckptlab.plan.metadata import DcpItem, DcpLayout, inspect_dcp, is_dcp_dir, load_metadata
from ckptlab.plan.ranks import RankError, run_ranks

__all__ = ["DcpItem", "DcpLayout", "RankError", "inspect_dcp", "is_dcp_dir", "load_metadata",
           "run_ranks"]
