"""ckptlab.gds.readiness and `ckptlab readiness`: alignment, padding cost, filesystem, O_DIRECT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.gds.readiness import filesystem_of, o_direct_probe, readiness


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("ready")
    for a in (64, 4096):
        (d / f"a{a}").mkdir()
    return {a: cl.samples.write_sample(d / f"a{a}" / "sample.pt", storage_alignment=a)
            for a in (64, 4096)}


def test_a_default_checkpoint_is_not_ready(files) -> None:
    r = readiness(files[64])
    layout = cl.inspect(files[64])
    storages = [s for s in layout.storages if s.nbytes]
    assert r.storages == len(storages)
    assert r.storages_4k_aligned == sum(1 for s in storages if s.data_offset % 4096 == 0)
    assert set(r.unaligned_keys) == {s.key for s in storages if s.data_offset % 4096}
    assert not r.ready and not r.gds
    assert r.storage_alignment == 64 and r.file_nbytes == files[64].stat().st_size


def test_a_4096_checkpoint_is_ready_where_o_direct_works(files) -> None:
    r = readiness(files[4096])
    assert r.storages_4k_aligned == r.storages and not r.unaligned_keys
    assert r.ready == r.o_direct
    # the padding cost is what the two real files differ by
    assert r.file_nbytes_at_4096 == files[4096].stat().st_size
    assert r.file_nbytes_at_64 == files[64].stat().st_size
    assert r.padding_cost_nbytes == files[4096].stat().st_size - files[64].stat().st_size


def test_machine_facts_are_real(files) -> None:
    r = readiness(files[64])
    assert r.nvidia_fs == os.path.exists("/proc/driver/nvidia-fs")
    assert r.torch_gds == (torch.cuda.is_available() and r.torch_gds)  # never without CUDA
    if not torch.cuda.is_available():
        assert not r.torch_gds and not r.kvikio and not r.gds
    fs, mount = filesystem_of(files[64])
    assert (r.filesystem, r.mount_point) == (fs, mount)
    assert str(files[64].resolve()).startswith(mount)
    with open("/proc/self/mounts") as f:
        assert any(line.split()[1] == mount and line.split()[2] == fs for line in f)


def test_o_direct_probe_never_writes(files, tmp_path) -> None:
    before = files[64].read_bytes()
    ok, why = o_direct_probe(files[64])
    assert isinstance(ok, bool) and why
    assert files[64].read_bytes() == before
    ok, why = o_direct_probe(tmp_path / "missing.pt")
    assert not ok and "No such file" in why


def test_to_dict_is_json(files) -> None:
    d = readiness(files[4096]).to_dict()
    json.dumps(d)
    assert d["ready"] == (d["storages_4k_aligned"] == d["storages"] and d["o_direct"])


def test_cli_readiness(files, capsys) -> None:
    assert main(["readiness", str(files[64])]) == 1  # NOT READY: exit 1, as scan and diff
    out = capsys.readouterr().out
    assert "NOT READY" in out and "storage_alignment = 4096" in out
    status = main(["readiness", str(files[4096]), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["storages_4k_aligned"] == d["storages"]
    assert status == (0 if d["ready"] else 1)  # (O_DIRECT depends on this file system)


def test_cli_readiness_of_bad_input_exits_2(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 10)
    assert main(["readiness", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptlab: error:") and str(bad) in err and "\n" == err[-1]
