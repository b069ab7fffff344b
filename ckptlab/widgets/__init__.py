"""Views over core objects: notebook widgets (ipywidgets + plotly) and the served panel app.

Nothing here parses, plans or bins: that lives in the core packages and in ``ckptlab.viz``.
"""

from ckptlab.widgets.explorer import AlignmentExplorer, LayoutExplorer

__all__ = ["AlignmentExplorer", "LayoutExplorer"]

# async writing views (ckptlab.write)
from ckptlab.widgets.write import BucketExplorer, TimelineView, save_progress, sized_items

__all__ += ["BucketExplorer", "TimelineView", "save_progress", "sized_items"]

# distributed planning views (ckptlab.plan)
from ckptlab.widgets.plan import PlanExplorer  # noqa: E402

__all__ += ["PlanExplorer"]
