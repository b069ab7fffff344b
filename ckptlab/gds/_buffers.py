"""Byte views of storages and page-aligned host buffers, without copies where possible."""

from __future__ import annotations

from typing import Any

from ckptlab._io import address_of, aligned_buffer
from ckptlab._io import populate as _populate
from ckptlab.errors import InvalidArgumentError

__all__ = ["ALIGNED_STORAGE_MIN", "address_of", "aligned_buffer", "aligned_storage",
           "byte_tensor", "populate", "storage_view"]


ALIGNED_STORAGE_MIN = 1 << 20  # smaller storages keep torch's allocation (one mmap each costs)


def aligned_storage(nbytes: int, *, huge_pages: bool = False) -> Any:
    """A CPU ``torch.UntypedStorage`` of ``nbytes`` over page-aligned memory (an anonymous
    mmap the storage keeps alive), so O_DIRECT can read into it with no bounce copy;
    ``huge_pages`` as for :func:`ckptlab._io.aligned_buffer`."""
    import torch

    buf = aligned_buffer(nbytes, huge_pages=huge_pages)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def storage_view(storage: Any) -> memoryview:
    """A writable byte view of a CPU ``torch.UntypedStorage`` (shares its memory).

    Raises
    ------
    InvalidArgumentError
        For a storage that is not on the CPU (copy it to the host first).
    """
    import torch

    if not isinstance(storage, torch.UntypedStorage):
        if isinstance(storage, torch.TypedStorage):
            from ckptlab._torch_compat import untyped_storage

            storage = untyped_storage(storage)  # .untyped() warns that TypedStorage is deprecated
        else:
            raise InvalidArgumentError(
                f"expected a torch.UntypedStorage, got {type(storage).__name__}")
    if storage.device.type != "cpu":
        raise InvalidArgumentError(
            f"a byte view needs a CPU storage, got one on {storage.device}")
    if storage.nbytes() == 0:
        return memoryview(bytearray())
    return memoryview(byte_tensor(storage).numpy()).cast("B")


def byte_tensor(storage: Any) -> Any:
    """A 1-D uint8 tensor over all of ``storage`` (any device), sharing its memory."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def populate(storage: Any) -> bool:
    """Fault in a CPU storage's pages ahead of use (see :func:`ckptlab._io.populate`).

    Returns False for device storages, storages under 1 MiB, or where the kernel cannot.
    """
    nbytes = storage.nbytes()
    if storage.device.type != "cpu" or nbytes < (1 << 20):
        return False
    return _populate(storage.data_ptr(), nbytes)
