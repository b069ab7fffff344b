"""Helpers shared by the tests under tests/gds/.

Import them with ``from gds_support import ...`` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptlab import gds
from ckptlab.testing import strategies as cst

BLOCK = 4096


def status_of(name: str) -> gds.BackendStatus:
    """backend_status() of one backend."""
    return {s.name: s for s in gds.backend_status()}[name]


def require_backend(name: str, directory: Any = None) -> None:
    """Skip, with backend_status()'s reason, where backend ``name`` cannot run (on files in
    ``directory``, when given: cuFile refuses some filesystems, tmpfs among them)."""
    status = status_of(name)
    if not status.available:
        pytest.skip(f"backend {name!r} cannot run here: {status.reason}")
    if directory is not None:
        from ckptlab.gds.handle import _CLASSES

        probe = getattr(_CLASSES[name], "status", None)  # the cuFile backends have one
        ok, why = probe(str(directory)) if probe else (True, "")
        if not ok:
            pytest.skip(f"backend {name!r} cannot run on files in {directory}: {why}")


def storage_bytes(storage: torch.UntypedStorage) -> bytes:
    n = storage.nbytes()
    if n == 0:
        return b""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))
    return flat.cpu().numpy().tobytes()


def get_path(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


_MISSING = object()


def assert_same_object(got: Any, want: Any, path: tuple[Any, ...] = ()) -> None:
    """Same structure, same plain values, and tensors with the same metadata and storage
    bytes (bit-exact: NaNs and -0.0 included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert isinstance(got, torch.nn.Parameter) == isinstance(want, torch.nn.Parameter), path
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.requires_grad) == (
            want.dtype, want.shape, want.stride(), want.storage_offset(),
            want.requires_grad), path
        assert storage_bytes(got.untyped_storage()) == storage_bytes(want.untyped_storage()), path
        assert getattr(got, "note", _MISSING) == getattr(want, "note", _MISSING), path
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want), path
        for key in want:
            assert_same_object(got[key], want[key], (*path, key))
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_object(g, w, (*path, i))
    else:
        assert type(got) is type(want) and got == want, path


def storage_groups(obj: Any) -> list[list[str]]:
    """Paths of the tensors with bytes, grouped by the storage they view (which tensors share
    memory). 0-byte storages are left out: torch.load itself gives two tensors that shared
    one 0-byte storage a storage each."""
    groups: dict[int, list[str]] = {}
    for path, t in cst.iter_tensors(obj):
        if t.untyped_storage().nbytes():
            groups.setdefault(t.untyped_storage()._cdata, []).append(repr(path))
    return sorted(sorted(g) for g in groups.values())


def shares_an_empty_storage(obj: Any) -> bool:
    """Whether two distinct tensor objects view one 0-byte storage (gds.load refuses that:
    test_tutorial.py::test_load_tensors_sharing_an_empty_storage)."""
    users: dict[int, set[int]] = {}
    for _, t in cst.iter_tensors(obj):
        if not t.untyped_storage().nbytes():
            users.setdefault(t.untyped_storage()._cdata, set()).add(id(t))
    return any(len(u) > 1 for u in users.values())


def assert_round_trip(got: Any, want: Any) -> None:
    assert_same_object(got, want)
    assert storage_groups(got) == storage_groups(want)
