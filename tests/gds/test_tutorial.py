"""The PyTorch GDS tutorial flow (``ckptlab.gds.save`` / ``load``) on the host backends.

``save`` writes a ``skip_data`` skeleton at storage alignment 4096 and then each storage once
through a ``ckptlab.gds.open`` handle; the file must load with plain ``torch.load`` bit-exactly
(tied weights still sharing a storage), every storage must start on a 4096-byte boundary, and
with ``fix_crc=True`` Python's ``zipfile`` must validate it. ``load`` is the inverse. The
negative test shows why the handle never pads a write up to 4096 bytes: doing so overwrites the
data descriptor and the next record's header that share the payload's last block.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gds_support import (
    BLOCK,
    assert_round_trip,
    get_path,
    shares_an_empty_storage,
    storage_bytes,
)
from hypothesis import given, settings
from torch.utils.serialization import config

import ckptlab as cl
from ckptlab import gds, samples
from ckptlab.testing import strategies as cst

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning")

HOST_BACKENDS = ("auto", "odirect", "posix")
# a fifth of the profile's examples: ci 8, dev 40 (each example saves and loads three times)
FEW = max(5, settings.default.max_examples // 5)


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def ckpt() -> dict[str, Any]:
    """samples.tiny_checkpoint(): model with tied weights, AdamW state, step and config."""
    return samples.tiny_checkpoint()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gds_tutorial")


@contextlib.contextmanager
def fresh_dir(base: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield Path(d)


def assert_save_order_matches(obj: Any, path: Path) -> None:
    """storages_in_save_order(obj)[k] is the storage torch.save wrote as key k."""
    layout = cl.inspect(path)
    order = gds.storages_in_save_order(obj)
    assert sorted(int(s.key) for s in layout.storages) == list(range(len(order)))
    for s in layout.storages:
        assert s.nbytes == order[int(s.key)].nbytes(), s.key
    for t in layout.tensors:
        real = get_path(obj, t.path).untyped_storage()
        assert real._cdata == order[int(t.storage_key)]._cdata, (t.path, t.storage_key)


def skeleton(obj: Any, path: Path) -> list[tuple[torch.UntypedStorage, int]]:
    """The tutorial's first two steps by hand: a skip_data save at alignment 4096, then
    (storage, data offset) in key order."""
    with config.patch({"save.storage_alignment": BLOCK}), torch.serialization.skip_data():
        torch.save(obj, path)
    offsets = cl.storage_offsets(path).offsets
    return [(s, offsets[str(k)]) for k, s in enumerate(gds.storages_in_save_order(obj))]


# ---------------------------------------------------------------------------------------------
# save


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_save_then_torch_load_is_bit_exact(ckpt: dict[str, Any], tmp_path: Path,
                                           backend: str) -> None:
    path = tmp_path / "model.pt"
    report = gds.save(ckpt, path, backend=backend)
    loaded = torch.load(path, weights_only=True)
    assert_round_trip(loaded, ckpt)
    model = loaded["model"]  # tied weights: two tensors, one storage
    assert (model["lm_head.weight"].untyped_storage().data_ptr()
            == model["transformer.wte.weight"].untyped_storage().data_ptr())
    order = gds.storages_in_save_order(ckpt)
    assert (report.path, report.storages, report.storage_nbytes, report.file_nbytes) == (
        str(path), len(order), sum(s.nbytes() for s in order), path.stat().st_size)
    with gds.open(path, backend=backend) as h:
        assert (report.backend, report.io_path) == (h.backend, h.io_path)
    assert set(report.phases) == {"skeleton", "offsets", "write", "fsync"}


def test_every_storage_starts_on_a_4096_boundary(ckpt: dict[str, Any], tmp_path: Path) -> None:
    gds.save(ckpt, tmp_path / "model.pt")
    layout = cl.inspect(tmp_path / "model.pt")
    assert layout.storage_alignment == BLOCK == layout.alignment
    assert len(layout.storages) == len(gds.storages_in_save_order(ckpt))
    bad = [(s.key, s.data_offset) for s in layout.storages if s.data_offset % BLOCK]
    assert bad == []


def test_other_alignments_and_the_config_is_restored(tmp_path: Path) -> None:
    before = config.save.storage_alignment
    obj = {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int16)}
    gds.save(obj, tmp_path / "m.pt", alignment=512, fsync=False)
    assert config.save.storage_alignment == before
    layout = cl.inspect(tmp_path / "m.pt")
    assert layout.storage_alignment == 512
    assert all(s.data_offset % 512 == 0 for s in layout.storages)
    assert_round_trip(torch.load(tmp_path / "m.pt"), obj)
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a lambda cannot be pickled
        gds.save({"f": lambda: 0}, tmp_path / "bad.pt", alignment=1024)
    assert config.save.storage_alignment == before


def test_fix_crc_makes_zipfile_validate(ckpt: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    report = gds.save(ckpt, path, fix_crc=True)
    assert "crc" in report.phases
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    order = gds.storages_in_save_order(ckpt)
    layout = cl.inspect(path)
    records = {r.name: r for r in layout.records}
    for s in layout.storages:
        assert records[s.record].crc32 == zlib.crc32(storage_bytes(order[int(s.key)])), s.key


def test_without_fix_crc_storage_crcs_are_zero(ckpt: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    gds.save(ckpt, path)
    layout = cl.inspect(path)
    storage_records = {s.record for s in layout.storages}
    with zipfile.ZipFile(path) as zf:
        crcs = {i.filename: i.CRC for i in zf.infolist()}
        assert zf.testzip() in storage_records  # zipfile notices the zeros
        for r in layout.records:
            if r.name in storage_records:
                assert crcs[r.name] == r.crc32 == 0, r.name
            else:  # the skeleton's own records carry their real CRC
                assert crcs[r.name] == r.crc32 == zlib.crc32(zf.read(r.name)), r.name


def test_fix_crc_file_is_torch_save_at_4096_but_the_serialization_id(
        ckpt: dict[str, Any], tmp_path: Path) -> None:
    """Golden bytes: the same file torch.save writes at alignment 4096, except the
    ``.data/serialization_id`` record (new per save) and its CRC in the central directory."""
    ours, theirs = tmp_path / "gds" / "model.pt", tmp_path / "torch" / "model.pt"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    gds.save(ckpt, ours, fix_crc=True)
    with config.patch({"save.storage_alignment": BLOCK}):
        torch.save(ckpt, theirs)
    got, want = ours.read_bytes(), theirs.read_bytes()
    assert len(got) == len(want)
    layout = cl.inspect(ours)
    sid = next(r for r in layout.records if r.short_name == ".data/serialization_id")
    cd = range(layout.central_directory_offset,
               layout.central_directory_offset + layout.central_directory_nbytes)
    diff = np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))
    outside = [int(i) for i in diff if not sid.data_offset <= i < sid.end_offset]
    assert all(i in cd for i in outside) and len(outside) <= 4, outside


def test_save_replaces_a_longer_file(ckpt: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"\xff" * (4 << 20))
    report = gds.save(ckpt, path)
    assert path.stat().st_size == report.file_nbytes < 4 << 20
    assert_round_trip(torch.load(path), ckpt)


def test_empty_tensors(tmp_path: Path) -> None:
    base = torch.arange(6.0)
    obj = {"empty": torch.empty(0), "empty2d": torch.zeros(0, 5, dtype=torch.int64),
           "empty_view": base[6:], "base": base, "empty_bool": torch.zeros(0, dtype=torch.bool)}
    path = tmp_path / "m.pt"
    report = gds.save(obj, path, fix_crc=True)
    assert (report.storages, report.storage_nbytes) == (1, base.nbytes)  # non-empty ones
    assert_round_trip(torch.load(path), obj)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    back, read = gds.load(path)
    assert_round_trip(back, obj)
    assert (read.storages, read.storage_nbytes) == (1, base.nbytes)


@pytest.mark.parametrize("obj", [
    pytest.param({"step": 1, "name": "x"}, id="no-tensors"),
    pytest.param({"a": torch.empty(0), "b": torch.empty(0, 3)}, id="only-empty"),
    pytest.param(torch.arange(5, dtype=torch.int8), id="bare-tensor"),
])
def test_degenerate_objects(obj: Any, tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    gds.save(obj, path, fix_crc=True)
    assert_round_trip(torch.load(path), obj)
    back, _ = gds.load(path)
    assert_round_trip(back, obj)


# ---------------------------------------------------------------------------------------------
# load


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_load_on_cpu_is_bit_exact(ckpt: dict[str, Any], tmp_path: Path, backend: str) -> None:
    path = tmp_path / "model.pt"
    gds.save(ckpt, path, backend="posix")
    obj, report = gds.load(path, "cpu", backend=backend)
    assert_round_trip(obj, ckpt)
    assert all(t.device.type == "cpu" for _, t in cst.iter_tensors(obj))
    order = gds.storages_in_save_order(ckpt)
    assert (report.storages, report.storage_nbytes, report.file_nbytes) == (
        len(order), sum(s.nbytes() for s in order), path.stat().st_size)
    assert set(report.phases) == {"skeleton", "offsets", "read"}
    if backend != "auto":
        assert report.backend == backend


def test_host_load_puts_large_storages_in_page_aligned_memory(tmp_path: Path) -> None:
    from ckptlab.gds._buffers import ALIGNED_STORAGE_MIN

    big = torch.randn(ALIGNED_STORAGE_MIN // 4 + 5)
    state = {"big": big, "view": big[7:100], "small": torch.arange(10), "p": torch.nn.Parameter(
        torch.ones(ALIGNED_STORAGE_MIN // 2, dtype=torch.bfloat16))}
    path = tmp_path / "model.pt"
    gds.save(state, path)
    obj, report = gds.load(path, "cpu", backend="odirect")
    assert_round_trip(obj, state)
    assert obj["big"].untyped_storage().data_ptr() % 4096 == 0
    assert obj["p"].untyped_storage().data_ptr() % 4096 == 0
    assert obj["view"].untyped_storage().data_ptr() == obj["big"].untyped_storage().data_ptr()
    assert isinstance(obj["p"], torch.nn.Parameter)
    del state, big
    import gc

    gc.collect()  # the mmap lives as long as the storage, not the loader's locals
    assert float(obj["p"].detach().float().sum()) == ALIGNED_STORAGE_MIN // 2
    assert report.io_path == "O_DIRECT"


@pytest.mark.parametrize("backend", ["odirect", "posix"])
def test_load_sizes_storages_itself_where_torch_inflates_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Where skip_data storages come inflated (torch 2.7), gds.load makes each at the size
    the pickle declares, in the pickle's order; here (a torch that does not inflate) the
    same path must give the same bit-exact result, shared and empty storages included."""
    from ckptlab.gds import api

    monkeypatch.setattr(api, "skip_data_inflates_storages", lambda: True)
    big = torch.randn(300_000)
    state = {"big": big, "view": big[5:9], "e": torch.empty(0), "e2": torch.empty(0),
             "h": torch.ones(3, dtype=torch.float16), "c": torch.zeros(2, dtype=torch.complex128)}
    gds.save(state, tmp_path / "m.pt")
    obj, _ = gds.load(tmp_path / "m.pt", "cpu", backend=backend)
    assert_round_trip(obj, state)
    assert obj["view"].untyped_storage().data_ptr() == obj["big"].untyped_storage().data_ptr()


