"""``ckptlab.inspect``: one entry point for files (format) and DCP directories (plan)."""

from __future__ import annotations

import os
from typing import BinaryIO

from ckptlab.dcp import DcpLayout, inspect_dcp, is_dcp_dir
from ckptlab.format import ArchiveLayout
from ckptlab.format import inspect as inspect_file

__all__ = ["inspect"]


def inspect(source: str | os.PathLike[str] | BinaryIO | bytes) -> ArchiveLayout | DcpLayout:
    """The layout of a checkpoint: a torch.save file, a ``.safetensors`` file or a DCP directory.

    Files give an :class:`~ckptlab.format.ArchiveLayout` (see :func:`ckptlab.format.inspect`); a
    directory written by ``torch.distributed.checkpoint.save`` gives a
    :class:`~ckptlab.plan.DcpLayout` (see :func:`ckptlab.plan.inspect_dcp`). Nothing in the
    checkpoint is executed.
    """
    if isinstance(source, (str, os.PathLike)) and is_dcp_dir(source):
        return inspect_dcp(source)
    return inspect_file(source)
