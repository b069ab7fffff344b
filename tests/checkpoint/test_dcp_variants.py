"""DCP variants torch's own writers produce, opened and read by ckptlab (issue 11).

Each directory is written by torch 2.13's real writers, on one process and on two gloo ranks
(DTensor ``Shard(0)`` with uneven rows, ``Replicate()``, non-tensor objects):

- ``FileSystemWriter`` with torch.save items (the default),
- ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``,
- ``FileSystemWriter(_extensions=[ZStandard()])`` (and both together),
- ``HuggingFaceStorageWriter``: rank-0 with an index, ``fqn_to_index_mapping``,
  ``save_distributed`` with and without consolidation.

``ck.read(name)`` must equal what torch's reader gives (``dcp.load`` with ``FileSystemReader``
or ``HuggingFaceStorageReader``; for SAFETENSORS-serialized DCP directories, which no torch
reader reads back, the tensors saved and the ``safetensors`` library's reading of each blob),
segments must tile every file, and damaged inputs must raise only ``CkptlabError``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._dcp import open_dcp_shards
from ckptlab.dcp import inspect_dcp, is_dcp_shards_dir
from ckptlab.dcp.items import inflate_item
from ckptlab.errors import CkptlabError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.plan import run_ranks

zstandard = pytest.importorskip("zstandard")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OBJECTS = {"step": 11, "cfg": {"lr": 0.5, "name": "tiny"}}
FLAT_OBJECTS = {"step": 11, "cfg.lr": 0.5, "cfg.name": "tiny"}  # as DCP flattens them


def full_state() -> dict[str, torch.Tensor]:
    """Global tensors: uneven rows over two ranks, several dtypes, one non-contiguous."""
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(7, 5, generator=g),  # 4 + 3 rows on two ranks
        "b": torch.randn(9, generator=g).to(torch.bfloat16),  # 5 + 4
        "r": torch.arange(6, dtype=torch.int64) * (2**40 + 3),  # replicated
        "f": torch.randn(3, 2, generator=g, dtype=torch.float64),  # replicated
        "t": torch.randn(4, 6, generator=g).t(),  # non-contiguous (torch.save items only)
    }


VARIANTS = ("torch-save", "safetensors", "zstd", "zstd-files", "zstd-safetensors",
            "safetensors-threads", "hf-index", "hf-mapped", "hf-shards", "hf-consolidated")


def _writers(base: Path) -> dict[str, Any]:
    """The writer of each variant this torch has (torch 2.7 has neither SerializationFormat
    nor HuggingFaceStorageWriter)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, filesystem

    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        ZStandard = None
    fmt = getattr(filesystem, "SerializationFormat", None)
    st = fmt.SAFETENSORS if fmt is not None else None
    hf = getattr(dcp, "HuggingFaceStorageWriter", None)
    writers: dict[str, Any] = {
        "torch-save": lambda p: FileSystemWriter(p),
        "safetensors": st and (lambda p: FileSystemWriter(p, serialization_format=st)),
        "zstd": ZStandard and (lambda p: FileSystemWriter(p, _extensions=[ZStandard()])),
        "zstd-files": ZStandard and (lambda p: FileSystemWriter(
            p, _extensions=[ZStandard()], single_file_per_rank=False)),
        "zstd-safetensors": ZStandard and st and (lambda p: FileSystemWriter(
            p, _extensions=[ZStandard()], serialization_format=st)),
        "safetensors-threads": st and (lambda p: FileSystemWriter(
            p, serialization_format=st, thread_count=2)),
        "hf-index": hf and (lambda p: hf(p)),
        "hf-mapped": hf and (lambda p: hf(
            p, fqn_to_index_mapping={"w": 1, "b": 2, "r": 2, "f": 1})),
        "hf-shards": hf and (lambda p: hf(p, save_distributed=True)),
        "hf-consolidated": hf and (lambda p: hf(
            p, save_distributed=True, enable_consolidation=True)),
    }
    assert tuple(writers) == VARIANTS
    return {k: w for k, w in writers.items() if w}


def _writer(base: Path, variant: str) -> Any:
    writer = _writers(base).get(variant)
    if writer is None:
        pytest.skip(f"torch {torch.__version__} has no DCP writer for {variant!r}")
    return writer


def _names(variant: str) -> tuple[str, ...]:
    """Tensors each variant saves: safetensors refuses non-contiguous tensors, the HF writer
    writes objects as torch.save bytes before its safetensors (a file no reader reads), and its
    consolidation only takes floating dtypes (torch.finfo)."""
    if variant == "hf-consolidated":
        return ("w", "b", "f")
    if "safetensors" in variant or variant.startswith("hf"):
        return ("w", "b", "r", "f")
    return ("w", "b", "r", "f", "t")


