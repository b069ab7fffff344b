"""Checkpoints behind URLs, counted by a real nginx's access log (issue 13, target 5).

The server is Debian's nginx (``ckptlab.testing.nginx``), started on 127.0.0.1 with a
configuration of its own; every request it answers is one line of its access log, so the
budgets below are what a production server sees: HEAD requests, probes and retries included.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile

import pytest
import torch

import ckptlab as cl
from ckptlab import cli
from ckptlab.checkpoint.open import open_url
from ckptlab.errors import ArchiveError, UnsupportedFormatError
from ckptlab.testing.nginx import NGINX_MISSING, NginxServer, nginx_executable

pytest.importorskip("fsspec", reason="the 'remote' extra (fsspec, aiohttp) is not installed")
pytest.importorskip("aiohttp", reason="the 'remote' extra (fsspec, aiohttp) is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    if nginx_executable() is None:
        if os.environ.get("CI"):
            pytest.fail(NGINX_MISSING)
        pytest.skip(NGINX_MISSING)
    root = tmp_path_factory.mktemp("served")
    with NginxServer(root) as s:
        yield s


def _requests(server: NginxServer) -> list:
    return server.requests()


def _layout_dict(ck) -> dict:
    d = ck.files[0].layout.to_dict()
    d.pop("path")
    return d


# -- torch.save --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def many(server: NginxServer) -> dict[str, torch.Tensor]:
    """10,000 small tensors saved with torch.save under the server's root."""
    sd = {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(10_000)}
    torch.save(sd, os.path.join(server.root, "many.pt"))
    return sd


@pytest.fixture(scope="module")
def many_remote(server, many):
    """The 10,000-tensor file opened from its URL, and the requests that took."""
    server.mark()
    ck = cl.open(server.url("many.pt"))
    return ck, _requests(server)


@pytest.fixture(scope="module")
def mid(server: NginxServer) -> str:
    """A small torch.save file under the server's root (for the CLI)."""
    torch.save({"w": torch.randn(64, 64), "step": 3}, os.path.join(server.root, "mid.pt"))
    return "mid.pt"


def test_torch_save_10k_tensors_opens_in_at_most_3_requests(server, many_remote):
    ck, seen = many_remote
    assert 1 <= len(seen) <= 3, seen
    assert all(r.method == "GET" and r.range and r.status == 206 for r in seen), seen
    assert seen[0].range.startswith("bytes=-")  # size and tail in one suffix request
    assert len(ck.tensors) == 10_000
    local = cl.open(os.path.join(server.root, "many.pt"))
    assert _layout_dict(ck) == _layout_dict(local)  # byte for byte the local layout
    assert ck.files[0].layout.segments == local.files[0].layout.segments


def test_read_is_one_request_per_part_and_equals_torch(server, many, many_remote):
    ck, _ = many_remote
    loaded = many  # the tensors torch.save wrote (a 10,000-tensor torch.load is slow here)
    for name in ("layers.0.w", "layers.4321.w", "layers.9999.w"):
        server.mark()
        t = ck.read(name)
        seen = _requests(server)
        assert len(seen) == len(ck.tensors[name].parts) == 1, seen
        part = ck.tensors[name].parts[0]
        assert seen[0].range == f"bytes={part.offset}-{part.offset + part.nbytes - 1}"
        assert torch.equal(t, loaded[name]) and t.dtype == loaded[name].dtype


def test_large_storages_are_not_moved(server):
    """Opening moves the directory and the pickle, never the tensor bytes."""
    sd = {"w": torch.randn(512, 1024), "views": torch.arange(100.0)[::7], "b": torch.ones(3),
          "h": torch.randn(64).to(torch.bfloat16), "step": 12, "nested": {"q": torch.zeros(2, 2)}}
    path = os.path.join(server.root, "large.pt")
    torch.save(sd, path)
    server.mark()
    ck = cl.open(server.url("large.pt"))
    seen = _requests(server)
    assert len(seen) <= 3
    assert sum(r.body_nbytes for r in seen) < os.path.getsize(path) // 2
    assert ck.objects == cl.open(path).objects
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(ck.read("views"), loaded["views"])
    assert ck.read("views").stride() == loaded["views"].stride()
    assert torch.equal(ck.read("h"), loaded["h"])
    assert torch.equal(ck.read("nested.q"), loaded["nested"]["q"])


