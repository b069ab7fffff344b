"""GPUDirect Storage, the PyTorch tutorial flow, behind one API that also runs without a GPU.

``open(path, flags, backend="auto")`` gives a handle with ``save_storage`` / ``load_storage``
over torch.cuda.gds (cuFile), kvikio, O_DIRECT or POSIX; the handle says which path ran.
``save(obj, path)`` and ``load(path)`` (:mod:`ckptlab.gds.api`) run the whole tutorial flow.
"""

from ckptlab.gds.api import LoadResult, TransferReport, load, save, storages_in_save_order
from ckptlab.gds.handle import BACKENDS, BackendStatus, GdsHandle, backend_status, open
from ckptlab.gds.readiness import Readiness, readiness

__all__ = [
    "BACKENDS",
    "BackendStatus",
    "GdsHandle",
    "LoadResult",
    "Readiness",
    "TransferReport",
    "backend_status",
    "load",
    "open",
    "readiness",
    "save",
    "storages_in_save_order",
]
