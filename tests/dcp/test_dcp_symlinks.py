"""Inspecting a DCP directory reads only files inside it.

A real checkpoint is written once with ``torch.distributed.checkpoint`` (one process), then
copied and edited: a ``.distcp`` replaced by a symlink to a file outside the directory, the
``.metadata`` replaced by one, a ``relative_path`` with ``..`` or an absolute path, a data file
replaced by a FIFO. All are refused with an :class:`ArchiveError` naming the file; a symlink
from one file of the directory to another inside it is followed.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.dcp import inspect_dcp, load_metadata
from ckptlab.errors import ArchiveError
from ckptlab.testing import dcp_workers

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks here")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({**dcp_workers.full_state(), "step": 3}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture
def copy(checkpoint: Path, tmp_path: Path) -> Path:
    """A fresh copy of the checkpoint, with a directory ``outside`` next to it."""
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint, out)
    (tmp_path / "outside").mkdir()
    return out


def data_file(path: Path) -> Path:
    (distcp,) = path.glob("*.distcp")
    return distcp


def move_out_and_link(file: Path, target: Path) -> None:
    """Move ``file`` to ``target`` and leave an absolute symlink in its place."""
    shutil.move(file, target)
    file.symlink_to(target)


def test_the_checkpoint_opens(checkpoint: Path) -> None:
    layout = cl.inspect(checkpoint)
    assert layout.format == "dcp" and {i.fqn for i in layout.items} >= {"w", "b", "step"}


@pytest.mark.parametrize("item_layouts", [True, False])
def test_distcp_symlink_out_of_the_directory_is_refused(copy: Path, item_layouts: bool) -> None:
    distcp = data_file(copy)
    target = copy.parent / "outside" / distcp.name
    move_out_and_link(distcp, target)
    assert cl.plan.load_metadata(copy) is not None  # the metadata itself is fine
    with pytest.raises(ArchiveError, match="symlink that leaves the checkpoint directory") as e:
        inspect_dcp(copy, item_layouts=item_layouts)
    assert e.value.path == str(distcp) and str(target) in str(e.value)


def test_relative_symlink_climbing_out_is_refused(copy: Path) -> None:
    distcp = data_file(copy)
    shutil.move(distcp, copy.parent / "outside" / distcp.name)
    distcp.symlink_to(Path("..") / "outside" / distcp.name)
    with pytest.raises(ArchiveError, match="leaves the checkpoint directory"):
        cl.inspect(copy)


def test_metadata_symlink_out_of_the_directory_is_refused(copy: Path) -> None:
    meta = copy / ".metadata"
    move_out_and_link(meta, copy.parent / "outside" / ".metadata")
    for call in (cl.inspect, inspect_dcp, load_metadata):
        with pytest.raises(ArchiveError, match="symlink that leaves the checkpoint") as e:
            call(copy)
        assert e.value.path == str(meta)
    assert main(["inspect", str(copy)]) == 2


def test_symlinked_directory_itself_is_fine(checkpoint: Path, tmp_path: Path) -> None:
    """The root is resolved too: a link to a checkpoint directory opens it."""
    link = tmp_path / "latest"
    link.symlink_to(checkpoint, target_is_directory=True)
    assert len(cl.inspect(link).items) == len(cl.inspect(checkpoint).items)


def test_symlink_inside_the_directory_is_followed(copy: Path) -> None:
    distcp = data_file(copy)
    real = copy / "shard.bin"
    distcp.rename(real)
    distcp.symlink_to(real.name)  # relative, stays inside
    layout = cl.inspect(copy)
    assert {i.file for i in layout.items} == {distcp.name}
    assert all(i.layout is not None for i in layout.items)


def rewrite_relative_paths(path: Path, relative_path: str) -> None:
    """Point every item of the metadata at ``relative_path`` (benign data, our own file)."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    meta.storage_data = {index: dataclasses.replace(info, relative_path=relative_path)
                         for index, info in meta.storage_data.items()}
    (path / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "nested-dotdot"])
def test_relative_path_leaving_the_directory_is_refused(copy: Path, where: str) -> None:
    distcp = data_file(copy)
    outside = copy.parent / "outside" / distcp.name
    shutil.copy(distcp, outside)
    name = {"dotdot": f"../outside/{distcp.name}", "absolute": str(outside),
            "nested-dotdot": f"sub/../../outside/{distcp.name}"}[where]
    rewrite_relative_paths(copy, name)
    for item_layouts in (True, False):
        with pytest.raises(ArchiveError, match="outside the checkpoint directory") as e:
            inspect_dcp(copy, item_layouts=item_layouts)
        assert name in str(e.value)


_FIFO_PROBE = textwrap.dedent("""
    import sys
    from ckptlab.errors import UnsupportedFormatError
    from ckptlab.dcp import inspect_dcp, load_metadata
    try:
        (load_metadata if sys.argv[2] == "metadata" else inspect_dcp)(sys.argv[1])
    except UnsupportedFormatError as exc:
        print(exc)
""")


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_fifo_in_the_directory_is_refused_without_blocking(copy: Path, which: str) -> None:
    """In a subprocess with a timeout: a regression would block in open() forever."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = data_file(copy) if which == "data" else copy / ".metadata"
    fifo.unlink()
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-c", _FIFO_PROBE, str(copy), which],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "is a FIFO (named pipe), not a regular file" in out.stdout, out
    assert str(fifo) in out.stdout
