"""ckptlab.source's trees and locate: a local directory (never a file outside it) and a
directory behind an fsspec URL (memory:// standing for s3://, hf://...), read the same way."""

from __future__ import annotations

import io
import os

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import ArchiveError
from ckptlab.source import LocalTree, NotFoundError, RemoteTree, locate


@pytest.fixture
def tree_dir(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "sub").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"secret")
    return root


def test_a_local_tree_lists_and_reads_only_its_own_files(tree_dir):
    tree = LocalTree(tree_dir)
    assert tree.list() == ["a.bin"]
    with tree.source("a.bin") as src:
        assert src.read(2, 3) == b"234" and not src.costly_reads and src.holds_descriptor
    assert tree.read_bytes("a.bin") == (str(tree_dir / "a.bin"), b"0123456789")
    assert tree.fetch(tree.resolve("a.bin"), 8, 20) == b"89"  # fewer at the end
    assert tree.sizes(None, listed=True) == {"a.bin": 10}
    with pytest.raises(NotFoundError):
        tree.source("missing.bin")
    for name in ("../outside.bin", "/etc/passwd"):
        with pytest.raises(ArchiveError, match="outside the checkpoint directory"):
            tree.source(name)
    os.symlink(tree_dir.parent / "outside.bin", tree_dir / "link.bin")
    with pytest.raises(ArchiveError, match="symlink that leaves the checkpoint directory"):
        tree.source("link.bin")
    with pytest.raises(ArchiveError, match="symlink that leaves the checkpoint directory"):
        tree.list()
    assert tree.sizes(None, listed=True) == {"a.bin": 10}  # a listing leaves it out


def test_again_reads_a_local_file_again_unless_it_changed(tree_dir):
    tree = LocalTree(tree_dir)
    with tree.mapped("a.bin", 100) as (data, identity):
        again = tree.again("a.bin", data, identity)
    assert again() == b"0123456789"
    (tree_dir / "a.bin").write_bytes(b"another file")
    with pytest.raises(ArchiveError, match="changed since"):
        again()
    with pytest.raises(ValueError):
        with tree.mapped("a.bin", 4):
            pass


def test_locate(tree_dir):
    assert locate(str(tree_dir)).tree.name == str(tree_dir) and locate(str(tree_dir)).file is None
    where = locate((tree_dir / "a.bin").as_uri())
    assert (where.tree.name, where.file, where.rel) == (str(tree_dir), str(tree_dir / "a.bin"),
                                                        "a.bin")
    assert locate(b"xyz").obj == b"xyz" and locate(io.BytesIO()).tree is None
    with pytest.raises(ArchiveError, match="no such file or directory"):
        locate(str(tree_dir / "nope"))


def test_a_store_directory_without_its_slash_opens_like_the_one_with_it(tmp_path):
    """memory:// has no redirects: its ``info`` says a directory, which opens as one."""
    fsspec = pytest.importorskip("fsspec")
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0)}, tmp_path / "model.safetensors")
    fs = fsspec.filesystem("memory")
    fs.pipe("/ckptlab-tree/d/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    try:
        plain = cl.open("memory://ckptlab-tree/d/")
        ck = cl.open("memory://ckptlab-tree/d")
        assert ck.path == plain.path == "memory://ckptlab-tree/d"
        assert ck.files == plain.files and ck.tensors == plain.tensors
        assert torch.equal(ck.read("w"), torch.arange(6.0))
        where = locate("memory://ckptlab-tree/d/")
        assert isinstance(where.tree, RemoteTree) and where.tree.list() is None
        with where.tree.source("model.safetensors") as src:
            assert src.costly_reads and not src.holds_descriptor
    finally:
        fs.rm("/ckptlab-tree", recursive=True)
