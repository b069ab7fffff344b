"""The DCP inspector on real checkpoints: 2 gloo ranks, DTensor shards, bytes items; and a
malicious .metadata that must never run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.dcp import inspect_dcp, load_metadata
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.plan import RankError, run_ranks
from ckptlab.testing import dcp_workers


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    shapes = run_ranks(dcp_workers.save_sharded, 2, str(path), timeout=180)
    assert shapes[0] == [("w", [4, 5]), ("b", [5]), ("replicated", [6])]
    assert shapes[1] == [("w", [3, 5]), ("b", [4]), ("replicated", [6])]
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("dcp1") / "ckpt"
    state = {"model": cl.samples.tiny_gpt(n_layer=1), "step": 3, "note": "x"}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, state


def _chunk(full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def test_sharded_items_match_the_saved_bytes(sharded: Path) -> None:
    layout = cl.inspect(sharded)
    assert layout.format == "dcp"
    full = dcp_workers.full_state()
    tensor_items = [i for i in layout.items if i.kind == "tensor"]
    by_fqn: dict[str, list] = {}
    for item in tensor_items:
        by_fqn.setdefault(item.fqn, []).append(item)
    # uneven shards: 4 + 3 rows, 5 + 4 elements; the replicated tensor is stored once
    assert sorted((i.chunk_offsets, i.chunk_sizes) for i in by_fqn["w"]) == [
        ((0, 0), (4, 5)), ((4, 0), (3, 5))]
    assert sorted((i.chunk_offsets, i.chunk_sizes) for i in by_fqn["b"]) == [
        ((0,), (5,)), ((5,), (4,))]
    assert [(i.chunk_offsets, i.chunk_sizes) for i in by_fqn["replicated"]] == [((0,), (6,))]
    for item in tensor_items:
        want = _chunk(full[item.fqn], item.chunk_offsets, item.chunk_sizes).contiguous()
        raw = (sharded / item.file).read_bytes()[item.data_offset:item.data_offset + want.nbytes]
        assert raw == want.view(torch.uint8).numpy().tobytes() if want.dtype == torch.bfloat16 \
            else raw == want.numpy().tobytes(), item.fqn
        assert item.dtype == str(want.dtype).removeprefix("torch.")
        assert item.layout is not None and item.layout.storages[0].nbytes == want.nbytes
    assert {i.fqn for i in layout.items if i.kind == "bytes"} == {"step", "config.lr",
                                                                    "config.name"}
    assert set(layout.tensors) == {"w", "b", "replicated"}
    assert layout.tensors["w"] == ("float32", (7, 5), 2)


def test_items_tile_the_data_files(sharded: Path) -> None:
    layout = inspect_dcp(sharded)
    assert len(layout.files) == 2  # one data file per rank
    for name, nbytes in layout.files:
        items = [i for i in layout.items if i.file == name]
        cursor = 0
        for item in items:  # back to back, each an independent torch.save zip
            assert item.offset == cursor
            cursor += item.nbytes
        assert cursor == nbytes
    assert layout.file_nbytes == sum(n for _, n in layout.files) + layout.metadata_nbytes


def test_resharded_load_on_one_process_is_bit_exact(sharded: Path) -> None:
    full = dcp_workers.full_state()
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    target.update(step=0, config={"lr": 0.0, "name": ""})
    dcp.load(target, checkpoint_id=str(sharded), no_dist=True)
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert target["step"] == 11 and target["config"] == {"lr": 0.5, "name": "tiny"}


def test_single_process_checkpoint_and_cli_json(single, capsys) -> None:
    path, state = single
    assert main(["inspect", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "dcp" and d["path"] == str(path)
    for key in ("file_nbytes", "archive_name", "alignment", "zip64", "records", "storages",
                "tensors", "items"):
        assert key in d
    for item in d["items"]:
        assert {"fqn", "chunk_offsets", "chunk_sizes", "file", "offset", "nbytes"} <= set(item)
    fqns = {i["fqn"] for i in d["items"]}
    assert {f"model.{k}" for k in state["model"]} <= fqns and {"step", "note"} <= fqns
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "dcp checkpoint" in text and "model.transformer.wte.weight" in text
    assert main(["inspect", "--records", str(path)]) == 0
    assert "DCP checkpoint" in capsys.readouterr().out


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED_BY_METADATA",))


def test_malicious_metadata_is_refused_and_never_runs(single, tmp_path, monkeypatch) -> None:
    path, _ = single
    evil = tmp_path / "evil"
    shutil.copytree(path, evil)
    (evil / ".metadata").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="not a DCP metadata class") as info:
        cl.inspect(evil)
    assert "system" in str(info.value)
    assert not (tmp_path / "PWNED_BY_METADATA").exists()
    # a DCP class wrapped around a forbidden global is refused as well
    meta = load_metadata(path)
    meta.planner_data = _Boom()
    (evil / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsupportedFormatError):
        load_metadata(evil)
    assert not (tmp_path / "PWNED_BY_METADATA").exists()


def test_damaged_metadata_and_data_files(single, tmp_path) -> None:
    path, _ = single
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = (path / ".metadata").read_bytes()
    (bad / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptArchiveError, match="not a readable pickle"):
        cl.inspect(bad)
    (bad / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CorruptArchiveError, match="not DCP Metadata"):
        cl.inspect(bad)
    (bad / ".metadata").write_bytes(data)
    distcp = next(bad.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:-100])
    with pytest.raises(CorruptArchiveError, match="past the end of its data file"):
        cl.inspect(bad)
    distcp.unlink()
    with pytest.raises(CorruptArchiveError, match="data file is missing"):
        cl.inspect(bad)
    assert main(["inspect", str(bad)]) == 2
    with pytest.raises(ArchiveError):
        cl.inspect(tmp_path / "nope")


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    import torch.distributed as dist

    dist.barrier()


def test_a_failing_rank_surfaces_with_its_error() -> None:
    with pytest.raises(RankError, match="rank one is unhappy") as info:
        run_ranks(_fails, 2, timeout=60)
    assert 1 in info.value.failures and "ValueError" in info.value.failures[1]


def _saved_as_on_python_313(path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A DCP save whose ``.metadata`` names its path class as CPython 3.13 does
    (``pathlib._local.PosixPath``; 3.11, 3.12 and 3.14 write ``pathlib.PosixPath``)."""
    import pathlib
    import sys
    import types

    moved = types.ModuleType("pathlib._local")
    moved.PosixPath = pathlib.PosixPath  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pathlib._local", moved)
    with monkeypatch.context() as m:
        m.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, checkpoint_id=path,
                 no_dist=True)
    return (path / ".metadata").read_bytes()


