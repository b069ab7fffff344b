"""The columnar ``.metadata`` decoder (:func:`ckptlab.dcp.columns.decode_columns`, a consumer
of the pickle interpreter) against the truth: DCP's own ``Metadata`` the bytes were pickled
from, and, on mutated bytes, the converter (:func:`~ckptlab.dcp._decode.decode_metadata`):
whatever the columns accept, the converter accepts with the same values. Generated DCP
metadata of varied shapes, ranks, dtypes, keys, ints of every pickle width and frame layouts;
nothing is ever unpickled.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.dcp._decode import decode_metadata
from ckptlab.dcp.columns import decode_columns, duplicate_keys
from ckptlab.testing.pickles import pickle_mutations

md = pytest.importorskip("torch.distributed.checkpoint.metadata")


pytestmark = pytest.mark.usefixtures("impl")  # (tests/dcp/conftest.py)
torch = pytest.importorskip("torch")

_DTYPES = ("float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64", "int8")
_FQN = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10)
# every width pickle writes an int in: BININT1, BININT2, BININT, LONG1 (5 and 8 bytes)
_INT = st.one_of(st.integers(0, 255), st.integers(256, 65535), st.integers(65536, 2**31 - 1),
                 st.integers(2**31, 2**40), st.integers(2**40, 2**50))


def _metadata(tensors: list[tuple[str, str, tuple[int, ...], int]], objects: list[str],
              lengths: list[int], rank_major: bool, protocol: int = 4) -> tuple[bytes, Any]:
    """``.metadata`` bytes (and the Metadata) for tensors (fqn, dtype, per-rank chunk shape,
    ranks) sharded row-wise, each rank's items back to back in ``__{rank}_0.distcp``."""
    from ckptlab._torch_compat import storage_info_class

    info = storage_info_class()
    state: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    items: list[tuple[int, Any]] = []
    n = 0
    for fqn, dtype, shape, ranks in tensors:
        chunks = []
        for r in range(ranks):
            offsets = torch.Size((r * shape[0], *(0,) * (len(shape) - 1))) if shape else \
                torch.Size(())
            chunks.append(md.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(shape)))
            items.append((r, md.MetadataIndex(fqn, offsets, r)))
        size = (shape[0] * ranks, *shape[1:]) if shape else ()
        state[fqn] = md.TensorStorageMetadata(
            properties=md.TensorProperties(dtype=getattr(torch, dtype)),
            size=torch.Size(size), chunks=chunks)
        planner[fqn] = ("model", fqn)
    for fqn in objects:
        state[fqn] = md.BytesStorageMetadata()
        items.append((0, md.MetadataIndex(fqn)))
    if rank_major:
        items.sort(key=lambda x: x[0])
    storage: dict[Any, Any] = {}
    cursor: dict[int, int] = {}
    files: dict[int, str] = {}  # one str per file, as each rank's writer names its file
    for r, index in items:
        length = lengths[n % len(lengths)]
        n += 1
        at = cursor.get(r, 0)
        storage[index] = info(files.setdefault(r, f"__{r}_0.distcp"), at, length)
        cursor[r] = at + length
    meta = md.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)
    return pickle.dumps(meta, protocol=protocol), meta