def test_the_skeleton_placer_refuses_storages_out_of_step(tmp_path: Path) -> None:
    from ckptlab.errors import CorruptArchiveError
    from ckptlab.gds.api import _placer

    place = _placer([8, 12], "cpu", False, str(tmp_path / "m.pt"))
    assert place(torch.UntypedStorage(32), "cpu").nbytes() == 8  # 8 bytes x 4
    assert place(torch.UntypedStorage(0), "cpu").nbytes() == 0  # empty: no size taken
    with pytest.raises(CorruptArchiveError, match=r"expected 12 bytes \(times an element size\), "
                       r"got 13 bytes"):
        place(torch.UntypedStorage(13), "cpu")
    with pytest.raises(CorruptArchiveError, match="expected a storage of its declared size"):
        place(torch.UntypedStorage(4), "cpu")


@pytest.mark.parametrize("backend", ["odirect", "posix"])
def test_host_load_asks_for_huge_pages_only_where_o_direct_fills_them(
        tmp_path: Path, backend: str) -> None:
    """O_DIRECT loads fill storages advised for transparent huge pages (one fault per 2 MiB);
    page-cache loads do not ask (the kernel would compact the memory the cache just filled).
    Read from the kernel's own VmFlags of the storage's mapping."""
    from ckptlab.testing.memory import mapping_flags

    path = tmp_path / "model.pt"
    gds.save({"w": torch.randn(1 << 20)}, path)  # 4 MiB
    obj, report = gds.load(path, "cpu", backend=backend)
    flags = mapping_flags(obj["w"].untyped_storage().data_ptr())
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "sh" not in flags
    assert ("hg" in flags) == (report.io_path == "O_DIRECT"), (report.io_path, flags)
    assert torch.equal(obj["w"], torch.load(path)["w"])


