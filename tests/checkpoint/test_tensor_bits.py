"""Tensors saved with the conjugate or negative bit set (``t.conj()``, ``t._neg_view()``):
torch.save keeps the bit in ``_rebuild_tensor_v2``'s metadata and torch.load gives the view;
``ck.read`` must give the same values and bits, with either implementation of the scan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab.errors import CorruptArchiveError
from ckptlab.format import _pickle


@pytest.fixture(params=["python", "c"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The scan's implementation (interpreter, handlers and walk) for the test."""
    if request.param == "c":
        pytest.importorskip("ckptlab.format._interp")
    monkeypatch.setattr(_pickle, "_IMPL", request.param)
    return request.param  # type: ignore[no-any-return]


def _saved(path: Path) -> dict[str, Any]:
    z = torch.complex(torch.arange(6.0).reshape(2, 3), torch.linspace(-1, 1, 6).reshape(2, 3))
    obj = {"c": torch.tensor([1 + 2j]).conj(), "n": torch.tensor([1.5])._neg_view(),
           "z": z.conj(), "zt": z.conj().t(), "plain": z, "w": torch.ones(3)}
    torch.save(obj, path)
    return obj


def test_read_gives_the_saved_bits(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "bits.pt"
    _saved(path)
    theirs = torch.load(path)
    ck = ckptlab.open(path)
    assert set(ck.tensors) == set(theirs)
    for name, want in theirs.items():
        got = ck.read(name)
        assert (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg()), name
        assert got.dtype == want.dtype and got.shape == want.shape and \
            got.stride() == want.stride(), name
        assert torch.equal(got.resolve_conj().resolve_neg(),
                           want.resolve_conj().resolve_neg()), name
    assert dict(ck.tensors["c"].extra) == {"conj": True}
    assert dict(ck.tensors["n"].extra) == {"neg": True}
    assert ck.tensors["plain"].extra == ()


def test_unknown_tensor_metadata_is_refused_not_dropped(tmp_path: Path) -> None:
    """A metadata key ckptlab cannot apply would give wrong values if ignored: refused."""
    path = tmp_path / "bits.pt"
    _saved(path)
    data = path.read_bytes().replace(b"X\x04\x00\x00\x00conj", b"X\x04\x00\x00\x00conk")
    assert data != path.read_bytes()
    path.write_bytes(data)
    with pytest.raises(CorruptArchiveError, match="tensor metadata ckptlab does not know"):
        ckptlab.open(path)


class _OldStyle:
    """Pickles as ``torch.Tensor()`` filled by BUILD with ``(storage, offset, size, stride)``
    (``Tensor.__setstate__``), as torch's backward-compatibility tests write tensors."""

    def __init__(self, t: Any) -> None:
        self.t = t

    def __reduce_ex__(self, protocol: Any) -> Any:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (TypedStorage is deprecated)
            storage = self.t.storage()
        return (torch.Tensor, (), (storage, self.t.storage_offset(), tuple(self.t.size()),
                                   self.t.stride()))


def test_tensor_built_by_setstate_is_a_tensor(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "old.pt"
    base = torch.arange(12.0)
    torch.save({"old": _OldStyle(base[2:8].view(2, 3)), "w": torch.ones(2)}, path)
    theirs = torch.load(path, weights_only=False)
    ck = ckptlab.open(path)
    assert set(ck.tensors) == {"old", "w"} and not ck.objects
    entry = ck.tensors["old"]
    want = theirs["old"]
    assert (entry.dtype, entry.shape, entry.stride) == ("float32", tuple(want.shape),
                                                         want.stride())
    assert entry.parts[0].storage_offset == want.storage_offset()
    assert torch.equal(ck.read("old"), want)
