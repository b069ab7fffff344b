"""Views over core objects: notebook widgets (ipywidgets + plotly) and the served panel app.

Nothing here parses, plans or bins: that lives in the core packages and in ``ckptlab.viz``.

Every public name is imported on first use (:func:`ckptlab._lazy.lazy_attributes`): the
served app (``ckptlab.widgets.app``, panel) then starts without ipywidgets, IPython and the
notebook explorers, and a notebook that uses one explorer imports only its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptlab._lazy import lazy_attributes

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from ckptlab.widgets.compare import DiffExplorer, StatsExplorer
    from ckptlab.widgets.explorer import AlignmentExplorer, LayoutExplorer
    from ckptlab.widgets.plan import PlanExplorer
    from ckptlab.widgets.write import BucketExplorer, TimelineView, save_progress, sized_items

# name -> "module:attribute", imported on first use
_LAZY_NAMES = {
    "AlignmentExplorer": "ckptlab.widgets.explorer:AlignmentExplorer",
    "LayoutExplorer": "ckptlab.widgets.explorer:LayoutExplorer",
    # comparing and measuring views (ckptlab.compare)
    "DiffExplorer": "ckptlab.widgets.compare:DiffExplorer",
    "StatsExplorer": "ckptlab.widgets.compare:StatsExplorer",
    # async writing views (ckptlab.write)
    "BucketExplorer": "ckptlab.widgets.write:BucketExplorer",
    "TimelineView": "ckptlab.widgets.write:TimelineView",
    "save_progress": "ckptlab.widgets.write:save_progress",
    "sized_items": "ckptlab.widgets.write:sized_items",
    # distributed planning views (ckptlab.plan)
    "PlanExplorer": "ckptlab.widgets.plan:PlanExplorer",
}

__all__ = ["AlignmentExplorer", "BucketExplorer", "DiffExplorer", "LayoutExplorer",
           "PlanExplorer", "StatsExplorer", "TimelineView", "save_progress", "sized_items"]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_NAMES)
