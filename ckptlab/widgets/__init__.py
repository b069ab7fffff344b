"""Views over core objects: notebook widgets (ipywidgets + plotly) and the served panel app.

Nothing here parses, plans or bins: that lives in the core packages and in ``ckptlab.viz``.
"""

from ckptlab.widgets.explorer import AlignmentExplorer, LayoutExplorer

__all__ = ["AlignmentExplorer", "LayoutExplorer"]
