"""The one byte source: a local path, a file object, bytes or an fsspec URL, read by range.

Every reader of ckptlab takes a :class:`ByteSource` and never asks which kind it has; what a
URL does differently is a property of its source (:class:`RemoteSource`: exact ranged
requests counted in :class:`RemoteStats`, the bytes moved kept, a file's ``ETag`` sent as
``If-Match`` after its first request, the first request asking for the head or the tail a
reader needs). A directory is a :class:`Tree` (:class:`LocalTree`, :class:`RemoteTree`):
files by name, listed where that can be done. :func:`locate` says where a name points.

- :mod:`ckptlab.source._bytes`: :class:`ByteSource` and its hints (``costly_reads``,
  ``prefetch``, ``kept``/``keep``/``forget``, ``fetch``);
- :mod:`ckptlab.source._remote`: :class:`RemoteStore` (the requests) and
  :class:`RemoteSource`;
- :mod:`ckptlab.source._tree`: :class:`Tree`, :class:`Location`, :func:`locate`;
- :mod:`ckptlab.source._paths`: opening local files safely (regular files only, never out of
  a checkpoint directory);
- :mod:`ckptlab.source._window`: file objects over a window of a file or over a source.

fsspec (and aiohttp for HTTP) is imported on first use of a URL only.
"""

from ckptlab.source._bytes import ByteSource, file_url_path, is_url
from ckptlab.source._paths import IsDirectoryError, NotFoundError
from ckptlab.source._remote import (
    RemoteFileObject,
    RemoteNotFoundError,
    RemoteSource,
    RemoteStats,
    RemoteStore,
    join_url,
    url_name,
)
from ckptlab.source._tree import (
    LocalTree,
    Location,
    RemoteTree,
    Tree,
    check_unchanged,
    file_identity,
    locate,
)
from ckptlab.source._window import FileWindow, PositionalFile

__all__ = ["ByteSource", "FileWindow", "IsDirectoryError", "LocalTree", "Location",
           "NotFoundError", "PositionalFile", "RemoteFileObject", "RemoteNotFoundError",
           "RemoteSource", "RemoteStats", "RemoteStore", "RemoteTree", "Tree",
           "check_unchanged", "file_identity", "file_url_path", "is_url", "join_url",
           "locate", "url_name"]
