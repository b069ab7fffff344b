"""The data files of a checkpoint directory: their names, generations, and removal.

A save into a directory that already holds data files writes the next *generation*
(``g{N}__{rank}_{bucket}.distcp``), so it never writes a byte of a file the committed
``.metadata`` refers to; after the commit, files of the writer's naming that the new
``.metadata`` does not refer to are removed. A symbolic link is never written through,
replaced or removed.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping

from ckptlab._io.durable import fsync_dir
from ckptlab.errors import WriterError

__all__ = ["DATA_NAME", "data_prefix", "prepare_directory", "remove_files", "remove_stale",
           "scan_directory"]

# the data files this writer (and torch's FileSystemWriter, generation 0) names:
# [g{generation}]__{rank}_{bucket}.distcp
DATA_NAME = re.compile(r"^(?:g([1-9][0-9]*))?__([0-9]+)_([0-9]+)\.distcp$")

RemoveHook = Callable[[str, int], None]  # (file name, nbytes), called before each unlink


def data_prefix(rank: int, generation: int) -> str:
    """The start of a data file name: ``__{rank}_`` (generation 0), ``g{N}__{rank}_``.

    A save into a directory that already holds data files uses the next generation, so it
    never writes a byte of a file the committed ``.metadata`` refers to.
    """
    return f"__{rank}_" if generation == 0 else f"g{generation}__{rank}_"


def symlink_error(path: str) -> WriterError:
    """The refusal of a symbolic link at a name a save would write, replace or remove."""
    try:
        target = os.readlink(path)
    except OSError:  # pragma: no cover - raced away
        target = "?"
    return WriterError(
        f"{path} is a symbolic link (to {target!r}): AsyncWriter never writes through, "
        "replaces or removes a link in a checkpoint directory; remove the link or save to "
        "another directory")


def scan_directory(path: str, metadata_name: str, rank: int | None) -> int:
    """The generation a new save into ``path`` uses: one past every data file there.

    ``rank`` None: every rank's files count (the coordinator of a collective save), else
    only that rank's. Refuses (WriterError) a symbolic link at any name the save may write,
    replace or remove.
    """
    newest = -1
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        raise WriterError(f"cannot list the checkpoint directory {path}: {exc}") from exc
    for entry in entries:
        m = DATA_NAME.match(entry.name)
        ours = m is not None and (rank is None or int(m.group(2)) == rank)
        if not ours and entry.name not in (metadata_name, metadata_name + ".tmp"):
            continue
        if entry.is_symlink():
            raise symlink_error(entry.path)
        if m is not None and ours:
            newest = max(newest, int(m.group(1) or 0))
    return newest + 1


def prepare_directory(path: str, metadata_name: str, rank: int | None, *,
                      overwrite: bool) -> int:
    """Before a save that commits ``metadata_name`` in ``path``: the generation it writes
    (:func:`scan_directory`); with ``overwrite`` False, a committed checkpoint there is
    refused (:class:`~ckptlab.errors.WriterError`)."""
    os.makedirs(path, exist_ok=True)
    if os.path.lexists(os.path.join(path, metadata_name)) and not overwrite:
        raise WriterError(
            f"{path} already holds a checkpoint ({metadata_name} exists) and "
            "overwrite=False: pick a new directory or pass overwrite=True")
    return scan_directory(path, metadata_name, rank)


def remove_files(directory: str, names: Iterable[str] | Mapping[str, tuple[int, int]],
                 hook: RemoveHook | None = None) -> int:
    """Unlink the regular files among ``names`` in ``directory``; errors are ignored (a
    later save removes what is left). With a mapping ``name -> (st_dev, st_ino)`` only the
    files that are still those inodes go. Returns how many were removed."""
    removed = 0
    for name in sorted(names):
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue  # never a link, never a directory
            if isinstance(names, Mapping) and names[name] != (st.st_dev, st.st_ino):
                continue  # not the file this save created
            if hook is not None:
                hook(name, st.st_size)
            os.unlink(path)
            removed += 1
        except Exception:  # the checkpoint's fate does not hang on a leftover file
            continue
    return removed


def remove_stale(directory: str, keep: frozenset[str | None], owner_rank: int | None, *,
                 sync: bool, hook: RemoveHook | None = None) -> None:
    """After a commit: remove every data file of the writer's naming (``owner_rank``'s, or
    every rank's when None) that the new ``.metadata`` does not refer to (``keep``): the
    previous generation, and what killed or failed saves left."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    stale = [n for n in names if n not in keep and (m := DATA_NAME.match(n)) is not None
             and (owner_rank is None or int(m.group(2)) == owner_rank)]
    if stale and remove_files(directory, stale, hook) and sync:
        try:
            fsync_dir(directory)
        except OSError:
            pass