def test_load_reads_files_plain_torch_save_wrote(ckpt: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(ckpt, path)  # storage alignment 64: O_DIRECT reads go through the bounce buffer
    obj, _ = gds.load(path, "cpu", backend="odirect")
    assert_round_trip(obj, ckpt)


# ---------------------------------------------------------------------------------------------
# storage order


def test_storages_in_save_order_matches_torch(ckpt: dict[str, Any], tmp_path: Path) -> None:
    torch.save(ckpt, tmp_path / "plain.pt")
    assert_save_order_matches(ckpt, tmp_path / "plain.pt")
    gds.save(ckpt, tmp_path / "gds.pt")
    assert_save_order_matches(ckpt, tmp_path / "gds.pt")


@settings(max_examples=FEW)
@given(obj=cst.state_dicts(max_leaves=6, attributes=True))
def test_random_state_dicts_round_trip(workdir: Path, obj: Any) -> None:
    with fresh_dir(workdir) as d:
        path = d / "ckpt.pt"
        torch.save(obj, d / "plain.pt")
        assert_save_order_matches(obj, d / "plain.pt")
        report = gds.save(obj, path, backend="odirect", fix_crc=True)
        assert_save_order_matches(obj, path)
        assert_round_trip(torch.load(path, weights_only=False), obj)
        layout = cl.inspect(path)
        assert all(s.data_offset % BLOCK == 0 for s in layout.storages)
        assert report.storage_nbytes == sum(s.nbytes for s in layout.storages)
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None
        if shares_an_empty_storage(obj):
            return  # gds.load refuses these: test_load_tensors_sharing_an_empty_storage
        back, _ = gds.load(path, "cpu", backend="odirect", weights_only=False)
        assert_round_trip(back, obj)


@pytest.mark.parametrize("make", [
    pytest.param(lambda t: {"a": t, "b": t[:0]}, id="two-views"),
    pytest.param(lambda t: {"p": torch.nn.Parameter(t), "t": t}, id="parameter-and-tensor"),
])
def test_load_tensors_sharing_an_empty_storage(tmp_path: Path, make: Any) -> None:
    obj = make(torch.empty(0))
    assert shares_an_empty_storage(obj)
    gds.save(obj, tmp_path / "m.pt")
    assert_round_trip(torch.load(tmp_path / "m.pt"), obj)  # torch reads it fine
    back, report = gds.load(tmp_path / "m.pt")
    assert_round_trip(back, obj)
    assert report.storages == 0  # nothing to move: empty storages are skipped


# ---------------------------------------------------------------------------------------------
# why the handle never pads a write


def test_padding_writes_to_4096_corrupts_the_archive_and_the_handle_does_not(
        ckpt: dict[str, Any], tmp_path: Path) -> None:
    naive, careful = tmp_path / "naive" / "model.pt", tmp_path / "careful" / "model.pt"
    naive.parent.mkdir()
    careful.parent.mkdir()
    pairs = skeleton(ckpt, naive)
    shutil.copyfile(naive, careful)
    blank = naive.read_bytes()

    # a careless O_DIRECT user: every write rounded up to whole 4 KiB blocks with zeros
    padded = [(o, b + bytes(-len(b) % BLOCK)) for s, o in pairs if (b := storage_bytes(s))]
    assert any(s.nbytes() % BLOCK for s, _ in pairs)  # some writes really get padded
    fd = os.open(naive, os.O_RDWR)
    try:
        for offset, data in padded:
            assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="corrupted"):
        torch.load(naive, weights_only=True)
    with pytest.raises(cl.CorruptArchiveError, match=r"descriptor|header"):
        cl.inspect(naive)

    # the same writes through a ckptlab handle
    with gds.open(careful, os.O_RDWR) as h:
        for storage, offset in pairs:
            h.save_storage(storage, offset)
    got = careful.read_bytes()
    assert len(got) == len(blank)
    outside = np.ones(len(got), dtype=bool)
    for storage, offset in pairs:
        outside[offset:offset + storage.nbytes()] = False
        assert got[offset:offset + storage.nbytes()] == storage_bytes(storage)
    assert (np.frombuffer(got, np.uint8)[outside] == np.frombuffer(blank, np.uint8)[outside]).all()
    assert_round_trip(torch.load(careful, weights_only=True), ckpt)
    assert len(cl.inspect(careful).storages) == len(pairs)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensors_a_skeleton_cannot_carry_are_ckptlab_errors(tmp_path) -> None:
    """Strided nested tensors and wrapper subclasses cannot be rebuilt from a skip_data
    skeleton, quantized and nested ones cannot be written as one: each is refused with a
    ckptlab error (nothing read from uninitialised memory, no torn file left)."""
    from torch.testing._internal.two_tensor import TwoTensor

    from ckptlab.errors import UnsupportedFormatError

    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    two = TwoTensor(torch.randn(3), torch.randn(3))
    quantized = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 10, torch.quint8)
    for name, value in (("nested", nested), ("two", two)):
        torch.save({name: value}, tmp_path / f"{name}.pt")
        with pytest.raises(UnsupportedFormatError, match=f"tensor '{name}'"):
            gds.load(tmp_path / f"{name}.pt", weights_only=False)
    for value in (quantized, nested):
        with pytest.raises(UnsupportedFormatError, match="torch refuses"):
            gds.save({"x": value}, tmp_path / "out.pt")
        assert not (tmp_path / "out.pt").exists()
        with pytest.raises(UnsupportedFormatError, match="torch refuses"):
            cl.predict_layout({"x": value})


