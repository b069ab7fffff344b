"""Earlier home of :func:`ckptlab.gds.save` / :func:`~ckptlab.gds.load`, now
:mod:`ckptlab.gds.api`; kept so ``from ckptlab.gds.tutorial import ...`` still works."""

from ckptlab.gds.api import (
    GDS_ALIGNMENT,
    LoadResult,
    TransferReport,
    load,
    save,
    storages_in_save_order,
)

__all__ = ["GDS_ALIGNMENT", "LoadResult", "TransferReport", "load", "save",
           "storages_in_save_order"]
