"""Reading torch.distributed.checkpoint (DCP) directories, without running their pickles.

How a DCP directory is read, in order:

1. :func:`is_dcp_dir`: a directory with a ``.metadata`` file (:func:`is_dcp_shards_dir`: the
   ``shard-*.safetensors`` files ``HuggingFaceStorageWriter(save_distributed=True)`` writes
   without one).
2. ``.metadata``, a pickle (:mod:`ckptlab.dcp.metadata`), run by ckptlab's one bounded
   pickle interpreter (:mod:`ckptlab.format._unpickle`) with DCP's handlers, for one of two
   consumers: typed columns, one row per item (:mod:`ckptlab.dcp.columns`), or, for what the
   columns do not represent and whenever DCP's own ``Metadata`` object is wanted
   (:func:`load_metadata`), a field-by-field converter over an allow-list of DCP classes
   (:mod:`ckptlab.dcp._decode`). Nothing the file names is imported or called.
3. The data files' items (:mod:`ckptlab.dcp.items`): each item's own layout (a torch.save
   zip, a file's safetensors blob, a zstd frame), read through a window on its file without
   the tensor bytes, and shared between items through templates (:class:`~ckptlab.dcp.items.
   ItemLayouts`); zstd items inflated, bounded.
4. :func:`inspect_dcp` puts them together as a :class:`DcpLayout` (:mod:`ckptlab.dcp.layout`):
   every :class:`DcpItem` with its chunk's place in the global tensor and in its file.

The directory is a :class:`ckptlab.source.Tree`: behind a URL the same reads run over ranged
requests (the item reads of :class:`~ckptlab.dcp.items.ItemLayouts` reading ahead over the
items' heads, a request being costly).

What is built from them lives elsewhere: the tensor-first checkpoint
(``ckptlab.open(DIR)``: :mod:`ckptlab.checkpoint`), and planning, resharding and simulation
of saves and loads (:mod:`ckptlab.plan`).
"""

from ckptlab.dcp.layout import DcpItem, DcpLayout, inspect_dcp, is_dcp_shards_dir
from ckptlab.dcp.metadata import METADATA, is_dcp_dir, load_metadata, metadata_of

__all__ = ["METADATA", "DcpItem", "DcpLayout", "inspect_dcp", "is_dcp_dir", "is_dcp_shards_dir",
           "load_metadata", "metadata_of"]