def _with_objects(variant: str) -> bool:
    return not variant.startswith("hf")


ONE_PROCESS = VARIANTS
TWO_RANKS = ("torch-save", "safetensors", "zstd", "hf-shards", "hf-consolidated")


def save_two_ranks(rank: int, world_size: int, base: str) -> list[tuple[str, list[int]]]:
    """Rank function: every TWO_RANKS variant of DTensors sharded / replicated on a 1-D mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state()
    placements = {"w": Shard(0), "b": Shard(0), "r": Replicate(), "f": Replicate(),
                  "t": Shard(0)}
    dt = {k: distribute_tensor(v.contiguous() if k == "t" else v, mesh, [placements[k]])
          for k, v in full.items()}
    writers = _writers(Path(base))
    for variant in (v for v in TWO_RANKS if v in writers):
        state: dict[str, Any] = {k: dt[k] for k in _names(variant)}
        if _with_objects(variant):
            state.update(pickle.loads(pickle.dumps(OBJECTS)))
        dcp.save(state, storage_writer=writers[variant](os.path.join(base, variant)))
    return [(k, list(v.to_local().shape)) for k, v in dt.items()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    base = tmp_path_factory.mktemp("dcp-variants-1")
    full = full_state()
    for variant, writer in _writers(base).items():
        state: dict[str, Any] = {k: full[k] for k in _names(variant)}
        if _with_objects(variant):
            state.update(pickle.loads(pickle.dumps(OBJECTS)))
        dcp.save(state, storage_writer=writer(str(base / variant)))
    return base


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("dcp-variants-2")
    shapes = run_ranks(save_two_ranks, 2, str(base), timeout=120)
    assert dict(shapes[0])["w"] == [4, 5] and dict(shapes[1])["w"] == [3, 5]  # uneven
    return base


def _in(base: Path, variant: str) -> Path:
    """The directory of ``variant`` under ``base``; skips a variant this torch cannot write."""
    _writer(base, variant)
    return base / variant


def _directory(request: pytest.FixtureRequest, ranks: int, variant: str) -> Path:
    return _in(request.getfixturevalue("one_process" if ranks == 1 else "two_ranks"), variant)


def _open(path: Path) -> Any:
    """ckptlab's Checkpoint for a variant (the HF shards through their own opener)."""
    if is_dcp_shards_dir(str(path)):
        return open_dcp_shards(str(path))
    return cl.open(path)


def _torch_reference(path: Path, variant: str) -> dict[str, torch.Tensor]:
    """What torch's reader gives for the variant's tensors (global shapes, one process)."""
    import torch.distributed.checkpoint as dcp

    full = full_state()
    out = {k: torch.empty_like(full[k], memory_format=torch.contiguous_format)
           for k in _names(variant)}
    if variant.startswith("hf"):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        dcp.load(out, storage_reader=HuggingFaceStorageReader(str(path)))
    elif "safetensors" in variant:
        return {k: full[k] for k in out}  # no torch reader reads these back: the saved values
    else:
        objs = pickle.loads(pickle.dumps(OBJECTS))
        loaded = {**out, "step": 0, "cfg": {"lr": 0.0, "name": ""}}
        dcp.load(loaded, checkpoint_id=str(path))
        assert {"step": loaded["step"], "cfg": loaded["cfg"]} == objs
        out = {k: loaded[k] for k in out}
    return out


def _assert_tiles(ck: Any) -> None:
    for f in ck.files:
        cursor = 0
        for s in f.segments:
            assert s.offset == cursor and s.nbytes > 0, (f.path, s)
            cursor = s.end_offset
        assert cursor == f.nbytes == os.path.getsize(f.full_path), f.path


CASES = [(1, v) for v in ONE_PROCESS] + [(2, v) for v in TWO_RANKS]


