"""The whole ckptlab error hierarchy.

Every error ckptlab raises on bad input derives from :class:`CkptlabError`, and also from the
standard-library type existing ``except`` clauses already catch (``ValueError`` for bad data,
``RuntimeError`` for failures of the machinery). Messages say what happened, where (file, record,
offset), what was expected and what was found.
"""

from __future__ import annotations

import os

__all__ = [
    "ArchiveError",
    "BackendUnavailableError",
    "CkptlabError",
    "CorruptArchiveError",
    "InvalidArgumentError",
    "LibraryInternalsError",
    "PlanError",
    "StorageIOError",
    "TorchInternalsError",
    "TruncatedArchiveError",
    "UnsupportedFormatError",
    "WriterError",
]


def _clip(value: object, limit: int = 200) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CkptlabError(Exception):
    """Root of every error ckptlab raises on purpose."""


class ArchiveError(CkptlabError, ValueError):
    """A checkpoint file is bad, truncated, corrupt or of an unsupported kind.

    Parameters
    ----------
    message
        What happened, in words.
    path
        The file (or a description of the file object) the problem was found in.
    offset
        Byte offset in the file where the problem was found, if known.
    record
        The zip record (or safetensors tensor) concerned, if known.
    expected, actual
        What the format requires and what the file holds, if that is a single value.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
        record: str | None = None,
        expected: object = None,
        actual: object = None,
    ) -> None:
        self.reason = message
        self.path = None if path is None else os.fspath(path)
        self.offset = offset
        self.record = record
        self.expected = expected
        self.actual = actual
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(str(self.path))
        if self.record is not None:
            where.append(f"record {self.record!r}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        text = f"{': '.join([', '.join(where)] if where else [])}{': ' if where else ''}{self.reason}"
        if self.expected is not None or self.actual is not None:
            text += f" (expected {_clip(self.expected)}, got {_clip(self.actual)})"
        return text


class TruncatedArchiveError(ArchiveError):
    """The file ends before a structure the format requires."""


class CorruptArchiveError(ArchiveError):
    """The file has the structure of a supported format but its contents are inconsistent."""


class UnsupportedFormatError(ArchiveError):
    """The file is readable but is not a format ckptlab inspects (the message says what it is)."""


class PlanError(CkptlabError, ValueError):
    """A checkpoint plan is invalid (overlap, gap, out of bounds)."""


class WriterError(CkptlabError, RuntimeError):
    """A checkpoint writer failed; ``failures`` maps each failed worker to its error.

    Keys name the worker ("rank 0 bucket 1 (__0_1.distcp)", "rank 1", "commit"); values are
    the real exception raised in this process, or the error text another rank reported.
    """

    def __init__(self, message: str,
                 failures: dict[object, BaseException | str] | None = None) -> None:
        self.failures = dict(failures or {})
        super().__init__(message)


class BackendUnavailableError(CkptlabError, RuntimeError):
    """A requested I/O backend cannot run here (no CUDA, no cuFile, O_DIRECT refused, ...)."""


class StorageIOError(CkptlabError, OSError):
    """Reading or writing storage bytes failed (disk full, read past the end, I/O error).

    ``path``, ``offset`` and ``nbytes`` say which bytes; ``errno`` is the OS error number
    when the OS reported one.
    """

    def __init__(self, message: str, *, path: str, offset: int, nbytes: int,
                 errno: int | None = None) -> None:
        self.path, self.offset, self.nbytes = path, offset, nbytes
        text = f"{path}: {message} (bytes [{offset}, {offset + nbytes}))"
        super().__init__(text)
        self.errno = errno  # set after OSError.__init__, which would reset them
        self.strerror = text

    def __str__(self) -> str:
        return self.strerror if self.errno is None else f"[Errno {self.errno}] {self.strerror}"


class InvalidArgumentError(CkptlabError, ValueError):
    """A ckptlab function was called with an argument it cannot honour (e.g. alignment 0)."""


# -- internal signals: raised and caught inside ckptlab, never seen by a caller -------------
class PickleDataError(Exception):
    """The pickle is malformed or does something ckptlab never allows (no position yet).

    Raised inside ckptlab's bounded pickle interpreter (:mod:`ckptlab.format._unpickle`); the
    reader that called it turns it into a :class:`CorruptArchiveError` naming file, record and
    offset. Not a :class:`CkptlabError` on purpose: it carries no file or offset.
    """


class PickleBudgetError(PickleDataError):
    """The pickle would make ckptlab use more memory than its budget allows."""


class TorchInternalsError(CkptlabError, RuntimeError):
    """A private torch (or CPython) symbol ckptlab relies on is missing or has changed.

    ckptlab reaches every such symbol through :mod:`ckptlab._torch_compat`, which names the
    torch versions each was checked on. ``symbol`` is the dotted name, ``torch_version`` the
    installed torch's version and ``checked_on`` the versions the symbol was verified against.
    """

    def __init__(self, message: str, *, symbol: str, torch_version: str,
                 checked_on: tuple[str, ...] = ()) -> None:
        self.symbol, self.torch_version, self.checked_on = symbol, torch_version, checked_on
        super().__init__(message)


class LibraryInternalsError(CkptlabError, RuntimeError):
    """A private API of bokeh, panel, plotly, anywidget or ipywidgets that ckptlab's views
    rely on is missing or has changed.

    ckptlab reaches every such API through :mod:`ckptlab.widgets._compat`, which names the
    versions each was checked on. ``symbol`` is the private name (``bokeh.server.server.
    Server._tornado``), ``library`` the distribution that holds it, ``version`` the installed
    version of it and ``checked_on`` the versions the use was verified against.
    """

    def __init__(self, message: str, *, symbol: str, library: str, version: str,
                 checked_on: tuple[str, ...] = ()) -> None:
        self.symbol, self.library, self.version = symbol, library, version
        self.checked_on = checked_on
        super().__init__(message)


class RankError(CkptlabError, RuntimeError):
    """One or more torch.distributed ranks failed or died (:func:`ckptlab.plan.run_ranks`).

    ``failures`` maps each failed rank to its error (traceback text), in the order the
    failures arrived.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        self.failures = dict(failures)
        super().__init__(message)


__all__.append("RankError")
