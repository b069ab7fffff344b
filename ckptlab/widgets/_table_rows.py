"""The tensor table's rows, without panel: the served app's table and the quick first page
(:mod:`ckptlab.widgets.quick`) read the same frame, and search and sort it with the one tensor
query (:class:`~ckptlab.checkpoint.query.TensorCatalog`).

:func:`tensor_frame` is one pandas DataFrame per checkpoint, shared by every session;
:data:`SORT_KEY_OF_COLUMN` says which query key sorts by a column. Nothing here imports
panel, bokeh or plotly: the quick page serves these rows before panel is imported.
"""

from __future__ import annotations

import pandas as pd

from ckptlab.checkpoint._cache import CheckpointIndex
from ckptlab.errors import InvalidArgumentError

__all__ = ["COLUMNS", "SORT_KEY_OF_COLUMN", "column_sort_key", "tensor_frame"]

COLUMNS = ("name", "dtype", "shape", "kind", "bytes", "parameters", "file", "offset")


def tensor_frame(index: CheckpointIndex) -> pd.DataFrame:
    """The table's rows: one per tensor, in the checkpoint's order (row ``i`` is tensor ``i``).

    ``offset`` is -1 for a tensor without bytes; ``file`` is the file of its first part.
    """
    files = [f[0] for f in index.files] + [""]
    return pd.DataFrame({
        "name": pd.Series(index.names, dtype=object),
        "dtype": pd.Categorical(index.dtypes),
        "shape": pd.Series(index.shapes, dtype=object),
        "kind": pd.Categorical(index.kinds),
        "bytes": pd.Series(index.nbytes, dtype="int64"),
        "parameters": pd.Series(index.parameters, dtype="int64"),
        "file": pd.Categorical([files[i] for i in index.file]),
        "offset": pd.Series(index.offset, dtype="int64"),
    }, columns=list(COLUMNS))


# the query's sort key of each sortable column (shape has none: "2x3" sorts by nothing useful)
SORT_KEY_OF_COLUMN = {"name": "name", "dtype": "dtype", "kind": "kind", "bytes": "size",
                      "parameters": "parameters", "file": "file", "offset": "offset"}


def column_sort_key(column: str) -> str:
    """The :data:`~ckptlab.checkpoint.query.SORT_KEYS` key that sorts the table by
    ``column`` (``bytes`` is ``size``; ``offset`` is file order: file, then offset).

    Raises
    ------
    InvalidArgumentError
        ``column`` is not a sortable column of the table.
    """
    key = SORT_KEY_OF_COLUMN.get(column)
    if key is None:
        raise InvalidArgumentError(f"sort: expected one of the columns "
                                   f"{', '.join(SORT_KEY_OF_COLUMN)}, got {column!r}")
    return key