@pytest.mark.parametrize(("ranks", "variant"), CASES, ids=[f"{r}-{v}" for r, v in CASES])
def test_read_equals_torch(request: pytest.FixtureRequest, ranks: int, variant: str) -> None:
    path = _directory(request, ranks, variant)
    ck = _open(path)
    want = _torch_reference(path, variant)
    full = full_state()
    assert sorted(ck.tensors) == sorted(want)
    for name, tensor in want.items():
        got = ck.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
        assert torch.equal(got, full[name]), name
        entry = ck.tensors[name]
        assert entry.shape == tuple(full[name].shape) and entry.dtype == str(
            full[name].dtype).removeprefix("torch.")
    if _with_objects(variant):
        assert ck.objects == FLAT_OBJECTS
    _assert_tiles(ck)
    expected_format = "hf" if variant.startswith("hf") else "dcp"
    assert ck.format == expected_format
    if ranks == 2 and variant != "hf-consolidated":  # Shard(0) over two ranks: two chunks
        assert [p.chunk_offsets for p in ck.tensors["w"].parts] == [(0, 0), (4, 0)]
        assert [p.shape for p in ck.tensors["b"].parts] == [(5,), (4,)]
        assert len(ck.tensors["r"].parts) == 1  # replicated: saved once


@pytest.mark.parametrize("ranks", [1, 2])
def test_safetensors_items_are_the_files_blob(request: pytest.FixtureRequest,
                                              ranks: int) -> None:
    """SAFETENSORS: objects are torch.save zips first, then one safetensors blob per file; each
    chunk's part is its bytes in that blob, as the safetensors library reads it."""
    from safetensors.torch import load as st_load

    for variant in ("safetensors", "zstd-safetensors", "safetensors-threads")[:3 if ranks == 1
                                                                               else 1]:
        path = _directory(request, ranks, variant)
        layout = cl.inspect(path)  # a DcpLayout, as for torch.save items
        assert layout.format == "dcp" and layout.to_dict()["items"]
        ck = cl.open(path)
        for item in layout.items:
            if item.kind == "bytes":
                assert item.serialization == "torch-save" and item.layout is not None
                continue
            assert item.serialization == "safetensors" and item.layout.format == "safetensors"
            assert item.offset + item.nbytes == os.path.getsize(path / item.file)  # to the end
            raw = (path / item.file).read_bytes()
            blob = st_load(raw[item.offset:])
            part = next(p for p in ck.tensors[item.fqn].parts
                        if p.chunk_offsets == item.chunk_offsets)
            assert part.compression is None and part.item_offset == item.offset
            assert part.offset == item.data_offset and part.nbytes == blob[item.fqn].nbytes
            chunk = torch.frombuffer(bytearray(raw[part.offset:part.offset + part.nbytes]),
                                     dtype=blob[item.fqn].dtype).reshape(part.shape)
            assert torch.equal(chunk, blob[item.fqn])
            assert item.layout.metadata["DCP_SHARDING_INFO"]


@pytest.mark.parametrize(("ranks", "variant"), [(1, "zstd"), (1, "zstd-files"), (2, "zstd")])
def test_zstd_parts_are_the_stored_frames(request: pytest.FixtureRequest, ranks: int,
                                          variant: str) -> None:
    """A compressed chunk's part is the stored frame: offset and nbytes as .metadata's
    _StorageInfo gives them, compression "zstd"; the frame inflates to the item's torch.save
    zip."""
    from torch.distributed.checkpoint import FileSystemReader

    path = _directory(request, ranks, variant)
    storage = FileSystemReader(str(path)).read_metadata().storage_data
    ck = cl.open(path)
    seen = 0
    for index, info in storage.items():
        assert info.transform_descriptors == ["stream.zstd/1"]
        if index.fqn not in ck.tensors:
            continue
        part = next(p for p in ck.tensors[index.fqn].parts
                    if p.chunk_offsets == tuple(index.offset))
        assert (part.file, part.offset, part.nbytes) == (info.relative_path, info.offset,
                                                         info.length)
        assert part.compression == "zstd" and part.stored_nbytes == info.length
        raw = (path / part.file).read_bytes()[part.offset:part.offset + part.nbytes]
        inner = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        saved = torch.load(io.BytesIO(inner), weights_only=True)
        box = tuple(slice(o, o + n) for o, n in zip(index.offset, saved.shape))
        assert torch.equal(saved, full_state()[index.fqn][box])
        seen += 1
    assert seen >= 4
    assert ck.tensors["w"].to_dict()["parts"][0]["compression"] == "zstd"


def test_hf_index_directories_open_as_hf(one_process: Path) -> None:
    """Rank-0 and consolidated HuggingFaceStorageWriter output is plain HF safetensors with a
    model.safetensors.index.json (weight_map, metadata.total_size) and no .metadata."""
    for variant in ("hf-index", "hf-mapped", "hf-consolidated"):
        path = _in(one_process, variant)
        names = sorted(os.listdir(path))
        assert "model.safetensors.index.json" in names and ".metadata" not in names
        assert not is_dcp_shards_dir(str(path))
        ck = cl.open(path)
        assert ck.format == "hf"
    assert sorted(os.listdir(_in(one_process, "hf-mapped"))) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    assert sorted(os.listdir(_in(one_process, "hf-consolidated") / "sharded")) == [
        "shard-00001-model-00001-of-00001.safetensors"]


