"""torch.distributed.checkpoint (DCP): real checkpoint directories read safely.

The inspector, real gloo ranks and resharding read items are here; the rest of planning (write
items, plan cache, validation, the N-rank simulation) comes next (issue 4).
"""

from ckptlab.plan.metadata import DcpItem, DcpLayout, inspect_dcp, is_dcp_dir, load_metadata
from ckptlab.plan.ranks import RankError, run_ranks
from ckptlab.plan.reshard import Chunk, ReadItem, read_items, sweep_dimension
from ckptlab.plan.validate import ChunkProblem, require_valid, validate_chunks

__all__ = ["Chunk", "ChunkProblem", "DcpItem", "DcpLayout", "RankError", "ReadItem",
           "inspect_dcp", "is_dcp_dir", "load_metadata", "read_items", "require_valid",
           "run_ranks", "sweep_dimension", "validate_chunks"]
