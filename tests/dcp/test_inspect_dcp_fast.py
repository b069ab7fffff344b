"""``inspect_dcp`` through ``.metadata``'s columns (issue 13, target 3): ``cl.inspect(DIR)``,
``ckptlab inspect DIR --records`` and ``ckptlab inspect DIR --json`` on a DCP directory.

The fast path (``inspect_dcp(root)``) must give what the general path
(``inspect_dcp(root, fast=False)``: the bounded interpreter, every item's zip scanned) gives:
equal ``to_dict()`` (byte for byte as JSON), equal items, ``alignment`` and ``zip64``, each
item's layout equal to its own full scan but for ``path`` and CRC-32 fields (shared from a
template item), the same ``Metadata`` when asked for; and for every directory it does not read
(SAFETENSORS, zstd, mutated or damaged files) the general path's result or error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ckptlab as cl
from ckptlab.checkpoint._dcp_fast import DcpCheckpoint
from ckptlab.cli import main
from ckptlab.dcp import DcpLayout, inspect_dcp, load_metadata
from ckptlab.errors import CkptlabError, CorruptArchiveError
from ckptlab.format.archive import scan_torch_zip
from ckptlab.plan._synthetic_dcp import write_synthetic_dcp
from ckptlab.source._bytes import ByteSource
from ckptlab.source._window import FileWindow
from ckptlab.testing.pickles import pickle_mutations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"w": torch.randn(7, 5, generator=g),
                  "w2": torch.randn(7, 5, generator=g),  # same shape: a template hit
                  "b": torch.randn(9, generator=g).to(torch.bfloat16),
                  "t": torch.randn(4, 6, generator=g).t(),  # non-contiguous item
                  "s": torch.tensor(2.5),  # 0-d
                  "e": torch.empty(0, 3),  # no elements
                  "i": torch.arange(6, dtype=torch.int64) * (2**40 + 3)},
        "step": 11, "cfg": {"lr": 0.5, "name": "tiny"},
    }


def _save(root: Path, **writer: Any) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = _state()
    if writer:
        state["model"].pop("t")  # safetensors refuses non-contiguous tensors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(root), **writer), no_dist=True)
    return root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("insp") / "real")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("insp") / "ranks"
    write_synthetic_dcp(root, tensors=23, ranks=6)
    return root


def _without_crc(layout: Any) -> dict[str, Any]:
    doc = layout.to_dict()
    doc.pop("path")
    for record in doc["records"]:
        record.pop("crc32")
    return doc


def _own_scan(root: Path, item: Any) -> Any:
    with open(root / item.file, "rb") as f, ByteSource(
            FileWindow(f, item.offset, item.nbytes, f"{item.file}@{item.offset}")) as src:
        return scan_torch_zip(src)


def _assert_same(fast: DcpLayout, slow: DcpLayout, root: Path) -> None:
    assert type(fast) is not DcpLayout and type(slow) is DcpLayout  # really two paths
    assert json.dumps(fast.to_dict()) == json.dumps(slow.to_dict())
    assert fast.to_dict()["alignment"] == slow.to_dict()["alignment"]
    assert fast.to_dict()["zip64"] == slow.to_dict()["zip64"]
    assert fast.tensors == slow.tensors and fast.files == slow.files
    assert (fast.path, fast.metadata_nbytes, fast.file_nbytes) == (
        slow.path, slow.metadata_nbytes, slow.file_nbytes)
    assert len(fast.items) == len(slow.items)
    for a, b in zip(fast.items, slow.items):
        assert dataclasses.replace(a, layout=None) == dataclasses.replace(b, layout=None)
        assert (a.layout is None) == (b.layout is None)
        if a.layout is not None:
            # shared from a template or scanned: every offset, size, zip64, alignment of its
            # own scan; path and the records' CRC-32 may be the template's
            assert _without_crc(a.layout) == _without_crc(b.layout), (a.fqn, a.offset)
            assert a.layout.zip64 == b.layout.zip64 and a.layout.alignment == b.layout.alignment
            assert _without_crc(a.layout) == _without_crc(_own_scan(root, a))
    # the Metadata object, decoded on first access
    assert fast.metadata == slow.metadata == load_metadata(root)


@pytest.mark.parametrize("which", ["one_process", "ranks"])
def test_fast_inspect_equals_general_inspect(request: pytest.FixtureRequest,
                                              which: str) -> None:
    root = request.getfixturevalue(which)
    fast = inspect_dcp(root)
    _assert_same(fast, inspect_dcp(root, fast=False), root)
    # cl.inspect is that path; item_layouts=False too
    assert cl.inspect(root).to_dict() == fast.to_dict()
    quick = inspect_dcp(root, item_layouts=False)
    assert type(quick) is not DcpLayout
    assert quick.to_dict() == inspect_dcp(root, item_layouts=False, fast=False).to_dict()


def test_items_share_template_layouts(ranks: Path) -> None:
    fast = inspect_dcp(ranks)
    tensor_items = [i for i in fast.items if i.kind == "tensor"]
    shared = {id(i.layout) for i in tensor_items}
    assert len(tensor_items) == 23 * 6 and len(shared) < len(tensor_items) // 2


def test_layout_pickles_and_copies_as_a_plain_dcp_layout(one_process: Path) -> None:
    fast = inspect_dcp(one_process)
    back = pickle.loads(pickle.dumps(fast))
    assert type(back) is DcpLayout and back == fast and fast == back
    assert back.items == fast.items and back.metadata == load_metadata(one_process)
    moved = dataclasses.replace(fast, path="elsewhere")  # what a remote open does
    assert moved.path == "elsewhere" and moved.metadata == fast.metadata
    assert moved.to_dict()["items"] == fast.to_dict()["items"]


def _cli_json(*argv: str) -> Any:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("which", ["one_process", "ranks"])
def test_cli_json_and_records(request: pytest.FixtureRequest, which: str) -> None:
    """``inspect DIR --json`` takes the byte-level keys from the fast open's own layout,
    ``--records`` from inspect_dcp: both equal the general path's."""
    root = request.getfixturevalue(which)
    slow = json.loads(json.dumps(inspect_dcp(root, fast=False).to_dict()))
    assert _cli_json("inspect", str(root), "--records", "--json") == slow
    ck = cl.open(root)
    assert isinstance(ck, DcpCheckpoint)
    assert json.dumps(ck.dcp_layout().to_dict()) == json.dumps(slow)
    doc = _cli_json("inspect", str(root), "--json")
    for key in ("file_nbytes", "archive_name", "alignment", "zip64", "metadata_nbytes",
                "records", "storages", "items"):
        assert doc[key] == slow[key], key
    assert doc["format"] == "dcp" and len(doc["tensors"]) == len(ck.tensors)