def _values(meta: Any) -> dict[str, Any]:
    tensors = {fqn: (str(m.properties.dtype).removeprefix("torch."), tuple(m.size),
                     [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks])
               for fqn, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    entries = [(k.fqn, -1 if k.index is None else k.index,
                None if k.offset is None else tuple(k.offset), v.relative_path, v.offset,
                v.length) for k, v in meta.storage_data.items()]
    return {"tensors": tensors, "entries": entries}


def _columns(cols: Any) -> dict[str, Any]:
    tensors = {fqn: (dtype, shape, [cols.chunk(r) for r in range(first, first + n)])
               for fqn, (dtype, _, shape, first, n) in cols.tensors.items()}
    entries = [(cols.fqns[cols.entry_fqn[e]], cols.entry_index[e], cols.entry_chunk_offsets(e),
                cols.files[cols.entry_file[e]], cols.entry_offset[e], cols.entry_length[e])
               for e in range(cols.entries)]
    return {"tensors": tensors, "entries": entries}


def _same(data: bytes) -> Any:
    """The columns of ``data``; where they accept it, the converter accepts it with the same
    values (two equal ``MetadataIndex`` keys aside: the dict torch builds keeps one of them,
    and ``EntryColumns.order`` sends such a file to the converter)."""
    cols = decode_columns(data)
    if cols is not None:
        try:
            meta = decode_metadata(data)
        except Exception:  # what the converter refuses the columns must refuse too
            pytest.fail("the columns accepted what the converter refuses")
        if duplicate_keys(cols, cols.entries):
            assert len(meta.storage_data) < cols.entries
        else:
            assert _columns(cols) == _values(meta)
    return cols


_TENSOR = st.tuples(_FQN, st.sampled_from(_DTYPES),
                    st.lists(st.one_of(st.integers(1, 300), _INT), min_size=0, max_size=6),
                    st.integers(1, 70))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TENSOR, min_size=1, max_size=5, unique_by=lambda t: t[0]),
       st.lists(_FQN, max_size=2), st.lists(_INT, min_size=1, max_size=7), st.booleans(),
       st.sampled_from([4, 5]))
def test_generated_metadata_decodes_exactly(
        tensors: list[Any], objects: list[str], lengths: list[int], rank_major: bool,
        protocol: int) -> None:
    names = {t[0] for t in tensors}
    objects = [o for o in dict.fromkeys(objects) if o not in names]
    tensors = [(f, d, tuple(s), r if s else 1) for f, d, s, r in tensors]
    data, meta = _metadata(tensors, objects, lengths, rank_major, protocol)
    cols = _same(data)
    assert cols is not None
    assert _columns(cols) == _values(meta)


def test_long_runs_across_frames_and_batches() -> None:
    """Chunk lists and a storage_data dict longer than pickle's 1,000-item batches, over
    many 64 KB frames."""
    shapes = ((1, 3), (2,), (300, 70000, 2), (1, 2, 3, 4, 5), ())
    tensors = [(f"layers.{i}.w", _DTYPES[i % 4], shapes[i % 5], 1 if i % 5 == 4 else 1100)
               for i in range(6)]
    data, meta = _metadata(tensors, ["step", "é"], [7, 700, 70000, 2**33], False)
    assert len(_frame_headers(data)) > 10
    cols = _same(data)
    assert cols is not None and _columns(cols) == _values(meta)


def _frame_headers(data: bytes) -> list[int]:
    """Where the FRAME opcodes are."""
    return [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]


def _unframed(data: bytes) -> bytes:
    heads = _frame_headers(data)
    if not heads:
        return data[2:]
    return b"".join(data[h + 9:h + 9 + struct.unpack_from("<Q", data, h + 1)[0]]
                    for h in heads)


def _framed(proto: bytes, body: bytes, cuts: list[int]) -> bytes:
    out = [proto]
    last = 0
    for c in [*sorted(set(cuts)), len(body)]:
        if c > last:
            out.append(b"\x95" + struct.pack("<Q", c - last) + body[last:c])
            last = c
    return b"".join(out)


@pytest.fixture(scope="module")
def medium() -> bytes:
    tensors = [(f"t{i}", _DTYPES[i % 8], ((3, 2), (1,), (2, 2, 2, 2), (40000,))[i % 4], 40)
               for i in range(5)]
    return _metadata(tensors, ["step"], [3, 300, 2**20, 2**35], False)[0]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 10**9), max_size=40), st.booleans())
def test_frame_headers_anywhere(medium: bytes, picks: list[int], at_opcodes: bool) -> None:
    """FRAME headers between any two opcodes (inside records too), or inside an opcode."""
    body = _unframed(medium)
    if at_opcodes:
        starts = [pos - 2 for _, _, pos in pickletools.genops(medium[:2] + body)][1:]
        cuts = [starts[p % len(starts)] for p in picks]
    else:
        cuts = [p % len(body) for p in picks]
    data = _framed(medium[:2], body, cuts)
    cols = _same(data)
    if at_opcodes:
        assert cols is not None


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1,
                max_size=3), st.booleans())
