"""Byte views of storages and page-aligned host buffers, without copies where possible."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from ckptlab.errors import InvalidArgumentError


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, zero-filled host buffer whose address is page aligned (anonymous mmap).

    ``torch.empty`` buffers are only 64-byte aligned, which O_DIRECT refuses (EINVAL).
    """
    if nbytes <= 0:
        raise InvalidArgumentError(f"buffer size must be positive, got {nbytes}")
    return memoryview(mmap.mmap(-1, nbytes))


ALIGNED_STORAGE_MIN = 1 << 20  # smaller storages keep torch's allocation (one mmap each costs)


def aligned_storage(nbytes: int) -> Any:
    """A CPU ``torch.UntypedStorage`` of ``nbytes`` over page-aligned memory (an anonymous
    mmap the storage keeps alive), so O_DIRECT can read into it with no bounce copy."""
    import torch

    return torch.frombuffer(aligned_buffer(nbytes), dtype=torch.uint8).untyped_storage()


def address_of(view: memoryview) -> int:
    """The address of the first byte of a contiguous memoryview (read-only ones too)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


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
            storage = storage._untyped_storage  # .untyped() warns that TypedStorage is deprecated
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


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def populate(storage: Any) -> bool:
    """Fault in a CPU storage's pages ahead of use (``madvise(MADV_POPULATE_WRITE)``).

    Fresh ``torch.empty`` memory is faulted page by page on first write, which costs as much
    as the disk read on some machines; doing it on another thread while the disk works takes
    it off the critical path. Returns False where the kernel cannot (the copy then faults the
    pages itself, as it would anyway).
    """
    import ctypes

    nbytes = storage.nbytes()
    if storage.device.type != "cpu" or nbytes < (1 << 20):
        return False
    start = -(-storage.data_ptr() // 4096) * 4096
    end = (storage.data_ptr() + nbytes) // 4096 * 4096
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, _MADV_POPULATE_WRITE) == 0
