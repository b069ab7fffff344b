"""Legacy torch.save files (``_use_new_zipfile_serialization=False``) through ``ckptlab.open``.

Written by torch's own ``_legacy_save`` (pickle protocols 2-5) and, for the parts torch no longer
writes (storage views), by a small writer of the same format here. For each tensor
``ck.read(name)`` equals what ``torch.load(weights_only=False)`` gives (type, dtype, shape,
stride, requires_grad, bytes); every part's bytes are the tensor's; the segments tile the file in
the documented order; every truncation and every byte flip of a pickle gives a ckptlab error or a
correct model, never another exception; a hostile object pickle never runs.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.checkpoint.model import Checkpoint
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format.layout import SegmentKind
from ckptlab.testing import strategies as cst
from ckptlab.testing.damage import assert_tiles, bit_flips, open_and_read, truncations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

MAGIC = 0x1950A86A20F9469CFC6C


def raw_bytes(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # fresh contiguous strides
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def lookup(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = getattr(obj, key) if isinstance(obj, torch.nn.Module) else obj[key]
    return obj


def same(want: torch.Tensor, got: torch.Tensor) -> None:
    assert type(got) is type(want), (type(want), type(got))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride() and got.requires_grad == want.requires_grad
    assert raw_bytes(got) == raw_bytes(want)


def check_tiling(ck: Checkpoint) -> None:
    for f in ck.files:
        assert_tiles(f.segments, f.nbytes, f.path)


def check_parts(ck: Checkpoint, path: Path, loaded: Any) -> None:
    data = path.read_bytes()
    for entry in ck.tensors.values():
        want = lookup(loaded, entry.path)
        for part in entry.parts:
            if part.contiguous:
                assert data[part.offset:part.offset + part.nbytes] == raw_bytes(want)


def check_all(ck: Checkpoint, path: Path, loaded: Any) -> None:
    check_tiling(ck)
    check_parts(ck, path, loaded)
    for name, entry in ck.tensors.items():
        same(lookup(loaded, entry.path), ck.read(name))


def sample() -> dict[str, Any]:
    base = torch.arange(24.0).reshape(4, 6)
    return {
        "w": torch.randn(2, 3), "view": base[1:3, ::2], "t": base.t(), "base": base,
        "bf16": torch.randn(3).bfloat16(), "half": torch.randn(2, 2).half(),
        "param": torch.nn.Parameter(torch.randn(2)), "grad": torch.randn(3, requires_grad=True),
        "ids": torch.arange(5), "mask": torch.tensor([True, False]), "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7), "c64": torch.randn(2, dtype=torch.complex64),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "nested": {"list": [torch.ones(2), 5], "tuple": (torch.zeros(1), "x")},
        "step": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


@pytest.fixture(scope="module")
def small_legacy() -> bytes:
    """A small legacy file for the damage tests: a view, a Parameter, a value."""
    base = torch.arange(6.0)
    buf = io.BytesIO()
    torch.save({"a": base, "v": base[1:4], "p": torch.nn.Parameter(torch.ones(2)), "n": 1},
               buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


@pytest.fixture(scope="module")
def legacy_files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("legacy")
    obj = sample()
    out = {}
    for protocol in (2, 3, 4, 5):
        path = root / f"p{protocol}.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        out[protocol] = path
    return out


# -- a writer of the format, for what torch no longer writes -------------------------------------
class _Storage:
    """Stands for a storage in the object pickle (its persistent id says the rest)."""

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> Any:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Storage) else None


def write_legacy(obj: Any, storages: dict[str, bytes], *, keys: list[str] | None = None,
                 counts: dict[str, int] | None = None, itemsize: int = 4,
                 object_pickle: bytes | None = None) -> bytes:
    """A legacy file as ``_legacy_save`` lays it out (float32 storages unless said)."""
    f = io.BytesIO()
    for value in (MAGIC, 1001, {"protocol_version": 1001, "little_endian": True,
                                "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(value, f, protocol=2)
    if object_pickle is None:
        _Pickler(f, protocol=2).dump(obj)
    else:
        f.write(object_pickle)
    keys = sorted(storages) if keys is None else keys
    pickle.dump(keys, f, protocol=2)
    for key in keys:
        raw = storages[key]
        count = (counts or {}).get(key, len(raw) // itemsize)
        f.write(struct.pack("<q", count) + raw)
    return f.getvalue()


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_protocol_reads_back_exactly(legacy_files: dict[int, Path], protocol: int) -> None:
    path = legacy_files[protocol]
    ck = cl.open(path)
    loaded = torch.load(path, weights_only=False)
    assert ck.format == "torch-legacy" and ck.files[0].format == "torch-legacy"
    assert set(ck.tensors) == {"w", "view", "t", "base", "bf16", "half", "param", "grad", "ids",
                               "mask", "empty", "scalar", "c64", "i8", "nested.list.0",
                               "nested.tuple.0"}
    assert ck.objects == {"step": 3, "cfg": {"lr": 0.1, "betas": [0.9, 0.99]},
                          "nested.list.1": 5, "nested.tuple.1": "x"}
    assert ck.tensors["param"].is_parameter and ck.tensors["grad"].requires_grad
    check_all(ck, path, loaded)
    # views share their storage's bytes
    assert ck.tensors["view"].parts[0].storage_key == ck.tensors["base"].parts[0].storage_key
    assert ck.tensors["view"].offset == ck.tensors["base"].offset + 6 * 4


def test_segments_follow_the_documented_layout(legacy_files: dict[int, Path]) -> None:
    path = legacy_files[2]
    data = path.read_bytes()
    ck = cl.open(path)
    segs = ck.files[0].segments
    assert [(s.kind, s.record) for s in segs[:5]] == [
        (SegmentKind.HEADER, "magic_number"), (SegmentKind.HEADER, "protocol_version"),
        (SegmentKind.HEADER, "sys_info"), (SegmentKind.DATA, "pickle"),
        (SegmentKind.HEADER, "storage_keys")]
    f = io.BytesIO(data)
    assert [pickle.load(f) for _ in range(3)][:2] == [MAGIC, 1001]
    assert f.tell() == segs[3].offset
    layout = ck.files[0].layout
    keys = pickle.loads(data[segs[4].offset:segs[4].end_offset])
    assert [s.key for s in layout.storages] == keys  # the key list's order, sorted by torch
    by_key = {s.key: s for s in layout.storages}
    rest = list(segs[5:])
    for key in keys:  # each storage: its int64 element count, then its bytes
        count = rest.pop(0)
        assert (count.kind, count.record, count.nbytes) == (SegmentKind.HEADER_LENGTH, key, 8)
        storage = by_key[key]
        numel = struct.unpack_from("<q", data, count.offset)[0]
        assert storage.data_offset == count.end_offset
        itemsize = torch.empty((), dtype=getattr(torch, storage.dtype)).element_size()
        assert numel * itemsize == storage.nbytes
        if storage.nbytes:
            seg = rest.pop(0)
            assert (seg.kind, seg.record, seg.offset, seg.nbytes) == (
                SegmentKind.DATA, key, storage.data_offset, storage.nbytes)
    assert not rest and layout.format == "torch-legacy" and layout.file_nbytes == len(data)


def test_full_module_pickle(tmp_path: Path) -> None:
    """torch.save(module) pickles the classes as ('module', cls, file, source) ids."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    path = tmp_path / "model.pt"
    torch.save(model, path, _use_new_zipfile_serialization=False)
    ck = cl.open(path)
    loaded = torch.load(path, weights_only=False)
    names = set(ck.tensors)
    assert {"_modules.0._parameters.weight", "_modules.1._buffers.running_mean"} <= names
    for name, entry in ck.tensors.items():
        want = loaded
        for key in entry.path:
            want = want[key] if isinstance(want, dict) else getattr(want, key)
        same(want, ck.read(name))


