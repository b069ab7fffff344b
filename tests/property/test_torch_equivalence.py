"""ckptlab against torch itself, on random checkpoints written by torch.save.

Every property writes a random object (``ckptlab.testing.strategies.state_dicts``) with a random
configuration (alignment 1..65504, crc on/off, skip_data, pickle protocol 2..5, file names with
several dots) and compares what ckptlab says with what torch and Python's ``zipfile`` say:
record offsets (``PyTorchFileReader.get_record_offset``), zip headers, storage offsets
(``_checkpoint_offset`` of meta / fake loads), predicted layouts, and the tensors' metadata.

Hypothesis settings come from the profile loaded in ``tests/conftest.py`` (``HYPOTHESIS_PROFILE``,
default "ci").
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab import _torch_compat as tc
from ckptlab.format import SegmentKind
from ckptlab.testing import strategies as cst

# tests/conftest.py registers and loads the profiles; keep this module usable without it
try:
    settings.get_profile("ci")
except Exception:  # pragma: no cover - only without the shared conftest
    _suppress = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
    settings.register_profile("ci", max_examples=40, deadline=None,
                              suppress_health_check=_suppress)
    settings.register_profile("dev", max_examples=200, deadline=None,
                              suppress_health_check=_suppress)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning",
)

# every dtype torch.save writes: _rebuild_tensor_v2 ones and the v3 ones (UntypedStorage)
DTYPES = cst.ALL_DTYPES

OBJECTS = cst.state_dicts(dtypes=DTYPES)
CONFIGS = cst.save_configs()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("equivalence")


@contextlib.contextmanager
def fresh_dir(base: Path) -> Iterator[Path]:
    """A directory of its own for one hypothesis example, removed afterwards."""
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield Path(d)


def get_path(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def load_meta(path: Path) -> Any:
    return torch.load(path, map_location="meta", weights_only=False)


def _meta_load_records_offsets() -> bool:
    """Whether ``torch.load(map_location="meta")`` records each storage's file offset (2.13
    does; 2.7 does so only under FakeTensorMode)."""
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    buf.seek(0)
    return tc.checkpoint_offset(torch.load(buf, map_location="meta").untyped_storage()) \
        is not None


META_OFFSETS = _meta_load_records_offsets()


def load_with_offsets(path: Path) -> Any:
    """A load that reads no storage bytes and records every storage's file offset: a meta
    load where torch records offsets there, else under FakeTensorMode."""
    if META_OFFSETS:
        return load_meta(path)
    with tc.fake_tensor_mode()():
        return torch.load(path, weights_only=False)


def short(name: str, archive: str) -> str:
    assert name.startswith(archive + "/"), (name, archive)
    return name[len(archive) + 1:]


# ---------------------------------------------------------------------------------------------
# records and zip headers


@given(obj=OBJECTS, config=CONFIGS)
def test_records_match_torch_reader_and_zipfile(workdir: Path, obj: Any,
                                                config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        assert layout.format == "torch-zip"
        assert layout.file_nbytes == path.stat().st_size

        reader = tc.pytorch_file_reader()(str(path))
        torch_names = reader.get_all_records()
        assert sorted(r.short_name for r in layout.records) == sorted(torch_names)
        for r in layout.records:
            assert r.short_name == short(r.name, layout.archive_name)
            assert r.data_offset == reader.get_record_offset(r.short_name), r.name
            assert r.method == 0
            assert r.data_nbytes == r.uncompressed_nbytes

        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
        assert [i.filename for i in infos] == [r.name for r in layout.records]
        for info, r in zip(infos, layout.records):
            assert r.header_offset == info.header_offset, r.name
            assert r.data_nbytes == info.compress_size, r.name
            assert r.uncompressed_nbytes == info.file_size, r.name
            assert r.method == info.compress_type, r.name
            # the same central directory field: 0 when written with compute_crc32=False
            assert r.crc32 == info.CRC, r.name
            if not config.compute_crc32:
                assert info.CRC == 0
        if config.compute_crc32 and not config.skip_data:
            with zipfile.ZipFile(path) as zf:
                assert zf.testzip() is None  # every CRC checks out against the data

        # write order and the small records
        expected_order = ["data.pkl", ".format_version", ".storage_alignment"]
        if not config.disable_byteorder_record:
            expected_order.append("byteorder")
        expected_order += [f"data/{s.key}" for s in layout.storages]
        expected_order += ["version"]
        if config.disable_byteorder_record:
            expected_order.append("byteorder")
        expected_order.append(".data/serialization_id")
        by_offset = sorted(layout.records, key=lambda r: r.header_offset)
        assert [r.short_name for r in by_offset] == expected_order
        assert layout.storage_alignment == config.alignment
        assert layout.format_version == "1"
        assert layout.byteorder == "little"  # written after "version" when disabled
        assert layout.pickle_protocol == config.pickle_protocol
        for s in layout.storages:
            if s.nbytes:
                assert s.data_offset % config.alignment == 0
                assert layout.alignment >= 1 and s.data_offset % layout.alignment == 0


@given(obj=OBJECTS, config=CONFIGS)
def test_segments_tile_the_file(workdir: Path, obj: Any, config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
    segs = layout.segments
    assert segs[0].offset == 0
    for a, b in itertools.pairwise(segs):
        assert a.end_offset == b.offset, (a, b)
    assert segs[-1].end_offset == layout.file_nbytes
    assert all(s.nbytes > 0 for s in segs)
    assert not [s for s in segs if s.kind is SegmentKind.UNKNOWN]
    kinds = [s.kind for s in segs]
    assert kinds[-4:] == [SegmentKind.CENTRAL_DIRECTORY, SegmentKind.ZIP64_EOCD,
                          SegmentKind.ZIP64_LOCATOR, SegmentKind.EOCD]
    # each record's data segment is where the record says, and padding sums up
    data = {s.record: s for s in segs if s.kind is SegmentKind.DATA}
    for r in layout.records:
        if r.data_nbytes:
            assert (data[r.name].offset, data[r.name].nbytes) == (r.data_offset, r.data_nbytes)
        assert r.extra_nbytes == r.zip64_extra_nbytes + 4 + r.padding_nbytes
        assert r.data_offset == r.header_offset + 30 + r.name_nbytes + r.extra_nbytes
        assert r.descriptor_nbytes == (16 if r.data_nbytes else 0)
    assert layout.central_directory_offset == max(r.end_offset for r in layout.records)
    assert layout.file_nbytes == (layout.central_directory_offset
                                  + layout.central_directory_nbytes + 98)
    assert layout.overhead_nbytes == layout.file_nbytes - sum(r.data_nbytes
                                                              for r in layout.records)
    assert not layout.zip64


# ---------------------------------------------------------------------------------------------
# storage offsets


@given(obj=OBJECTS, config=CONFIGS)
def test_storage_offsets_cursor_path_file_bytes(workdir: Path, obj: Any,
                                                config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        expected = {s.key: s.data_offset for s in layout.storages}
        with open(path, "rb") as f:
            via_file = ckptlab.storage_offsets(f)
            from_file = ckptlab.inspect(f)
        raw = path.read_bytes()
        results = {"path": ckptlab.storage_offsets(path), "file": via_file,
                   "bytes": ckptlab.storage_offsets(raw),
                   "str": ckptlab.storage_offsets(str(path)),
                   "scan": ckptlab.storage_offsets(path, scan=True),
                   "scan-file": ckptlab.storage_offsets(io.BytesIO(raw), scan=True),
                   "no-scan": ckptlab.storage_offsets(path, scan=False)}
    for how, res in results.items():
        assert res.offsets == expected, how
        assert res.method == "cursor", (how, res.reason)
        assert res.reason is None
        # see test_storage_offsets_reads_with_disabled_byteorder_record for the exception
        if not config.disable_byteorder_record:
            assert res.reads <= 3, (how, res.reads)
        assert res.bytes_read > 0  # reads may overlap (tail window, then the head)
        assert res.archive_name == layout.archive_name
        assert res.alignment == config.alignment
    # inspect reads the same layout through every kind of source
    for other in (from_file, ckptlab.inspect(raw)):
        assert dataclasses.replace(other, path=layout.path) == layout
    # in pickle order (the order torch assigns keys and writes records)
    assert list(results["path"].offsets) == [s.key for s in layout.storages]
    assert [int(k) for k in results["path"].offsets] == list(range(len(layout.storages)))


@pytest.mark.skipif(not META_OFFSETS, reason=f"torch {torch.__version__} records no "
                    "offsets on a meta load (FakeTensorMode below checks them)")
@given(obj=OBJECTS, config=CONFIGS)
def test_offsets_match_meta_load_checkpoint_offset(workdir: Path, obj: Any,
                                                   config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        loaded = load_meta(path)
    by_key = {s.key: s for s in layout.storages}
    seen = set()
    for t in layout.tensors:
        tensor = get_path(loaded, t.path)
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"
        storage = tensor.untyped_storage()
        assert tc.checkpoint_offset(storage) == by_key[t.storage_key].data_offset, t.path
        assert storage.nbytes() == by_key[t.storage_key].nbytes, t.path
        seen.add(t.storage_key)
    # every storage is viewed by some tensor (state_dicts never saves bare storages)
    assert seen == set(by_key)
    offsets = {p: tc.checkpoint_offset(tt.untyped_storage())
               for p, tt in cst.iter_tensors(loaded)}
    assert set(offsets.values()) == {s.data_offset for s in layout.storages}


@settings(max_examples=5)
@given(obj=OBJECTS, config=CONFIGS)
def test_offsets_match_fake_tensor_mode_load(workdir: Path, obj: Any,
                                             config: cst.SaveConfig) -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        with FakeTensorMode():
            loaded = torch.load(path, weights_only=False)
    by_key = {s.key: s for s in layout.storages}
    for t in layout.tensors:
        tensor = get_path(loaded, t.path)
        assert isinstance(tensor, FakeTensor) or isinstance(tensor, torch.nn.Parameter)
        assert tc.checkpoint_offset(tensor.untyped_storage()) == by_key[t.storage_key].data_offset
        assert tuple(tensor.shape) == t.shape and tensor.stride() == t.stride


# ---------------------------------------------------------------------------------------------
# predicted layouts


def assert_same_layout(predicted: ckptlab.format.ArchiveLayout,
                       actual: ckptlab.format.ArchiveLayout) -> None:
    """Field by field, segments included."""
    assert predicted.file_nbytes == actual.file_nbytes
    assert predicted.archive_name == actual.archive_name
    assert [r.name for r in predicted.records] == [
        r.name for r in sorted(actual.records, key=lambda r: r.header_offset)]
    real = {r.name: r for r in actual.records}
    for p in predicted.records:
        a = real[p.name]
        for field in ("header_offset", "name_nbytes", "extra_nbytes", "zip64_extra_nbytes",
                      "padding_nbytes", "data_offset", "data_nbytes", "descriptor_nbytes",
                      "uncompressed_nbytes", "method", "end_offset"):
            assert getattr(p, field) == getattr(a, field), (p.name, field)
    assert predicted.central_directory_offset == actual.central_directory_offset
    assert predicted.central_directory_nbytes == actual.central_directory_nbytes
    assert predicted.zip64_eocd_offset == actual.zip64_eocd_offset
    assert predicted.zip64_locator_offset == actual.zip64_locator_offset
    assert predicted.eocd_offset == actual.eocd_offset
    assert predicted.zip64 == actual.zip64
    assert [(s.key, s.data_offset, s.nbytes, s.dtype, s.storage_type) for s in
            predicted.storages] == [(s.key, s.data_offset, s.nbytes, s.dtype, s.storage_type)
                                    for s in actual.storages]
    assert predicted.tensors == actual.tensors
    assert [(s.kind, s.offset, s.nbytes, s.record) for s in predicted.segments] == [
        (s.kind, s.offset, s.nbytes, s.record) for s in actual.segments]
    assert predicted.alignment == actual.alignment
    assert predicted.storage_alignment == actual.storage_alignment
    assert predicted.byteorder == actual.byteorder
    assert predicted.pickle_protocol == actual.pickle_protocol


@given(obj=OBJECTS, config=CONFIGS, to_buffer=st.booleans())
def test_predict_layout_equals_saved_file(workdir: Path, obj: Any, config: cst.SaveConfig,
                                          to_buffer: bool) -> None:
    if to_buffer:  # a file object: archive name "archive"; skip_data writes zeros there
        buf = io.BytesIO()
        config.save_to(obj, buf)
        actual = ckptlab.inspect(buf.getvalue())
        archive_name = "archive"
    else:
        with fresh_dir(workdir) as d:
            path = config.save(obj, d)
            actual = ckptlab.inspect(path)
        archive_name = ckptlab.format.archive_name_for(path)
    predicted = ckptlab.predict_layout(obj, alignment=config.alignment,
                                       archive_name=archive_name,
                                       pickle_protocol=config.pickle_protocol,
                                       disable_byteorder_record=config.disable_byteorder_record)
    assert_same_layout(predicted, actual)


# ---------------------------------------------------------------------------------------------
# tensors and names


def storage_bytes(t: torch.Tensor) -> bytes:
    s = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,))
    return flat.numpy().tobytes()


@given(obj=OBJECTS, config=CONFIGS)
def test_tensor_infos_match_loaded_tensors(workdir: Path, obj: Any,
                                           config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        loaded = torch.load(path, weights_only=False)
        raw = path.read_bytes()
    loaded_paths = {p for p, _ in cst.iter_tensors(loaded)}
    assert {t.path for t in layout.tensors} == loaded_paths
    assert len(layout.tensors) == len(loaded_paths)
    by_key = {s.key: s for s in layout.storages}
    storage_of_key: dict[str, int] = {}
    for t in layout.tensors:
        real = get_path(loaded, t.path)
        orig = get_path(obj, t.path)
        assert t.dtype == str(real.dtype).removeprefix("torch."), t.path
        assert t.shape == tuple(real.shape), t.path
        assert t.stride == real.stride(), t.path
        assert t.storage_offset == real.storage_offset(), t.path
        assert t.requires_grad == real.requires_grad == orig.requires_grad, t.path
        assert t.is_parameter == isinstance(real, torch.nn.Parameter) == isinstance(
            orig, torch.nn.Parameter), t.path
        s = by_key[t.storage_key]
        assert s.nbytes == real.untyped_storage().nbytes() == orig.untyped_storage().nbytes()
        assert s.device == "cpu"
        # tensors sharing a storage in the file share it after loading, and vice versa
        ptr = real.untyped_storage().data_ptr() if s.nbytes else -1 - int(t.storage_key)
        assert storage_of_key.setdefault(t.storage_key, ptr) == ptr
        if not config.skip_data:  # the storage's bytes are where ckptlab says
            assert raw[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(orig), t.path
    distinct = {v for v in storage_of_key.values()}
    assert len(distinct) == len(storage_of_key)


@given(obj=OBJECTS, config=CONFIGS)
def test_archive_name(workdir: Path, obj: Any, config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        with zipfile.ZipFile(path) as zf:
            prefixes = {n.split("/", 1)[0] for n in zf.namelist()}
        offsets = ckptlab.storage_offsets(path)
    assert layout.archive_name == ckptlab.format.archive_name_for(path) == offsets.archive_name
    assert prefixes == {layout.archive_name}
    assert ckptlab.format.archive_name_for(str(path)) == ckptlab.format.archive_name_for(path.name)
    assert all(r.name.startswith(layout.archive_name + "/") for r in layout.records)


@pytest.mark.parametrize("filename, archive", [
    ("a.b.c.pt", "a.b.c"), ("model", "model"), ("x.y", "x"), ("trailing.", "trailing"),
    ("dots..pt", "dots."), ("with space.bin", "with space"), ("módel.pt", "archive"),
    ("weights.pth.tar", "weights.pth"),
])
def test_archive_name_examples(tmp_path: Path, filename: str, archive: str) -> None:
    path = tmp_path / filename
    torch.save({"w": torch.ones(2)}, path)
    assert ckptlab.format.archive_name_for(path) == archive
    assert ckptlab.inspect(path).archive_name == archive


# ---------------------------------------------------------------------------------------------
# regressions: each of these failed once (v3 dtypes, byteorder prediction, read count with a
# trailing byteorder record, tensors with Python attributes)


def test_rebuild_v3_dtypes_are_scanned(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"x": torch.zeros(2, dtype=torch.uint16)}, path)
    layout = ckptlab.inspect(path)
    assert layout.tensors[0].dtype == "uint16"
    assert layout.storages[0].data_offset == tc.pytorch_file_reader()(
        str(path)).get_record_offset("data/0")


@settings(max_examples=10, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(obj=cst.state_dicts(require_dtype=cst.REBUILD_V3_DTYPES), config=CONFIGS)
def test_all_dtypes_offsets_and_predictions(workdir: Path, obj: Any,
                                            config: cst.SaveConfig) -> None:
    with fresh_dir(workdir) as d:
        path = config.save(obj, d)
        layout = ckptlab.inspect(path)
        loaded = load_with_offsets(path)
        reader = tc.pytorch_file_reader()(str(path))
        offsets = ckptlab.storage_offsets(path, scan=True)
    for r in layout.records:
        assert r.data_offset == reader.get_record_offset(r.short_name)
    assert offsets.offsets == {s.key: s.data_offset for s in layout.storages}
    for t in layout.tensors:
        real = get_path(loaded, t.path)
        assert t.dtype == str(real.dtype).removeprefix("torch.")
        assert tc.checkpoint_offset(real.untyped_storage()) == layout.storage(
            t.storage_key).data_offset
    predicted = ckptlab.predict_layout(obj, alignment=config.alignment,
                                       archive_name=ckptlab.format.archive_name_for(path),
                                       pickle_protocol=config.pickle_protocol,
                                       disable_byteorder_record=config.disable_byteorder_record)
    assert_same_layout(predicted, layout)


def test_predict_byteorder_with_disabled_record(tmp_path: Path) -> None:
    obj = {"w": torch.ones(2)}
    path = tmp_path / "m.pt"
    torch.save(obj, path, _disable_byteorder_record=True)
    actual = ckptlab.inspect(path)
    predicted = ckptlab.predict_layout(obj, archive_name="m", disable_byteorder_record=True)
    assert [r.name for r in predicted.records] == [r.name for r in actual.records]
    assert actual.byteorder == "little"
    assert predicted.byteorder == actual.byteorder


@pytest.mark.parametrize("scan", [False, True])
def test_storage_offsets_reads_with_disabled_byteorder_record(tmp_path: Path,
                                                              scan: bool) -> None:
    from torch.utils.serialization import config

    path = tmp_path / "m.pt"
    with config.patch({"save.storage_alignment": 4096}):
        torch.save({"w": torch.zeros(20000)}, path, _disable_byteorder_record=True)
    res = ckptlab.storage_offsets(path, scan=scan)
    assert res.method == "cursor"
    assert res.offsets == {"0": ckptlab.inspect(path).storage("0").data_offset}
    assert res.reads <= 3


def test_tensor_with_python_attribute_is_listed(tmp_path: Path) -> None:
    t = torch.arange(6, dtype=torch.float32)[2:]
    t.note = "x"
    obj = {"t": t, "u": torch.ones(2)}
    path = tmp_path / "m.pt"
    torch.save(obj, path)
    layout = ckptlab.inspect(path)
    loaded = load_meta(path)
    assert {i.path for i in layout.tensors} == {p for p, _ in cst.iter_tensors(loaded)}
    info = next(i for i in layout.tensors if i.path == ("t",))
    assert (info.shape, info.stride, info.storage_offset) == ((4,), (1,), 2)
