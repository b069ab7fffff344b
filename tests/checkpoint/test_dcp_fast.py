"""The fast DCP open (issue 13, target 3): same checkpoint as the general path, same errors.

``open_dcp(root)`` decodes ``.metadata`` into columns and builds tensors on first access
(:mod:`ckptlab.checkpoint._dcp_fast`); ``open_dcp(root, fast=False)`` reads every item at open.
On real ``dcp.save`` directories (one process) and on directories built by the synthetic
writer (N simulated ranks, real torch.save items, read back by torch's own ``dcp.load``), both
must give the same names, dtypes, shapes, parts (file, offset, nbytes, stride, chunk offsets),
file segments, objects and JSON. Mutated and truncated ``.metadata`` files must give ckptlab
errors through the fast path, never a raw exception, and whenever the columnar decoder accepts
a file, the bounded interpreter must accept it too and decode the same values.
"""

from __future__ import annotations

import pickle
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ckptlab as cl
from ckptlab.checkpoint._dcp import open_dcp
from ckptlab.checkpoint._dcp_fast import DcpCheckpoint
from ckptlab.dcp._decode import decode_metadata
from ckptlab.dcp.columns import decode_columns
from ckptlab.errors import CkptlabError, CorruptArchiveError
from ckptlab.plan._synthetic_dcp import write_synthetic_dcp
from ckptlab.testing.pickles import pickle_mutations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(7, 5, generator=g),
                  "b": torch.randn(9, generator=g).to(torch.bfloat16),
                  "t": torch.randn(4, 6, generator=g).t(),  # non-contiguous item
                  "s": torch.tensor(2.5),  # 0-d
                  "e": torch.empty(0, 3),  # no elements
                  "i": torch.arange(6, dtype=torch.int64) * (2**40 + 3)},
        "step": 11, "cfg": {"lr": 0.5, "name": "tiny"},
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("fast") / "real"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=root, no_dist=True)
    return root


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fast") / "ranks"
    write_synthetic_dcp(root, tensors=23, ranks=6)
    return root


def _assert_same(fast: Any, slow: Any) -> None:
    assert isinstance(fast, DcpCheckpoint) and not isinstance(slow, DcpCheckpoint)
    assert list(fast.tensors) == list(slow.tensors)
    for name, want in slow.tensors.items():
        got = fast.tensors[name]
        assert (got.name, got.path, got.dtype, got.shape, got.stride) == (
            want.name, want.path, want.dtype, want.shape, want.stride), name
        assert [(p.file, p.offset, p.nbytes, p.stride, p.chunk_offsets, p.item_offset)
                for p in got.parts] == [(p.file, p.offset, p.nbytes, p.stride, p.chunk_offsets,
                                         p.item_offset) for p in want.parts], name
        assert got == want, name
    assert [f.path for f in fast.files] == [f.path for f in slow.files]
    for a, b in zip(fast.files, slow.files):
        assert tuple(a.segments) == tuple(b.segments), a.path
        assert a == b and a.full_path == b.full_path
    assert fast.objects == slow.objects and fast.notes == slow.notes
    assert fast.to_dict() == slow.to_dict()


@pytest.mark.parametrize("which", ["one_process", "ranks"])
def test_fast_open_equals_general_open(request: pytest.FixtureRequest, which: str) -> None:
    root = request.getfixturevalue(which)
    fast = cl.open(root)
    _assert_same(fast, open_dcp(str(root), fast=False))
    for name in fast.tensors:  # and reads what the general path reads
        assert torch.equal(fast.read(name), open_dcp(str(root), fast=False).read(name))


def test_fast_open_reads_what_torch_loads(one_process: Path, ranks: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ck = cl.open(one_process)
    full = _state()
    for key, tensor in full["model"].items():
        assert torch.equal(ck.read(f"model.{key}"), tensor)
    assert ck.objects == {"step": 11, "cfg.lr": 0.5, "cfg.name": "tiny"}
    ck = cl.open(ranks)
    meta = dcp.FileSystemReader(str(ranks)).read_metadata()  # the test's own file
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    dcp.load(want, checkpoint_id=str(ranks), no_dist=True)
    assert sorted(ck.tensors) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ck.read(name), tensor), name
        assert len(ck.tensors[name].parts) == 6