def test_bytes_and_file_objects(legacy_files: dict[int, Path]) -> None:
    data = legacy_files[4].read_bytes()
    want = list(cl.open(legacy_files[4]).tensors)
    buf = io.BytesIO(b"JUNK" * 5 + data)
    buf.seek(20)
    for source in (data, io.BytesIO(data), buf):
        ck = cl.open(source)
        assert ck.format == "torch-legacy" and list(ck.tensors) == want
    with pytest.raises(UnsupportedFormatError, match="needs a path"):
        cl.open(data).read("w")


@given(obj=cst.state_dicts(dtypes=cst.REBUILD_V2_DTYPES, max_leaves=6),
       protocol=st.sampled_from([2, 3, 4, 5]))
def test_random_state_dicts_read_back(tmp_path_factory, obj: Any, protocol: int) -> None:
    path = tmp_path_factory.mktemp("prop") / "obj.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    ck = cl.open(path)
    loaded = torch.load(path, weights_only=False)
    want = list(cst.iter_tensors(loaded))
    assert len(ck.tensors) == len(want)
    for (wpath, wtensor), entry in zip(want, ck.tensors.values(), strict=True):
        assert entry.path == wpath
        same(wtensor, ck.read(entry.name))
    check_tiling(ck)


def test_storage_views_of_old_files(tmp_path: Path) -> None:
    """Files from torch < 0.4 name views of a storage in the persistent id's sixth field."""
    root = _Storage(("storage", torch.FloatStorage, "root", "cpu", 10, None))
    view = _Storage(("storage", torch.FloatStorage, "root", "cpu", 10, ("v", 4, 5)))
    obj = {"whole": _Tensor(root, 0, (10,), (1,)), "tail": _Tensor(view, 1, (2, 2), (1, 2))}
    values = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "views.pt"
    path.write_bytes(write_legacy(obj, {"root": raw_bytes(values)}))
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["tail"], values[5:9].view(2, 2).t())  # the writer is right
    ck = cl.open(path)
    check_all(ck, path, loaded)
    layout = ck.files[0].layout
    assert [s.key for s in layout.storages] == ["root", "v"]
    assert layout.storage("v").data_offset == layout.storage("root").data_offset + 16