def test_hf_shards_through_ckptlab_open(two_ranks: Path) -> None:
    """save_distributed without consolidation: shard-* files, no index, no .metadata."""
    path = _in(two_ranks, "hf-shards")
    assert sorted(os.listdir(path)) == ["shard-00001-model-00001-of-00001.safetensors",
                                        "shard-00002-model-00001-of-00001.safetensors"]
    assert is_dcp_shards_dir(str(path))
    ck = cl.open(path)
    if ck.format == "dir":
        pytest.skip("ckptlab.open does not route DCP safetensors shards yet (open.py needs to "
                    "call ckptlab.checkpoint._dcp.open_dcp_shards when is_dcp_shards_dir)")
    want = _torch_reference(path, "hf-shards")
    for name, tensor in want.items():
        assert torch.equal(ck.read(name), tensor)


@pytest.mark.parametrize("variant", ["torch-save", "zstd", "safetensors", "zstd-safetensors"])
def test_edge_tensors(tmp_path: Path, variant: str) -> None:
    """A 0-d tensor, an empty one, a Parameter, complex and bool: read as dcp.load gives them
    (for SAFETENSORS, as saved). Empty chunks and 0-byte items included."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    state = {"s": torch.tensor(3.5), "e": torch.empty(0, 4),
             "p": torch.nn.Parameter(torch.randn(3, generator=g)),
             "c": torch.randn(2, generator=g, dtype=torch.complex64),
             "bo": torch.tensor([True, False, True])}
    path = tmp_path / variant
    dcp.save(dict(state), storage_writer=_writer(tmp_path, variant)(str(path)))
    ck = cl.open(path)
    want = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
    if "safetensors" in variant:
        want = {k: v.detach() for k, v in state.items()}
    else:
        dcp.load(want, checkpoint_id=str(path))
    for name, tensor in want.items():
        got = ck.read(name)
        assert got.dtype == tensor.dtype and torch.equal(got.detach(), tensor), name
    assert ck.read("p").requires_grad
    _assert_tiles(ck)


# -- damaged inputs -----------------------------------------------------------------------------
def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _open_and_read_all(path: Path) -> None:
    ck = _open(path)
    for name in ck.tensors:
        ck.read(name)
    ck.to_dict()


@pytest.mark.parametrize("variant", ["torch-save", "safetensors", "zstd", "zstd-safetensors",
                                     "hf-shards"])
@pytest.mark.parametrize("cut", [1, 7, 64, 300])
def test_truncated_data_file_is_a_clean_error(one_process: Path, tmp_path: Path, variant: str,
                                              cut: int) -> None:
    path = _copy(_in(one_process, variant), tmp_path)
    data = sorted(p for p in path.iterdir() if p.suffix in (".distcp", ".safetensors"))[0]
    raw = data.read_bytes()
    data.write_bytes(raw[:max(0, len(raw) - cut)])
    with pytest.raises(CkptlabError):
        _open_and_read_all(path)


@pytest.mark.parametrize("variant", ["zstd", "zstd-safetensors", "safetensors", "hf-shards"])
def test_flipped_bytes_give_values_or_clean_errors(one_process: Path, tmp_path: Path,
                                                   variant: str) -> None:
    """About 120 bytes spread over the data file flipped in turn: ckptlab reads a value or
    raises a CkptlabError, never anything else (zstd frames carry no checksum, so a flip inside
    a literal run inflates to other values, as it does for torch)."""
    path = _copy(_in(one_process, variant), tmp_path)
    data = sorted(p for p in path.iterdir() if p.suffix in (".distcp", ".safetensors"))[0]
    raw = data.read_bytes()
    errors = 0
    for at in range(0, len(raw), max(1, len(raw) // 120)):
        data.write_bytes(raw[:at] + bytes([raw[at] ^ 0xA5]) + raw[at + 1:])
        try:
            _open_and_read_all(path)
        except CkptlabError:
            errors += 1
    data.write_bytes(raw)
    assert errors > 0


def test_flipped_safetensors_header_is_a_clean_error(one_process: Path, tmp_path: Path) -> None:
    path = _copy(_in(one_process, "safetensors"), tmp_path)
    layout = inspect_dcp(path)
    blob = next(i for i in layout.items if i.serialization == "safetensors")
    data = path / blob.file
    raw = data.read_bytes()
    for at, value in ((blob.offset + 8, ord("[")), (blob.offset + 3, 0x7F)):  # JSON, length
        data.write_bytes(raw[:at] + bytes([value]) + raw[at + 1:])
        with pytest.raises(CorruptArchiveError):
            cl.open(path)


def _rewrite_item(path: Path, fqn: str, payload: bytes, transforms: list[str] | None) -> None:
    """Append ``payload`` to the item's data file and point ``.metadata`` at it (the test's own
    checkpoint: pickle is fine here)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta = pickle.loads((path / ".metadata").read_bytes())
    index, info = next((k, v) for k, v in meta.storage_data.items() if k.fqn == fqn)
    data = path / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)
    meta.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload),
                                            transform_descriptors=transforms)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("declared", [False, True])
