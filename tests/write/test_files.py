"""Data file names, generations and removal (``ckptlab.write._files``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptlab.errors import WriterError
from ckptlab.write._files import (
    DATA_NAME,
    data_prefix,
    remove_files,
    remove_stale,
    scan_directory,
)


def touch(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_bytes(b"x")


def test_names_and_prefixes() -> None:
    assert data_prefix(0, 0) == "__0_" and data_prefix(3, 2) == "g2__3_"
    assert DATA_NAME.match("__0_1.distcp") and DATA_NAME.match("g12__3_0.distcp")
    for bad in ("g0__0_1.distcp", "__0_1.distcp.tmp", "x__0_1.distcp", "__a_1.distcp"):
        assert not DATA_NAME.match(bad), bad


def test_the_next_generation_is_one_past_every_data_file(tmp_path: Path) -> None:
    assert scan_directory(str(tmp_path), ".metadata", None) == 0
    touch(tmp_path, "__0_0.distcp", "g3__1_0.distcp", "g7__2_1.distcp", "notes.txt")
    assert scan_directory(str(tmp_path), ".metadata", None) == 8
    assert scan_directory(str(tmp_path), ".metadata", 1) == 4  # only rank 1's files count
    assert scan_directory(str(tmp_path), ".metadata", 5) == 0


@pytest.mark.parametrize("name", [".metadata", ".metadata.tmp", "g2__0_0.distcp"])
def test_a_link_at_a_name_the_save_touches_is_refused(tmp_path: Path, name: str) -> None:
    os.symlink(tmp_path / "target", tmp_path / name)
    with pytest.raises(WriterError, match="symbolic link") as info:
        scan_directory(str(tmp_path), ".metadata", None)
    assert str(tmp_path / name) in str(info.value)


def test_remove_files_removes_regular_files_only(tmp_path: Path) -> None:
    touch(tmp_path, "a", "b")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    seen: list[tuple[str, int]] = []
    n = remove_files(str(tmp_path), ["a", "d", "link", "missing"],
                     lambda name, nbytes: seen.append((name, nbytes)))
    assert n == 1 and seen == [("a", 1)]
    assert sorted(os.listdir(tmp_path)) == ["b", "d", "link"]


def test_remove_files_by_inode_leaves_a_replaced_file(tmp_path: Path) -> None:
    touch(tmp_path, "f", "g")  # both exist at once: two inodes
    st = os.stat(tmp_path / "f")
    (tmp_path / "g").rename(tmp_path / "f")  # another file now has the name
    assert remove_files(str(tmp_path), {"f": (st.st_dev, st.st_ino)}) == 0
    assert (tmp_path / "f").exists()


def test_remove_stale_keeps_what_the_metadata_refers_to(tmp_path: Path) -> None:
    touch(tmp_path, "__0_0.distcp", "__1_0.distcp", "g1__0_0.distcp", "g1__1_0.distcp",
          ".metadata", "user.txt")
    keep = frozenset({"g1__0_0.distcp", "g1__1_0.distcp"})
    remove_stale(str(tmp_path), keep, 1, sync=True)  # only rank 1's files
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "g1__0_0.distcp",
                                            "g1__1_0.distcp", "user.txt"]
    remove_stale(str(tmp_path), keep, None, sync=False)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "g1__0_0.distcp", "g1__1_0.distcp",
                                            "user.txt"]