def _serialization_format() -> Any:
    """torch's DCP SerializationFormat (torch >= 2.8), or skip."""
    import torch.distributed.checkpoint.filesystem as fs

    if not hasattr(fs, "SerializationFormat"):
        pytest.skip(f"torch {torch.__version__} has no DCP SerializationFormat (2.8 added it)")
    return fs.SerializationFormat


@pytest.mark.parametrize("writer", ["safetensors", "zstd"])
def test_other_serializations_take_the_general_path(tmp_path: Path, writer: str) -> None:
    SerializationFormat = _serialization_format()

    if writer == "zstd":
        pytest.importorskip("zstandard")
        from torch.distributed.checkpoint._extension import ZStandard

        kwargs: dict[str, Any] = {"_extensions": [ZStandard()]}
    else:
        kwargs = {"serialization_format": SerializationFormat.SAFETENSORS}
    root = _save(tmp_path / writer, **kwargs)
    fast = inspect_dcp(root)
    assert type(fast) is DcpLayout  # handed over
    assert fast.to_dict() == inspect_dcp(root, fast=False).to_dict()


def test_one_safetensors_tensor_per_file_is_read_as_before(tmp_path: Path) -> None:
    """Items that do not overlap but are a safetensors blob: the fast path finds no zip,
    hands over, and the general path reads the blob."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    SerializationFormat = _serialization_format()

    root = tmp_path / "one"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, no_dist=True, storage_writer=(
            FileSystemWriter(str(root), serialization_format=SerializationFormat.SAFETENSORS)))
    fast = inspect_dcp(root)
    assert fast.to_dict() == inspect_dcp(root, fast=False).to_dict()
    assert [i.serialization for i in fast.items] == ["safetensors"]
    ck = cl.open(root)  # the fast open hands it over too (one read at the item)
    assert not isinstance(ck, DcpCheckpoint)
    assert torch.equal(ck.read("w"), torch.arange(12.0).reshape(3, 4))
    assert _cli_json("inspect", str(root), "--json")["items"] == fast.to_dict()["items"]


def _copy(root: Path, tmp_path: Path, name: str = "ck") -> Path:
    target = tmp_path / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root, target)
    return target


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", json.dumps(fn().to_dict()))
    except CkptlabError as exc:
        return (type(exc).__name__, str(exc))


def test_mutated_metadata_gives_what_the_general_path_gives(ranks: Path,
                                                            tmp_path: Path) -> None:
    """Opcode and argument mutations of a real multi-rank .metadata: the fast inspect gives
    the general path's layout or its error, never a raw exception."""
    raw = (ranks / ".metadata").read_bytes()
    target = _copy(ranks, tmp_path)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(pickle_mutations(raw))
    def check(data: bytes) -> None:
        (target / ".metadata").write_bytes(data)
        got = _outcome(lambda: inspect_dcp(target))
        want = _outcome(lambda: inspect_dcp(target, fast=False))
        assert got == want

    check()


