"""Pure figure builders: core objects in, plotly figures (or HTML) out; no widget state, no I/O.

Every builder returns a figure whose ``layout.meta`` says what it shows, so tests (and
widgets) can check the data without a browser.

Every public name, and every submodule, is imported on first use
(:func:`ckptlab._lazy.lazy_attributes`): ``import ckptlab.viz`` imports neither plotly nor the
figure modules, so a program that needs one builder (the served app's first page needs only
``hex_html`` and none of plotly) pays for that one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptlab._lazy import lazy_attributes

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
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
    from ckptlab.viz.compare import (
        DiffBrowser,
        diff_figure,
        diff_table_html,
        health_html,
        hist_figure,
        stats_table_html,
        steps_figure,
    )
    from ckptlab.viz.gds import block_classes, blockmap_figure, transfer_figure
    from ckptlab.viz.hexview import hex_html
    from ckptlab.viz.plan import (
        cache_timeline_figure,
        rank_bytes_figure,
        rank_colors,
        reshard_figure,
        shard_map_figure,
    )
    from ckptlab.viz.report import report_html
    from ckptlab.viz.tensors import storage_figure, tensor_span
    from ckptlab.viz.write import bucket_figure, timeline_figure

# module -> the public names it defines (imported on first use)
_MODULES = {
    "ckptlab.viz._style": ("KIND_COLORS", "KIND_LABELS"),
    "ckptlab.viz.alignment": ("alignment_figure",),
    # comparing and measuring (ckptlab.compare)
    "ckptlab.viz.compare": ("DiffBrowser", "diff_figure", "diff_table_html", "health_html",
                            "hist_figure", "stats_table_html", "steps_figure"),
    "ckptlab.viz.bytemap": ("ByteMap", "bytemap_figure", "bytemap_marks", "bytemap_trace",
                            "files_figure", "highlight_shapes", "overhead_figure",
                            "update_bytemap"),
    "ckptlab.viz.checkpoint": ("TensorTable", "checkpoint_summary", "dtype_figure",
                               "dtype_totals", "filter_tensors", "module_tree", "query_tensors",
                               "sort_tensors", "tensor_table", "treemap_figure"),
    "ckptlab.viz.gds": ("block_classes", "blockmap_figure", "transfer_figure"),
    "ckptlab.viz.hexview": ("hex_html",),
    "ckptlab.viz.report": ("report_html",),
    "ckptlab.viz.tensors": ("storage_figure", "tensor_span"),
    # async writing views (ckptlab.write)
    "ckptlab.viz.write": ("bucket_figure", "timeline_figure"),
    # distributed planning views (ckptlab.plan)
    "ckptlab.viz.plan": ("cache_timeline_figure", "rank_bytes_figure", "rank_colors",
                         "reshard_figure", "shard_map_figure"),
}
_SUBMODULES = ("alignment", "bytemap", "checkpoint", "compare", "gds", "hexview", "plan",
               "report", "tensors", "write")

__all__ = [
    "KIND_COLORS",
    "KIND_LABELS",
    "ByteMap",
    "DiffBrowser",
    "TensorTable",
    "alignment_figure",
    "block_classes",
    "blockmap_figure",
    "bucket_figure",
    "bytemap_figure",
    "bytemap_marks",
    "bytemap_trace",
    "cache_timeline_figure",
    "checkpoint_summary",
    "diff_figure",
    "diff_table_html",
    "dtype_figure",
    "dtype_totals",
    "files_figure",
    "filter_tensors",
    "health_html",
    "hex_html",
    "highlight_shapes",
    "hist_figure",
    "module_tree",
    "overhead_figure",
    "query_tensors",
    "rank_bytes_figure",
    "rank_colors",
    "report_html",
    "reshard_figure",
    "shard_map_figure",
    "sort_tensors",
    "stats_table_html",
    "steps_figure",
    "storage_figure",
    "tensor_span",
    "tensor_table",
    "timeline_figure",
    "transfer_figure",
    "treemap_figure",
    "update_bytemap",
]

_LAZY_NAMES = {name: f"{module}:{name}" for module, names in _MODULES.items() for name in names}
_LAZY_NAMES.update({sub: f"ckptlab.viz.{sub}" for sub in _SUBMODULES})

if sorted(__all__) != sorted(_LAZY_NAMES.keys() - set(_SUBMODULES)):  # one list, kept in step
    raise ImportError("ckptlab.viz: __all__ and the lazy name table disagree")

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_NAMES)