def test_load_returns_a_result_that_still_unpacks(tmp_path: Path) -> None:
    """``gds.load`` gives a LoadResult (``.obj``, ``.report``) that unpacks like the tuple it
    was; ``TransferReport.seconds`` became ``duration_s`` (the old name warns)."""
    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 3}
    saved = gds.save(state, tmp_path / "m.pt", fsync=False)
    result = gds.load(tmp_path / "m.pt")
    assert isinstance(result, gds.LoadResult)
    obj, report = result
    assert obj is result.obj and report is result.report
    assert torch.equal(obj["w"], state["w"]) and obj["step"] == 3
    assert report.duration_s == pytest.approx(sum(report.phases.values()))
    with pytest.warns(DeprecationWarning, match="duration_s"):
        assert saved.seconds == saved.duration_s


def test_the_tutorial_module_is_an_alias_of_the_api_module() -> None:
    from ckptlab.gds import api, tutorial

    assert tutorial.save is api.save is gds.save and tutorial.load is api.load
    assert tutorial.GDS_ALIGNMENT == 4096 and tutorial.TransferReport is api.TransferReport


def test_host_saves_write_the_file_front_to_back(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """After the skeleton, a host-backend save empties the file and writes every byte again
    in file order (appending writes fill no holes); the file is the skeleton with each
    storage's bytes at its offset."""
    torch.manual_seed(0)
    state = {"a": torch.randn(3000), "b": torch.randn(70_000).half(), "c": torch.arange(5),
             "tied": None}
    state["tied"] = state["a"][10:20]
    (tmp_path / "torch").mkdir()
    want = tmp_path / "torch" / "m.pt"  # the same file name: it is the archive's name
    with config.patch({"save.storage_alignment": 4096}), torch.serialization.skip_data():
        torch.save(state, want)
    expected = bytearray(want.read_bytes())
    offsets = cl.storage_offsets(want).offsets
    for key, storage in zip(sorted(offsets, key=int), gds.storages_in_save_order(state)):
        data = storage_bytes(storage)
        expected[offsets[key]:offsets[key] + len(data)] = data
    writes: list[tuple[int, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        n = real(fd, data, offset)
        writes.append((offset, n))
        return n

    path = tmp_path / "m.pt"
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", pwrite)
        report = gds.save(state, path, backend="odirect", fsync=False)
    assert path.read_bytes() == bytes(expected)
    end = 0
    for offset, n in writes:
        assert offset >= end or offset + n <= end  # never behind what is already written
        end = max(end, offset + n)
    assert end == os.path.getsize(path) and report.storages == 3