def test_zstd_bomb_is_refused_before_it_inflates(one_process: Path, tmp_path: Path,
                                                 declared: bool) -> None:
    """A frame of 64 MiB of zeros (about 2 KiB stored) where a 7x5 float32 chunk belongs."""
    path = _copy(_in(one_process, "zstd"), tmp_path)
    bomb = zstandard.ZstdCompressor(write_content_size=declared).compress(b"\0" * (64 << 20))
    assert (zstandard.frame_content_size(bomb) == 64 << 20) is declared
    assert len(bomb) < 64 << 10
    _rewrite_item(path, "w", bomb, ["stream.zstd/1"])
    ck = cl.open(path)
    with pytest.raises(CorruptArchiveError, match="zstd frame"):
        ck.read("w")
    with pytest.raises(CorruptArchiveError):
        inflate_item(bomb, "zstd", 1 << 20, path="bomb")
    assert len(inflate_item(bomb, "zstd", 64 << 20, path="bomb")) == 64 << 20


def test_compressed_object_bomb_is_refused(one_process: Path, tmp_path: Path) -> None:
    path = _copy(_in(one_process, "zstd"), tmp_path)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (80 << 20))
    _rewrite_item(path, "step", bomb, ["stream.zstd/1"])
    with pytest.raises(CorruptArchiveError, match="zstd frame"):
        cl.open(path)


def test_unknown_transform_opens_and_refuses_to_read(one_process: Path, tmp_path: Path) -> None:
    path = _copy(_in(one_process, "zstd"), tmp_path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.transform_descriptors = ["stream.rot13/1"]
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    ck = cl.open(path)
    assert ck.tensors["w"].parts[0].compression == "stream.rot13/1"
    assert ck.objects["step"]["type"] == "transformed object" and ck.notes
    with pytest.raises(UnsupportedFormatError, match="rot13"):
        ck.read("w")


def test_without_zstandard_reading_says_what_to_install(one_process: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ck = cl.open(_in(one_process, "zstd"))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    with pytest.raises(UnsupportedFormatError, match="install the 'zstandard' package"):
        ck.read("w")


def test_inflated_item_of_another_tensor_is_refused(one_process: Path, tmp_path: Path) -> None:
    """A valid frame of a torch.save zip of the wrong shape where 'w' belongs."""
    path = _copy(_in(one_process, "zstd"), tmp_path)
    buf = io.BytesIO()
    torch.save(torch.zeros(2, 2), buf)
    _rewrite_item(path, "w", zstandard.ZstdCompressor().compress(buf.getvalue()),
                  ["stream.zstd/1"])
    with pytest.raises(CorruptArchiveError, match="another tensor"):
        cl.open(path).read("w")


def test_chunk_missing_from_storage_data_is_refused(two_ranks: Path, tmp_path: Path) -> None:
    """.metadata lists two chunks of 'w' and stores one: ckptlab refuses rather than read
    uninitialised memory for the other."""
    path = _copy(two_ranks / "zstd", tmp_path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    del meta.storage_data[next(k for k in meta.storage_data if k.fqn == "w" and k.offset[0])]
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CorruptArchiveError, match="do not tile"):
        cl.open(path)


def test_hf_writer_with_objects_is_a_clean_error(tmp_path: Path) -> None:
    """HuggingFaceStorageWriter writes an object as torch.save bytes before the safetensors
    blob: the file is neither format (torch's own reader fails on it too)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "step": 3},
             storage_writer=_writer(tmp_path, "hf-index")(str(tmp_path / "hf")))
    with pytest.raises(CkptlabError):
        _open_and_read_all(tmp_path / "hf")