def test_a_small_file_arrives_in_one_request(server):
    torch.save({"a": torch.arange(5)}, os.path.join(server.root, "tiny.pt"))
    server.mark()
    ck = cl.open(server.url("tiny.pt"))
    assert len(_requests(server)) == 1
    assert torch.equal(ck.read("a"), torch.arange(5))


def test_a_zip_not_placed_as_torch_places_it_is_read_record_by_record(server, tmp_path):
    """Re-zipped with Python's zipfile (no padding, no descriptors): the arithmetic does not
    fit, the local headers are read, and the layout is still the local one."""
    src = tmp_path / "src.pt"
    # larger than the first request's 1 MiB: the storage headers are not all moved by it
    torch.save({"a": torch.arange(400_000.0), "b": torch.ones(4, dtype=torch.int64)}, src)
    target = os.path.join(server.root, "rezipped.pt")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    ck = cl.open(server.url("rezipped.pt"))
    local = cl.open(target)
    assert _layout_dict(ck) == _layout_dict(local)
    assert any("not placed as torch.save places them" in n for n in ck.notes)
    assert torch.equal(ck.read("a"), torch.arange(400_000.0))


def test_a_storage_record_moved_in_the_directory_is_not_trusted(server, tmp_path):
    """A central directory whose storage header offset is off by 64 does not match torch's
    placement: the local headers are read, which say what is wrong."""
    path = tmp_path / "x.pt"
    torch.save({"a": torch.arange(64.0), "b": torch.arange(64.0)}, path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/1"))
    at = raw.find(b"PK\x01\x02")
    while at >= 0:  # the central directory entry of data/1
        name_n = int.from_bytes(raw[at + 28:at + 30], "little")
        if raw[at + 46:at + 46 + name_n].decode().endswith("data/1"):
            break
        at = raw.find(b"PK\x01\x02", at + 4)
    assert at >= 0
    off = int.from_bytes(raw[at + 42:at + 46], "little")
    assert off == info.header_offset
    raw[at + 42:at + 46] = (off + 64).to_bytes(4, "little")
    with open(os.path.join(server.root, "moved.pt"), "wb") as f:
        f.write(raw)
    with pytest.raises(ArchiveError) as remote:
        cl.open(server.url("moved.pt"))
    with pytest.raises(ArchiveError) as local:
        cl.open(os.path.join(server.root, "moved.pt"))
    assert type(remote.value) is type(local.value)
    assert remote.value.reason == local.value.reason


# -- Hugging Face sharded ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(server: NginxServer) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    root = os.path.join(server.root, "hf")
    os.makedirs(root)
    every: dict[str, torch.Tensor] = {}
    weight_map = {}
    for k in range(4):
        shard = {f"model.layers.{k}.{n}": torch.randn(8, 16) for n in ("q", "k", "v")}
        name = f"model-{k + 1:05d}-of-00004.safetensors"
        save_file(shard, os.path.join(root, name))
        weight_map.update(dict.fromkeys(shard, name))
        every.update(shard)
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 4 * 3 * 8 * 16 * 4}, "weight_map": weight_map}, f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"model_type": "test"}, f)
    return every


@pytest.mark.parametrize("url", ["hf/", "hf/model.safetensors.index.json"])
def test_hf_sharded_dir_opens_in_one_plus_one_per_shard(server, hf_dir, url):
    server.mark()
    ck = cl.open(server.url(url))
    seen = _requests(server)
    assert len(seen) == 1 + 4, seen
    assert seen[0].path.endswith("model.safetensors.index.json") and seen[0].range is None
    assert ck.format == "hf" and set(ck.tensors) == set(hf_dir)
    assert ck.objects["model.safetensors.index.json"]["total_size"] == 6144
    local = cl.open(os.path.join(server.root, "hf"))
    for name in hf_dir:
        assert ck.tensors[name].parts == local.tensors[name].parts
    server.mark()
    t = ck.read("model.layers.2.k")
    assert len(_requests(server)) == 1
    assert torch.equal(t, hf_dir["model.layers.2.k"])


