"""A plotly ``FigureWidget`` that draws on first display in JupyterLab (every explorer's)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

__all__ = ["FigureWidget"]


class FigureWidget(go.FigureWidget):
    """A ``go.FigureWidget`` whose comm opens with the figure in its state.

    plotly's ``FigureWidget`` opens its comm in ``BaseFigure.__init__``, before it has set
    ``_widget_data`` and ``_widget_layout``, and sends those as a second message. JupyterLab
    drops a comm message that arrives while the front end is still building the model (an
    anywidget loads its module first), and plotly's view draws from the model once, when it
    is displayed: the figure then stays empty axes (-1..6) until the cell is run again. Here
    the comm opens once the figure is complete, so the first message carries everything.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._defer_open = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._defer_open = False
        self.open()

    def open(self) -> None:
        """Open the comm, unless the figure is still being built (see the class notes)."""
        if not getattr(self, "_defer_open", False):
            super().open()