def test_hostile_shapes_give_the_general_paths_errors(ranks: Path, tmp_path: Path) -> None:
    meta = pickle.loads((ranks / ".metadata").read_bytes())  # the test's own file
    key = next(k for k in meta.storage_data if k.offset is not None)
    cases = {
        "negative offset": lambda m: setattr(m.storage_data[key], "offset", -1),
        "past the end": lambda m: setattr(m.storage_data[key], "length", 1 << 40),
        "missing file": lambda m: setattr(m.storage_data[key], "relative_path", "nope.distcp"),
        "escaping file": lambda m: setattr(m.storage_data[key], "relative_path", "../x"),
        "os.system": lambda m: setattr(m, "planner_data", {"x": os.system}),
        "chunk index out of range": lambda m: setattr(key, "index", 99),
    }
    target = _copy(ranks, tmp_path)
    for name, mutate in cases.items():
        bad = pickle.loads(pickle.dumps(meta))
        if name == "chunk index out of range":
            bad_key = next(k for k in bad.storage_data if k == key)
            object.__setattr__(bad_key, "index", 99)  # found by its offsets instead
        else:
            mutate(bad)
        (target / ".metadata").write_bytes(pickle.dumps(bad))
        want = _outcome(lambda: inspect_dcp(target, fast=False))
        assert _outcome(lambda: inspect_dcp(target)) == want, name
        assert (want[0] == "ok") == (name == "chunk index out of range"), (name, want)


def test_damaged_items_give_the_general_paths_errors(ranks: Path, tmp_path: Path) -> None:
    target = _copy(ranks, tmp_path)
    data = target / "__2_0.distcp"
    raw = data.read_bytes()
    layout = inspect_dcp(ranks)
    mine = [i for i in layout.items if i.file == "__2_0.distcp"]
    second = mine[1]
    # an item's first zip header (sizes, name and extra lengths): no template matches, its
    # full scan fails as the general path's does
    for at in (mine[0].offset + 10, second.offset + 10, second.offset + 1):
        data.write_bytes(raw[:at] + b"\xff" * 40 + raw[at + 40:])
        want = _outcome(lambda: inspect_dcp(target, fast=False))
        assert want[0] == "CorruptArchiveError" and "not a torch.save archive" in want[1]
        assert _outcome(lambda: inspect_dcp(target)) == want
    # bytes inside a later item's pickle: whatever the general path makes of it
    for shift in (80, 120, 200):
        at = second.offset + shift
        data.write_bytes(raw[:at] + bytes(b ^ 0x5A for b in raw[at:at + 3]) + raw[at + 3:])
        assert _outcome(lambda: inspect_dcp(target)) == _outcome(
            lambda: inspect_dcp(target, fast=False)), shift
    data.write_bytes(raw[:-5])  # a short data file
    with pytest.raises(CorruptArchiveError, match="past the end"):
        inspect_dcp(target)
    data.unlink()
    with pytest.raises(CorruptArchiveError, match="data file is missing"):
        inspect_dcp(target)


def layout_metadata(root: Path) -> Any:
    """DCP's own Metadata of the directory (the test's own file)."""
    return pickle.loads((root / ".metadata").read_bytes())


def test_metadata_changed_after_inspect_is_refused(ranks: Path, tmp_path: Path) -> None:
    target = _copy(ranks, tmp_path)
    layout = inspect_dcp(target)
    meta = target / ".metadata"
    # the same Metadata pickled another way (the test's own file): another size
    meta.write_bytes(pickle.dumps(pickle.loads(meta.read_bytes()), protocol=2))
    with pytest.raises(CorruptArchiveError, match="changed since"):
        layout.metadata  # noqa: B018
    again = inspect_dcp(target)  # inspected again: fine, the same items
    assert again.to_dict()["items"] == layout.to_dict()["items"]
    assert again.metadata == layout_metadata(ranks)