# -- DCP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dcp_dir(server: NginxServer) -> dict[str, object]:
    import warnings

    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(32, 16), "b": torch.arange(9), "step": 7,
          "opt": {"m": torch.randn(5, 3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=os.path.join(server.root, "dcp"), no_dist=True)
    return sd


@pytest.mark.parametrize("url", ["dcp/", "dcp/.metadata"])
def test_dcp_dir_opens_in_at_most_2_plus_one_per_file(server, dcp_dir, url):
    files = [n for n in os.listdir(os.path.join(server.root, "dcp")) if n != ".metadata"]
    server.mark()
    ck = cl.open(server.url(url))
    seen = _requests(server)
    assert len(seen) <= 2 + len(files), seen
    assert ck.format == "dcp"
    assert ck.objects["step"] == 7
    for name, want in (("w", dcp_dir["w"]), ("b", dcp_dir["b"]),
                       ("opt.m", dcp_dir["opt"]["m"])):
        server.mark()
        got = ck.read(name)
        assert len(_requests(server)) == len(ck.tensors[name].parts)
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def dcp_big(server: NginxServer) -> dict[str, object]:
    """A DCP directory in two data files (two writer threads): 12 tensors of 2 MiB (6
    shapes), 200 small ones of distinct shapes, two object items."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    sd: dict[str, object] = {f"big.{i}": torch.randn(128 * (1 + i % 6), 4096 // (1 + i % 6),
                                                     generator=g) for i in range(12)}
    sd.update({f"small.{i}": torch.arange(i + 1, dtype=torch.int32) for i in range(200)})
    sd["step"] = 11
    sd["cfg"] = {"lr": 0.5, "name": "run"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, no_dist=True, storage_writer=FileSystemWriter(
            os.path.join(server.root, "dcpbig"), thread_count=2))
    return sd


def _data_nbytes(server: NginxServer, rel: str) -> tuple[list[str], int]:
    root = os.path.join(server.root, rel)
    files = sorted(n for n in os.listdir(root) if n != ".metadata")
    return files, sum(os.path.getsize(os.path.join(root, n)) for n in files)


def test_dcp_dir_url_moves_item_heads_not_data(server, dcp_big):
    """Open: .metadata, then one head request per data file (size, object items); entries
    read item heads with read-ahead; the data moves only for ``read``."""
    from ckptlab.checkpoint._dcp_fast import DcpCheckpoint

    files, data_nbytes = _data_nbytes(server, "dcpbig")
    assert len(files) == 2
    meta_nbytes = os.path.getsize(os.path.join(server.root, "dcpbig", ".metadata"))
    server.mark()
    ck = cl.open(server.url("dcpbig/"))
    seen = _requests(server)
    assert isinstance(ck, DcpCheckpoint)
    assert len(seen) == 2 + len(files), seen  # index probe (404), .metadata, one per file
    heads = [r for r in seen if r.path.endswith(".distcp")]
    assert sorted(r.path.rsplit("/", 1)[1] for r in heads) == files
    assert all(r.range.startswith("bytes=0-") and r.status == 206 for r in heads), heads
    moved = sum(r.body_nbytes for r in seen if r.status in (200, 206))
    assert moved < meta_nbytes + 64 * 1024, (moved, data_nbytes)
    local = cl.open(os.path.join(server.root, "dcpbig"))
    assert ck.objects == local.objects == {"step": 11, "cfg.lr": 0.5, "cfg.name": "run"}
    assert [f.nbytes for f in ck.files] == [f.nbytes for f in local.files if f.path in
                                             (".metadata", *files)]
    # every entry, equal to the local one: 6 big shapes scanned (head, tail), 6 big items
    # matched on their head, the 200 small ones in a few read-ahead requests
    server.mark()
    for name in local.tensors:
        assert ck.tensors[name] == local.tensors[name], name
    seen = _requests(server)
    assert len(seen) <= 3 * 12 + 2 * len(files), len(seen)
    assert sum(r.body_nbytes for r in seen) < data_nbytes // 4
    server.mark()
    assert [(i.fqn, i.file, i.offset, i.nbytes, i.data_offset) for i in ck.dcp_layout().items] \
        == [(i.fqn, i.file, i.offset, i.nbytes, i.data_offset)
            for i in local.dcp_layout().items]
    assert ck.dcp_layout().metadata == local.dcp_layout().metadata
    assert len(_requests(server)) == 0  # every item layout was read above


def test_dcp_url_read_is_one_request_per_part_built_or_not(server, dcp_big):
    for built in (False, True):
        ck = cl.open(server.url("dcpbig/.metadata"))
        for name in ("big.3", "small.17", "big.10", "small.0"):
            if built:
                ck.tensors[name]
            server.mark()
            got = ck.read(name)
            assert len(ck.tensors[name].parts) == 1
            # a small item whose entry was built may still be kept from its read-ahead
            want = 1 if name.startswith("big") or not built else (0, 1)
            assert len(_requests(server)) in (want if isinstance(want, tuple) else (want,))
            assert torch.equal(got, dcp_big[name])


def _copy_dir(server: NginxServer, src: str, dst: str) -> str:
    import shutil

    target = os.path.join(server.root, dst)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(os.path.join(server.root, src), target)
    return target


def test_dcp_url_with_a_short_or_missing_data_file_says_which(server, dcp_big):
    from ckptlab.errors import CorruptArchiveError

    root = _copy_dir(server, "dcpbig", "dcpcut")
    files, _ = _data_nbytes(server, "dcpcut")
    path = os.path.join(root, files[1])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CorruptArchiveError, match="runs past the end") as exc:
        cl.open(server.url("dcpcut/"))
    assert exc.value.path == server.url(f"dcpcut/{files[1]}")
    os.remove(path)
    with pytest.raises(CorruptArchiveError, match="data file is missing") as exc:
        cl.open(server.url("dcpcut/"))
    assert exc.value.path == server.url(f"dcpcut/{files[1]}")


def test_dcp_url_with_a_damaged_item_fails_on_access_as_on_disk(server, dcp_big):
    """A tensor item whose zip header is overwritten: opening works (no item is read), the
    entry and ``read`` raise the error the local open raises."""
    root = _copy_dir(server, "dcpbig", "dcpbad")
    local = cl.open(root)
    part = local.tensors["big.4"].parts[0]
    with open(os.path.join(root, part.file), "r+b") as f:
        f.seek(part.item_offset)
        f.write(b"JUNK")
    local = cl.open(root)
    with pytest.raises(ArchiveError) as want:
        local.tensors["big.4"]
    for how in ("entry", "read"):
        ck = cl.open(server.url("dcpbad/"))
        with pytest.raises(ArchiveError) as got:
            ck.tensors["big.4"] if how == "entry" else ck.read("big.4")
        assert type(got.value) is type(want.value)
        assert got.value.record == want.value.record and got.value.offset == want.value.offset
        assert torch.equal(ck.read("big.5"), dcp_big["big.5"])


def test_dcp_listing_of_small_items_in_any_order_moves_the_data_about_once(server,
                                                                         monkeypatch):
    """Items under 1 MiB apart are moved through by the read-ahead; a listing that walks the
    files out of order (two writer threads, ``ck.tensors`` order) keeps the items' heads and
    tails, not the data between, so it neither moves the data again and again nor makes a
    request per item."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptlab.dcp import items as dcp_items

    g = torch.Generator().manual_seed(1)
    sd = {f"t.{i}": torch.randn(64 * (1 + i % 4), 128, generator=g) for i in range(160)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, no_dist=True, storage_writer=FileSystemWriter(
            os.path.join(server.root, "dcpsmall"), thread_count=2))
    _, data_nbytes = _data_nbytes(server, "dcpsmall")
    local = cl.open(os.path.join(server.root, "dcpsmall"))
    ck = cl.open(server.url("dcpsmall/"))
    monkeypatch.setattr(dcp_items, "_KEEP", 2 << 20)  # a keep smaller than the data
    server.mark()
    for name in sd:
        assert ck.tensors[name] == local.tensors[name], name
    seen = _requests(server)
    assert len(seen) <= 40, len(seen)
    assert sum(r.body_nbytes for r in seen) <= 1.5 * data_nbytes, (seen, data_nbytes)
    server.mark()
    ck.dcp_layout()
    assert len(_requests(server)) == 0


def test_dcp_url_reads_from_threads(server, dcp_big):
    """``ck.read`` from several threads at once, of built and unbuilt entries: every value
    right (the kept bytes change under a lock)."""
    from concurrent.futures import ThreadPoolExecutor

    names = [n for n in dcp_big if n.startswith(("big", "small"))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a race shows
    try:
        for built in (names, names[::2]):
            ck = cl.open(server.url("dcpbig/"))
            for name in built:
                ck.tensors[name]
            order = names * 4
            random.Random(len(built)).shuffle(order)
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(ck.read, order))
            wrong = [n for t, n in zip(got, order) if not torch.equal(t, dcp_big[n])]
            assert not wrong, wrong
    finally:
        sys.setswitchinterval(interval)


def test_dcp_url_errors_of_the_mirror_name_the_url(server, dcp_dir):
    """A directory the fast open hands to the mirror (an object item claiming the whole
    file: items overlap) fails with the URL in the error, not the temporary directory."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    root = _copy_dir(server, "dcp", "dcpover")
    md = FileSystemReader(root).read_metadata()
    for k, v in md.storage_data.items():
        if k.fqn == "step":
            v.length = 10**12
    with open(os.path.join(root, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ArchiveError) as exc:
        cl.open(server.url("dcpover/"))
    assert exc.value.path.startswith(server.url("dcpover/")), exc.value.path
    assert server.url("dcpover/") in str(exc.value)


@pytest.mark.parametrize("threads", [1, 2])
def test_dcp_url_in_safetensors_format_is_mirrored(server, threads):
    import warnings

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptlab.checkpoint._dcp_fast import DcpCheckpoint

    if not hasattr(fs, "SerializationFormat"):
        pytest.skip(f"torch {torch.__version__} has no DCP SerializationFormat (2.8 added it)")
    sd = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, no_dist=True, storage_writer=FileSystemWriter(
            os.path.join(server.root, f"dcpst{threads}"), thread_count=threads,
            serialization_format=fs.SerializationFormat.SAFETENSORS))
    files, _ = _data_nbytes(server, f"dcpst{threads}")
    assert len(files) == threads  # 2: one tensor per file, items that do not overlap
    server.mark()
    ck = cl.open(server.url(f"dcpst{threads}/"))
    assert len(_requests(server)) <= 2 + len(files)
    assert not isinstance(ck, DcpCheckpoint)
    for name, want in sd.items():
        assert torch.equal(ck.read(name), want)


# -- a directory URL without its "/" -----------------------------------------------------------
def _opened(ck) -> tuple:
    """What a checkpoint says of itself (the same directory opened two ways must agree)."""
    return (ck.format, ck.path, [(f.path, f.format, f.nbytes, f.full_path) for f in ck.files],
            {n: (t.dtype, t.shape, t.parts) for n, t in ck.tensors.items()}, ck.objects,
            ck.notes)


@pytest.mark.parametrize("rel", ["dcp", "hf"])
def test_a_directory_url_without_its_slash_opens_like_the_one_with_it(server, dcp_dir, hf_dir,
                                                                       rel):
    """nginx answers ``dir`` with a 301 to ``dir/``, which it refuses (403: no listing); the
    redirect says it is a directory: it opens as ``dir/`` does, for those two requests
    more, and reads the same tensors."""
    server.mark()
    with_slash = cl.open(server.url(rel + "/"))
    want = _requests(server)
    server.mark()
    ck = cl.open(server.url(rel))
    seen = _requests(server)
    assert _opened(ck) == _opened(with_slash)
    assert [(r.status, r.path) for r in seen[:2]] == [(301, f"/{rel}"), (403, f"/{rel}/")]
    assert [(r.path, r.range, r.status) for r in seen[2:]] == \
        [(r.path, r.range, r.status) for r in want]
    name = next(iter(ck.tensors))
    want_tensor = with_slash.read(name)
    server.mark()
    assert torch.equal(ck.read(name), want_tensor)
    assert len(_requests(server)) == len(ck.tensors[name].parts)
    _, store = open_url(server.url(rel))
    assert store.stats.requests == len(seen)  # the redirect is counted too


def test_cli_inspect_of_a_directory_url_without_its_slash(server, hf_dir, capsys):
    assert cli.main(["inspect", server.url("hf/"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert cli.main(["inspect", server.url("hf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == want


@pytest.mark.parametrize("rel", ["dcp", "hf"])
def test_cli_offsets_of_a_directory_url_without_its_slash(server, dcp_dir, hf_dir, rel,
                                                          capsys):
    """``offsets dir`` is ``offsets dir/`` (ckptlab.open's rule: the redirect says it is a
    directory): the same JSON but for the two requests of the redirect (301, then 403), which
    ``reads`` and ``bytes_read`` count as the server logged them."""
    server.mark()
    assert cli.main(["offsets", server.url(rel + "/"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    want_seen = _requests(server)
    server.mark()
    assert cli.main(["offsets", server.url(rel), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    seen = _requests(server)
    assert [(r.status, r.path) for r in seen[:2]] == [(301, f"/{rel}"), (403, f"/{rel}/")]
    assert [(r.path, r.range, r.status) for r in seen[2:]] == \
        [(r.path, r.range, r.status) for r in want_seen]
    assert (want["reads"], doc["reads"]) == (len(want_seen), len(seen))
    assert doc["bytes_read"] == want["bytes_read"] + seen[1].body_nbytes  # the 403's page
    counted = ("reads", "bytes_read")
    assert {k: v for k, v in doc.items() if k not in counted} == \
        {k: v for k, v in want.items() if k not in counted}
    assert doc["path"] == server.url(rel) and doc["format"] == rel and doc["offsets"]


# -- errors, CLI, local paths ----------------------------------------------------------------------
def test_missing_file_and_empty_directory_url_are_ckptlab_errors(server, tmp_path):
    with pytest.raises(ArchiveError, match="404") as exc:
        cl.open(server.url("nope.pt"))
    assert exc.value.path == server.url("nope.pt")
    os.makedirs(os.path.join(server.root, "empty"), exist_ok=True)
    with pytest.raises(UnsupportedFormatError, match="cannot be listed"):
        cl.open(server.url("empty/"))


def test_shard_names_that_leave_the_directory_are_refused(server):
    root = os.path.join(server.root, "evil")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "../many.pt"}}, f)
    with pytest.raises(ArchiveError, match="leaves the directory"):
        cl.open(server.url("evil/"))


def test_cli_verbs_take_urls(server, many, mid, hf_dir, capsys):
    assert cli.main(["inspect", server.url(mid), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "torch-zip" and [t["name"] for t in doc["tensors"]] == ["w"]
    assert doc["objects"] == {"step": 3}
    server.mark()
    assert cli.main(["offsets", server.url("many.pt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reads"] == len(_requests(server)) <= 3
    local = cl.storage_offsets(os.path.join(server.root, "many.pt"))
    assert doc["offsets"] == local.offsets
    assert cli.main(["offsets", server.url("hf/"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reads"] == 5 and len(doc["offsets"]) == len(hf_dir)
    assert cli.main(["inspect", server.url(mid), "--records"]) == 0
    assert "data.pkl" in capsys.readouterr().out
    assert cli.main(["readiness", server.url(mid), "--json"]) == 1  # not ready: a URL
    assert json.loads(capsys.readouterr().out)["o_direct"] is False
    assert cli.main(["serve", server.url(mid)]) == 2
    assert "serve shows a checkpoint on this machine" in capsys.readouterr().err
    assert cli.main(["inspect", server.url("nope.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptlab: error:") and err.count("\n") == 1 and "404" in err


def test_file_urls_are_local_paths_and_local_paths_import_no_fsspec(tmp_path):
    path = tmp_path / "a.pt"
    torch.save({"x": torch.arange(3)}, path)
    assert torch.equal(cl.open(path.as_uri()).read("x"), torch.arange(3))
    code = ("import sys, ckptlab; ck = ckptlab.open(sys.argv[1]); ck.read('x'); "
            "print('fsspec' in sys.modules, 'aiohttp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_cli_inspect_json_of_a_dcp_url_has_its_items(server, dcp_dir, capsys):
    assert cli.main(["inspect", server.url("dcp/.metadata"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "dcp" and doc["path"] == server.url("dcp")
    assert {i["fqn"] for i in doc["items"]} >= {"w", "b", "opt.m", "step"}
    local = cli.checkpoint_json(cl.open(os.path.join(server.root, "dcp")), [])
    assert [(i["fqn"], i["offset"], i["nbytes"]) for i in doc["items"]] == \
        [(i["fqn"], i["offset"], i["nbytes"]) for i in local["items"]]


def test_other_fsspec_protocols_read_through_size_and_cat_file(tmp_path):
    """memory:// stands for s3://, hf://...: one size call, then exact cat_file ranges."""
    import fsspec

    path = tmp_path / "m.pt"
    sd = {"a": torch.randn(1000, 1000), "b": torch.arange(5)}
    torch.save(sd, path)
    fs = fsspec.filesystem("memory")
    fs.pipe("/ckptlab-test/m.pt", path.read_bytes())
    try:
        from ckptlab.checkpoint.open import open_url

        ck, store = open_url("memory://ckptlab-test/m.pt")
        assert store.stats.requests <= 4  # size + the torch.save budget of 3
        assert store.stats.log[0][1] == "size"
        assert store.stats.bytes_moved < path.stat().st_size // 2
        assert torch.equal(ck.read("b"), sd["b"]) and torch.equal(ck.read("a"), sd["a"])
        with pytest.raises(ArchiveError, match="no such file"):
            cl.open("memory://ckptlab-test/none.pt")
    finally:
        fs.rm("/ckptlab-test", recursive=True)


def test_without_the_remote_extra_a_url_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec raises ImportError
    with pytest.raises(UnsupportedFormatError, match=r"ckptlab\[remote\]"):
        cl.open("https://127.0.0.1:9/model.pt")
    assert cli.main(["inspect", "https://127.0.0.1:9/model.pt"]) == 2


def test_read_part_goes_through_the_url_one_request_per_part(server):
    """``ck.read_part`` reads one part behind a URL as ``read`` does (was a local-path read)."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([3.0, 4.0]),
                                     (3, 3)).coalesce()
    torch.save({"s": sparse}, os.path.join(server.root, "sparse.pt"))
    ck = cl.open(server.url("sparse.pt"))
    local = cl.open(os.path.join(server.root, "sparse.pt"))
    for role, want in (("indices", sparse.indices()), ("values", sparse.values())):
        server.mark()
        got = ck.read_part("s", role)
        assert len(_requests(server)) == 1
        assert torch.equal(got, want) and torch.equal(local.read_part("s", role), want)
    with pytest.raises(KeyError, match="no part"):
        ck.read_part("s", "scales")


def test_a_file_replaced_on_the_server_after_the_open_is_an_error(server, dcp_big):
    """Every request after a file's first sends its ETag as If-Match: nginx answers 412 for
    a file replaced since, and the read is a ckptlab error naming the URL, not a tensor made
    of two versions."""
    import shutil

    root = _copy_dir(server, "dcpbig", "dcpswap")
    ck = cl.open(server.url("dcpswap/"))
    part = cl.open(root).tensors["big.2"].parts[0]
    path = os.path.join(root, part.file)
    shutil.copyfile(path, path + ".new")
    with open(path + ".new", "r+b") as f:
        f.seek(part.offset)
        f.write(b"\xff" * 64)
    os.replace(path + ".new", path)  # another inode, mtime: another ETag
    os.utime(path, ns=(1, 1))
    server.mark()
    with pytest.raises(ArchiveError, match="changed on the server") as exc:
        ck.read("big.2")
    assert exc.value.path == server.url(f"dcpswap/{part.file}")
    # refused, asked again without the condition (a CDN's own ETag may have refused it),
    # and the file's ETag is another
    assert [r.status for r in _requests(server)] == [412, 206]
    assert torch.equal(cl.open(server.url("dcpswap/")).read("big.3"), dcp_big["big.3"])


def test_diff_and_stats_of_urls_read_each_part_in_one_request(server, tmp_path,
                                                               monkeypatch):
    """``cl.diff`` of a URL against a local file and ``cl.stats`` of a URL: one ranged
    request per tensor (and per piece of a tensor read in pieces), the figures those of the
    local files."""
    from safetensors.torch import save_file

    from ckptlab.compare import _kernels

    torch.manual_seed(11)
    state = {"a": torch.randn(100), "big": torch.randn(3000), "c": torch.arange(10)}
    save_file(state, os.path.join(server.root, "cmp.safetensors"))
    changed = {**state, "big": state["big"] + 1}
    torch.save(changed, tmp_path / "local.pt")
    url = server.url("cmp.safetensors")
    ck = cl.open(url)
    server.mark()
    local = cl.diff(os.path.join(server.root, "cmp.safetensors"), tmp_path / "local.pt")
    remote = cl.diff(ck, tmp_path / "local.pt")
    seen = _requests(server)
    assert len(seen) == len(state), seen  # one ranged request per tensor
    assert all(r.status == 206 for r in seen)
    for name, t in local.tensors.items():
        assert remote.tensors[name] == t, name
    monkeypatch.setattr(_kernels, "CHUNK_NBYTES", 4096)
    server.mark()
    cl.diff(ck, tmp_path / "local.pt")
    pieces = sum(-(-e.nbytes // 4096) for e in ck.tensors.values())
    assert len(_requests(server)) == pieces > len(state)
    monkeypatch.undo()  # (stats at the usual piece size: each tensor whole)
    server.mark()
    found = cl.stats(ck)
    assert len(_requests(server)) == len(state)
    assert found == cl.stats(os.path.join(server.root, "cmp.safetensors"))