def test_mutated_bytes_decode_as_the_converter_does(medium: bytes, changes: list[Any],
                                                   records_only: bool) -> None:
    """A few bytes changed (mostly inside the per-item records): None, or the values the
    converter gives."""
    out = bytearray(medium)
    lo = medium.find(b"ChunkStorageMetadata") if records_only else 0
    for pos, value in changes:
        out[lo + pos % (len(out) - lo)] = value
    _same(bytes(out))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_opcode_mutations_decode_as_the_converter_does(medium: bytes, data: Any) -> None:
    _same(data.draw(pickle_mutations(medium)))


def test_negative_ints_leave_the_fast_path() -> None:
    """A LONG1 offset that is negative is refused (the converter then decides), not
    stored."""
    tensors = [("w", "float32", (2,), 40)]
    data, _ = _metadata(tensors, [], [2**40], False)
    assert _same(data) is not None
    bad = data.replace(b"\x8a\x06\x00\x00\x00\x00\x00\x01", b"\x8a\x06\x00\x00\x00\x00\x00\xff")
    assert bad != data
    assert _same(bad) is None


def _records_moved(meta: Any, move: Any) -> bytes:
    """``meta`` pickled after ``move(meta)`` put one of its records somewhere DCP never does
    (the test's own objects)."""
    copy = pickle.loads(pickle.dumps(meta))
    move(copy)
    return pickle.dumps(copy, protocol=4)


def test_records_out_of_place_go_to_the_converter() -> None:
    """A per-item record where another value belongs: the columns hand the file to the
    converter (None), which refuses it; never a row number read as a value."""
    tensors = [("w", "float32", (2, 3), 3), ("b", "int64", (4,), 2)]
    data, meta = _metadata(tensors, ["step"], [100, 2**20], False)
    assert _same(data) is not None
    key, info = next(iter(meta.storage_data.items()))
    chunk = meta.state_dict_metadata["w"].chunks[0]
    moves = {
        "a chunk in planner_data": lambda m: m.planner_data.update(x=m.state_dict_metadata[
            "w"].chunks[0]),
        "a key as a dict key of planner_data": lambda m: m.planner_data.update(
            {next(iter(m.storage_data)): 1}),
        "an info as a chunk": lambda m: m.state_dict_metadata["w"].chunks.append(
            next(iter(m.storage_data.values()))),
        "a chunk twice": lambda m: m.state_dict_metadata["w"].chunks.append(
            m.state_dict_metadata["w"].chunks[0]),
        "a chunk in another tensor": lambda m: m.state_dict_metadata["b"].chunks.append(
            m.state_dict_metadata["w"].chunks[0]),
        "an info under two keys": lambda m: m.storage_data.__setitem__(
            md.MetadataIndex("step2"), next(iter(m.storage_data.values()))),
        "an info as a length": lambda m: setattr(next(iter(m.storage_data.values())), "length",
                                                 chunk),
        "a key in a size": lambda m: setattr(m.state_dict_metadata["w"], "size",
                                             torch.Size([1])) or m.planner_data.update(k=key),
        "storage_meta as a chunk": lambda m: setattr(m, "storage_meta", info),
    }
    for name, move in moves.items():
        moved = _records_moved(meta, move)
        assert decode_columns(moved) is None, name
        _same(moved)


@pytest.mark.parametrize("protocol", [2, 3, 5])
def test_every_protocol_torch_writes_with(protocol: int) -> None:
    """Any protocol pickle writes a Metadata in (memo by BINPUT, NEWOBJ, FRAMEs or not)."""
    tensors = [("w", "float32", (2, 3), 3), ("z", "bool", (), 1)]
    data, meta = _metadata(tensors, ["step"], [100, 7], True, protocol)
    cols = _same(data)
    assert cols is not None and _columns(cols) == _values(meta)