def test_tensors_are_built_on_access(ranks: Path) -> None:
    ck = cl.open(ranks)
    assert "0 built" in repr(ck.tensors) and len(ck.tensors) == 23
    first = next(iter(ck.tensors))
    assert ck.tensors[first] is ck.tensors[first]
    assert "1 built" in repr(ck.tensors)
    with pytest.raises(KeyError):
        ck.tensors["nope"]
    assert "not built yet" in repr(ck.files[1].segments)


def _metadata_values(meta: Any) -> dict[str, Any]:
    """What the columns hold, from DCP's Metadata (the converter's output)."""
    tensors, objects = {}, []
    for fqn, md in meta.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            tensors[fqn] = (str(md.properties.dtype).removeprefix("torch."),
                            md.properties.requires_grad, tuple(md.size),
                            [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
        else:
            objects.append(fqn)
    entries = [(k.fqn, k.index if k.index is not None else -1,
                None if k.offset is None else tuple(k.offset), v.relative_path, v.offset,
                v.length) for k, v in meta.storage_data.items()]
    return {"tensors": tensors, "objects": objects, "entries": entries,
            "planner": meta.planner_data, "version": getattr(meta, "version", None)}


def _column_values(cols: Any) -> dict[str, Any]:
    tensors = {fqn: (dtype, grad, shape, [cols.chunk(r) for r in range(first, first + n)])
               for fqn, (dtype, grad, shape, first, n) in cols.tensors.items()}
    entries = [(cols.fqns[cols.entry_fqn[e]], cols.entry_index[e], cols.entry_chunk_offsets(e),
                cols.files[cols.entry_file[e]], cols.entry_offset[e], cols.entry_length[e])
               for e in range(cols.entries)]
    return {"tensors": tensors, "objects": list(cols.objects), "entries": entries,
            "planner": cols.planner_data, "version": cols.version}


@pytest.mark.parametrize("which", ["one_process", "ranks"])
def test_columns_equal_the_converted_metadata(request: pytest.FixtureRequest,
                                              which: str) -> None:
    data = (request.getfixturevalue(which) / ".metadata").read_bytes()
    cols = decode_columns(data)
    assert cols is not None
    assert _column_values(cols) == _metadata_values(decode_metadata(data))


def _agree(data: bytes) -> None:
    """The columnar decoder never raises; when it accepts bytes, the interpreter does too and
    decodes the same values."""
    cols = decode_columns(data)
    if cols is None:
        return
    assert _column_values(cols) == _metadata_values(decode_metadata(data))


def _write(root: Path, tmp_path: Path, data: bytes) -> Path:
    target = tmp_path / "ck"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root, target)
    (target / ".metadata").write_bytes(data)
    return target


def _open_all(path: Path) -> None:
    ck = cl.open(path)
    for name in ck.tensors:
        ck.read(name)
    ck.to_dict()


def test_mutated_metadata_gives_ckptlab_errors(ranks: Path, tmp_path: Path) -> None:
    """Opcode and argument mutations of a real multi-rank .metadata: through cl.open (fast
    path first) only CkptlabError, and the two decoders agree whenever the fast one
    accepts."""
    raw = (ranks / ".metadata").read_bytes()

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(pickle_mutations(raw))
    def check(data: bytes) -> None:
        _agree(data)
        target = _write(ranks, tmp_path, data)
        try:
            _open_all(target)
        except CkptlabError as exc:
            assert "Traceback" not in str(exc)

    check()


@pytest.mark.parametrize("cut", [1, 2, 3, 11, 100, 1000, 5000, -200, -9, -1])
def test_truncated_metadata_is_a_clean_error(ranks: Path, tmp_path: Path, cut: int) -> None:
    raw = (ranks / ".metadata").read_bytes()
    data = raw[:cut] if cut > 0 else raw[:len(raw) + cut]
    assert decode_columns(data) is None
    with pytest.raises(CkptlabError):
        cl.open(_write(ranks, tmp_path, data))


def _frames(raw: bytes) -> list[tuple[int, int]]:
    """(start, length) of each FRAME's payload."""
    out, p = [], 2
    while p < len(raw) and raw[p] == 0x95:
        (n,) = struct.unpack_from("<Q", raw, p + 1)
        out.append((p + 9, n))
        p += 9 + n
    return out


def test_frames_are_read_as_the_interpreter_reads_them(ranks: Path) -> None:
    raw = (ranks / ".metadata").read_bytes()
    frames = _frames(raw)
    assert len(frames) == 1  # one frame for a small file; split it in two by hand
    start, n = frames[0]
    body = raw[start:start + n]
    cut = body.index(b"\x8c", n // 2)  # a SHORT_BINUNICODE: an opcode boundary
    split = raw[:2] + b"\x95" + struct.pack("<Q", cut) + body[:cut] + b"\x95" + struct.pack(
        "<Q", n - cut) + body[cut:]
    assert decode_columns(split) is not None
    _agree(split)
    # a frame boundary inside an opcode's argument: the interpreter would read the next FRAME
    # header as the argument, so the fast path must not join the pieces
    inside = cut + 3
    bad = raw[:2] + b"\x95" + struct.pack("<Q", inside) + body[:inside] + b"\x95" + \
        struct.pack("<Q", n - inside) + body[inside:]
    assert decode_columns(bad) is None
    # a frame that claims more bytes than there are
    assert decode_columns(raw[:3] + struct.pack("<Q", n + 1) + raw[11:]) is None


def test_hostile_shapes_leave_the_fast_path(ranks: Path, tmp_path: Path) -> None:
    """What a hostile writer can put in .metadata that DCP never writes: the fast path gives
    up (None) and the general path says what is wrong."""
    meta = pickle.loads((ranks / ".metadata").read_bytes())  # the test's own file
    key = next(iter(meta.storage_data))
    cases = {
        "negative offset": lambda m: setattr(m.storage_data[key], "offset", -1),
        "text length": lambda m: setattr(m.storage_data[key], "length", "12"),
        "os.system": lambda m: setattr(m, "planner_data", {"x": __import__("os").system}),
    }
    for name, mutate in cases.items():
        bad = pickle.loads(pickle.dumps(meta))
        mutate(bad)
        data = pickle.dumps(bad)
        assert decode_columns(data) is None, name
        with pytest.raises(CkptlabError):
            cl.open(_write(ranks, tmp_path, data))
    # protocol 2 (BINPUT memo opcodes, copyreg-free NEWOBJ): the same interpreter reads it
    # into the same columns as protocol 4, so the fast path opens it
    data = pickle.dumps(meta, protocol=2)
    assert decode_columns(data) == decode_columns((ranks / ".metadata").read_bytes())
    ck = cl.open(_write(ranks, tmp_path, data))
    assert isinstance(ck, DcpCheckpoint) and len(ck.tensors) == 23


def test_damaged_items_are_clean_errors(ranks: Path, tmp_path: Path) -> None:
    """Item bytes are read on access: a damaged item raises there, a short file at open."""
    target = _write(ranks, tmp_path, (ranks / ".metadata").read_bytes())
    data = target / "__1_0.distcp"
    raw = data.read_bytes()
    data.write_bytes(raw[:10] + b"\xff" * 40 + raw[50:])  # the first item's zip header
    ck = cl.open(target)
    with pytest.raises(CorruptArchiveError, match=r"not a torch\.save archive"):
        _open_all(target)
    assert isinstance(ck, DcpCheckpoint)
    data.write_bytes(raw[:-5])
    with pytest.raises(CorruptArchiveError, match="past the end"):
        cl.open(target)


def test_chunks_that_do_not_tile_are_refused(ranks: Path, tmp_path: Path) -> None:
    meta = pickle.loads((ranks / ".metadata").read_bytes())
    fqn = next(iter(meta.state_dict_metadata))
    if not hasattr(meta.state_dict_metadata[fqn], "chunks"):
        fqn = list(meta.state_dict_metadata)[1]
    # the tensor claims one more row than its chunks hold
    md = meta.state_dict_metadata[fqn]
    md.size = torch.Size((md.size[0] + 1, *md.size[1:]))
    target = _write(ranks, tmp_path, pickle.dumps(meta))
    with pytest.raises(CorruptArchiveError, match="do not tile"):
        cl.open(target)
    # a chunk listed in .metadata but stored nowhere
    meta = pickle.loads((ranks / ".metadata").read_bytes())
    del meta.storage_data[next(k for k in meta.storage_data if k.fqn == fqn and k.offset[0])]
    with pytest.raises(CorruptArchiveError, match="do not tile"):
        cl.open(_write(ranks, tmp_path, pickle.dumps(meta)))


def test_duplicate_storage_keys_take_the_general_path(ranks: Path, tmp_path: Path) -> None:
    """Two storage_data keys that compare equal (a dict keeps one): the columns would keep
    both, so the fast path hands the file to the general path, which reads it as Python
    does."""
    meta = pickle.loads((ranks / ".metadata").read_bytes())  # the test's own file
    keys = [k for k in meta.storage_data if k.offset is not None]
    a, b = keys[0], keys[1]
    object.__setattr__(b, "fqn", a.fqn)  # equal to a now; the dict still holds both
    object.__setattr__(b, "offset", torch.Size(tuple(a.offset)))  # a new object
    data = pickle.dumps(meta)
    assert decode_columns(data) is not None  # the columns themselves keep both entries
    try:
        ck = cl.open(_write(ranks, tmp_path, data))
    except CkptlabError:
        return  # the general path refuses it: fine, never the fast path's view of it
    assert not isinstance(ck, DcpCheckpoint)


def test_sparse_synthetic_directory_takes_the_fast_open(tmp_path: Path) -> None:
    """The benchmark's sparse directories (holes for the chunk bytes) open from .metadata
    alone: each data file's first tensor item is real, which the open's one read checks."""
    root = tmp_path / "sparse"
    write_synthetic_dcp(root, tensors=5, ranks=20, data="sparse")
    ck = cl.open(root)
    assert isinstance(ck, DcpCheckpoint)
    assert len(ck.tensors) == 5
    assert ck.tensors["model.layers.0.w0"].shape == (20,)


def test_a_fast_open_that_hands_over_or_fails_closes_its_files(ranks: Path,
                                                               tmp_path: Path) -> None:
    """The data files the fast open opens are closed when it hands the directory to the
    general path (a single-tensor blob that is no zip) or raises (chunks that do not tile)."""
    import gc

    from ckptlab.checkpoint._dcp_fast import open_dcp_fast

    meta = pickle.loads((ranks / ".metadata").read_bytes())
    fqn = next(f for f, md in meta.state_dict_metadata.items() if hasattr(md, "chunks"))
    md = meta.state_dict_metadata[fqn]
    md.size = torch.Size((md.size[0] + 1, *md.size[1:]))
    bad = _write(ranks, tmp_path / "tile", pickle.dumps(meta))
    blob = tmp_path / "blob"
    blob.mkdir()
    import torch.distributed.checkpoint.filesystem as fs

    if hasattr(fs, "SerializationFormat"):  # torch >= 2.8
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(12.0)}, no_dist=True, storage_writer=(
                fs.FileSystemWriter(str(blob),
                                    serialization_format=fs.SerializationFormat.SAFETENSORS)))
    gc.collect()  # what earlier tests left unclosed is not this test's
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(CorruptArchiveError, match="do not tile"):
            open_dcp_fast(str(bad))
        if (blob / ".metadata").exists():
            assert open_dcp_fast(str(blob)) is None
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], \
        [str(w.message) for w in seen]
