"""GPUDirect Storage, the PyTorch tutorial flow, behind one API that also runs without a GPU.

``open(path, flags, backend="auto")`` gives a handle with ``save_storage`` / ``load_storage``
over torch.cuda.gds (cuFile), kvikio, O_DIRECT or POSIX; the handle says which path ran.
"""

from ckptlab.gds.handle import BACKENDS, BackendStatus, GdsHandle, backend_status, open
from ckptlab.gds.readiness import Readiness, readiness
from ckptlab.gds.tutorial import TransferReport, load, save, storages_in_save_order

__all__ = [
    "BACKENDS",
    "BackendStatus",
    "GdsHandle",
    "Readiness",
    "TransferReport",
    "backend_status",
    "load",
    "open",
    "readiness",
    "save",
    "storages_in_save_order",
]