@pytest.mark.parametrize("python_313", [False, True])
def test_checkpoint_id_is_the_path_torch_saved(tmp_path, monkeypatch, python_313) -> None:
    """``StorageMeta.checkpoint_id`` (a ``PosixPath`` torch pickles as its class and parts)
    decodes to ``str()`` of the path torch itself loads back, whichever CPython wrote it: a
    DCP directory saved on 3.13 was refused on every Python ("checkpoint_id must be a str,
    got pathlib._local.PosixPath"), and the parts were joined as ``//tmp/...``."""
    path = tmp_path / "ckpt"
    if python_313:
        raw = _saved_as_on_python_313(path, monkeypatch)
        assert b"pathlib._local" in raw and b"\x8c\x07pathlib\x94" not in raw
    else:
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, checkpoint_id=path,
                 no_dist=True)
    theirs = dcp.FileSystemReader(str(path)).read_metadata()  # (the fake module still there)
    ours = load_metadata(path)
    assert isinstance(theirs.storage_meta.checkpoint_id, os.PathLike)
    assert ours.storage_meta.checkpoint_id == str(theirs.storage_meta.checkpoint_id) \
        == str(path)
    ck = cl.open(path)
    assert ck.format == "dcp"
    torch.testing.assert_close(ck.read("w"), torch.arange(6.0).reshape(2, 3))
