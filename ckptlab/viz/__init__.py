"""Pure figure builders: core objects in, plotly figures (or HTML) out; no widget state, no I/O.

Every builder returns a figure whose ``layout.meta`` says what it shows, so tests (and
widgets) can check the data without a browser.
"""

from ckptlab.viz._style import KIND_COLORS, KIND_LABELS
from ckptlab.viz.alignment import alignment_figure
from ckptlab.viz.bytemap import (
    ByteMap,
    bytemap_figure,
    bytemap_marks,
    bytemap_trace,
    files_figure,
    highlight_shapes,
    overhead_figure,
    update_bytemap,
)
from ckptlab.viz.checkpoint import (
    TensorTable,
    checkpoint_summary,
    dtype_figure,
    dtype_totals,
    filter_tensors,
    module_tree,
    query_tensors,
    sort_tensors,
    tensor_table,
    treemap_figure,
)
from ckptlab.viz.gds import block_classes, blockmap_figure, transfer_figure
from ckptlab.viz.hexview import hex_html
from ckptlab.viz.report import report_html
from ckptlab.viz.tensors import storage_figure, tensor_span

__all__ = [
    "KIND_COLORS",
    "KIND_LABELS",
    "ByteMap",
    "TensorTable",
    "alignment_figure",
    "block_classes",
    "blockmap_figure",
    "bytemap_figure",
    "bytemap_marks",
    "bytemap_trace",
    "checkpoint_summary",
    "dtype_figure",
    "dtype_totals",
    "files_figure",
    "filter_tensors",
    "hex_html",
    "highlight_shapes",
    "module_tree",
    "overhead_figure",
    "query_tensors",
    "report_html",
    "sort_tensors",
    "storage_figure",
    "tensor_span",
    "tensor_table",
    "transfer_figure",
    "treemap_figure",
    "update_bytemap",
]

# async writing views (ckptlab.write)
from ckptlab.viz.write import bucket_figure, timeline_figure

__all__ += ["bucket_figure", "timeline_figure"]

# distributed planning views (ckptlab.plan)
from ckptlab.viz.plan import (  # noqa: E402
    cache_timeline_figure,
    rank_bytes_figure,
    rank_colors,
    reshard_figure,
    shard_map_figure,
)

__all__ += ["cache_timeline_figure", "rank_bytes_figure", "rank_colors", "reshard_figure",
            "shard_map_figure"]