# -- damage ------------------------------------------------------------------------------------
def test_every_truncation_is_an_archive_error(small_legacy: bytes) -> None:
    data = small_legacy
    for prefix in truncations(data):
        with pytest.raises(ArchiveError):
            cl.open(prefix)
    ck = cl.open(data + b"tail")  # bytes after the last storage: kept, and said
    assert ck.files[0].segments[-1].kind is SegmentKind.UNKNOWN and "after the last" in \
        ck.notes[0]


def test_every_byte_of_every_pickle_flipped(small_legacy: bytes, tmp_path: Path) -> None:
    data = small_legacy
    pickles = [s for s in cl.open(data).files[0].segments
               if s.kind is not SegmentKind.DATA or s.record == "pickle"]
    target = tmp_path / "flipped.pt"
    # the pickles and the element counts
    for _, mutated in bit_flips(data, [(seg.offset, seg.end_offset) for seg in pickles]):
        open_and_read(mutated, target)


@given(data=st.data())
def test_random_mutations(small_legacy: bytes, tmp_path_factory, data) -> None:
    mutated = data.draw(cst.overwritten_bytes(small_legacy))
    open_and_read(mutated, tmp_path_factory.mktemp("mut") / "m.pt")


def test_element_count_must_match_the_pickle(tmp_path: Path) -> None:
    root = _Storage(("storage", torch.FloatStorage, "k", "cpu", 3, None))
    obj = {"a": _Tensor(root, 0, (3,), (1,))}
    raw = raw_bytes(torch.ones(3))
    with pytest.raises(CorruptArchiveError, match="element count") as info:
        cl.open(write_legacy(obj, {"k": raw + raw}, counts={"k": 6}))
    assert info.value.record == "k"
    with pytest.raises(CorruptArchiveError, match="no bytes"):
        cl.open(write_legacy(obj, {"k": raw}, keys=[]))
    with pytest.raises(CorruptArchiveError, match="never uses"):
        cl.open(write_legacy(obj, {"k": raw, "x": raw}))
    past = {"a": _Tensor(root, 2, (2,), (1,))}  # elements 2..3 of a 3-element storage
    with pytest.raises(CorruptArchiveError, match="past the end of its storage"):
        cl.open(write_legacy(past, {"k": raw}))
    with pytest.raises(TruncatedArchiveError):
        cl.open(write_legacy(obj, {"k": raw})[:-1])


def test_hostile_reduce_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    evil = pickle.dumps({"w": Payload()}, protocol=2)
    assert b"system" in evil
    data = write_legacy(None, {}, object_pickle=evil)
    path = tmp_path / "evil.pt"
    path.write_bytes(data)
    # positive control: Python's pickle runs it
    pickle.loads(evil)
    assert marker.exists()
    marker.unlink()
    ck = cl.open(path)
    assert not marker.exists()
    assert ck.format == "torch-legacy" and not ck.tensors
    assert ck.objects == {"<root>": {"w": {"type": f"{os.system.__module__}.system",
                                           "args": [f"touch {marker}"]}}}
    with open(path, "rb") as f:
        cl.open(f)
    assert not marker.exists()


@pytest.mark.slow  # 23 s: four 150k-300k opcode pickles in an isolated worker
def test_hostile_shapes_as_the_object_pickle_stay_bounded() -> None:
    """The attack shapes of issue 15 as a legacy object pickle: in a memory-limited worker,
    each ends in a ckptlab error or a model, never a crash, within the interpreter's budget."""
    from ckptlab.format._unpickle import MEMORY_FLOOR, MEMORY_PER_BYTE
    from ckptlab.testing.isolated import IsolatedReader
    from ckptlab.testing.pickles import amplifier, deep_tuple_key, distinct_globals

    cases = {"deep key": deep_tuple_key(150_000), "sets": amplifier(b"\x8f", 300_000),
             "marks": amplifier(b"(", 300_000), "globals": distinct_globals(20_000)}
    with IsolatedReader(budget_nbytes=2 << 30, timeout_s=300) as isolated:
        for name, pkl in cases.items():
            data = write_legacy(None, {}, object_pickle=pkl)
            outcome = isolated.run("open", data, name="hostile.pt")
            assert outcome.status in ("ok", "error") and outcome.clean, (name, outcome)
            budget = max(MEMORY_FLOOR, MEMORY_PER_BYTE * len(data)) + (16 << 20)
            assert outcome.peak_nbytes <= budget, (name, outcome.peak_nbytes, budget)


def test_plain_pickles_and_tars_are_still_refused(tmp_path: Path) -> None:
    for protocol in (2, 4, 5):
        with pytest.raises(UnsupportedFormatError, match="plain pickle"):
            cl.open(pickle.dumps({"a": [1, 2]}, protocol=protocol))
    import tarfile

    path = tmp_path / "old.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("sys_info")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    with pytest.raises(UnsupportedFormatError, match="tar"):
        cl.open(path)
