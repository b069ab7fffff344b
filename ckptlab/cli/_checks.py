"""Paths and ports named by the arguments, checked before any work starts."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import stat
from collections.abc import Callable

from ckptlab.errors import InvalidArgumentError

# -- paths, ports: checked before any work -------------------------------------------------
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _stat(path: str, doing: str = "cannot open") -> os.stat_result | None:
    """``os.stat(path)``, None when nothing is there; other failures as one-line errors."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ENOTDIR, EACCES, ELOOP, a NUL in the name
        raise InvalidArgumentError(
            f"{path}: {doing}: {getattr(exc, 'strerror', None) or exc}") from None


# a URL: a scheme of two or more letters then "://" (ckptlab.format._source.is_url's rule,
# repeated here so that a plain path imports nothing)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def _is_url(path: str | None) -> bool:
    return path is not None and _URL.match(path) is not None


def _local_url(path: str) -> str | None:
    """The local path of a ``file://`` URL, else None."""
    from ckptlab.source._bytes import file_url_path

    return file_url_path(path)


def _input_path(path: str | None, verb: str, *, directory: bool = False) -> str:
    """A checkpoint to read: PATH, or the embedded sample when none is given.

    Refuses a missing path, a directory where a file is needed, and anything that is not a
    regular file (a FIFO would block the read forever, a device never ends). A URL is
    returned as it is (``file://`` URLs as their local path, checked like a path): it is
    checked by the requests that open it.
    """
    if path is None:
        from ckptlab.samples import sample_path

        return str(sample_path())
    if not path:
        raise InvalidArgumentError(f"ckptlab {verb}: the checkpoint path is empty")
    if _is_url(path):
        local = _local_url(path)
        if local is None:
            return path
        path = local
    st = _stat(path)
    if st is None:
        raise InvalidArgumentError(f"{path}: cannot open: No such file or directory")
    if stat.S_ISDIR(st.st_mode):
        if not directory:
            raise InvalidArgumentError(
                f"{path}: is a directory; ckptlab {verb} reads a checkpoint file "
                "(.pt, .bin, .safetensors)")
        try:
            entries = list(os.scandir(path))
        except OSError as exc:
            raise InvalidArgumentError(f"{path}: cannot list: {exc.strerror}") from None
        for entry in entries:  # a DCP directory's files are read too: none may block
            try:
                mode = entry.stat().st_mode
            except OSError:
                continue  # a dangling link: the reader says so if it needs it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise InvalidArgumentError(
                    f"{entry.path}: is {_kind(mode)}, not a regular file: ckptlab reads only "
                    "regular files")
    elif not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(
            f"{path}: is {_kind(st.st_mode)}, not a regular file: ckptlab {verb} reads "
            "checkpoint files")
    return path


def _output_path(path: str, what: str) -> str:
    """A file to write: its directory must exist and the path must not be anything but a
    regular file (a directory cannot be overwritten, a FIFO would block)."""
    if not path:
        raise InvalidArgumentError(f"the {what} path is empty")
    if path.endswith(("/", os.sep)):
        raise InvalidArgumentError(f"{path}: names a directory; give the {what} a file name")
    st = _stat(path, f"cannot write the {what}")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{path}: is a directory; give the {what} a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(
            f"{path}: is {_kind(st.st_mode)}, not a regular file: refusing to write the "
            f"{what} into it")
    parent = os.path.dirname(path) or "."
    pst = _stat(parent, f"cannot write the {what} into it")
    if pst is None:
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: directory {parent} does not exist (create it "
            "first)")
    if not stat.S_ISDIR(pst.st_mode):
        raise InvalidArgumentError(f"{path}: cannot write the {what}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: no permission to write into {parent}")
    return path


def _write_file(path: str, what: str, write: Callable[[str], object]) -> None:
    """Call ``write(tmp)`` on a same-named path in a fresh directory beside ``path``, then move
    the result onto ``path``: a failed write leaves no half file, and torch.save, which names
    the archive after the file, sees the same name."""
    import tempfile

    parent = os.path.dirname(path) or "."
    try:
        tmp = tempfile.mkdtemp(dir=parent, prefix=".ckptlab-")
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot write the {what}: cannot create a file in "
                                   f"{parent} ({exc.strerror or exc})") from None
    try:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        try:
            write(tmp_path)
        except RuntimeError as exc:  # torch.save reports I/O failures as RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InvalidArgumentError(f"{path}: cannot write the {what}: {first}") from None
        os.replace(tmp_path, path)
    except OSError as exc:
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_listen(address: str, port: int) -> None:
    """Refuse an address that does not resolve or a port something else listens on, before
    the (slow) layout is loaded; bound as tornado binds (SO_REUSEADDR, IPv6 only on IPv6
    sockets, a missing ::1 skipped for localhost). The server's own bind can still fail (a
    race): main reports that too."""
    import socket

    if not address.strip():
        raise InvalidArgumentError("--address is empty (127.0.0.1: this machine only; 0.0.0.0: "
                                   "every interface)")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidArgumentError(
            f"--address {address!r}: not an address of this machine "
            f"({getattr(exc, 'strerror', None) or exc})") from None
    for family, sockaddr in dict.fromkeys((info[0], info[4]) for info in infos):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and address == "localhost" and (
                        sockaddr[0] == "::1"):
                    continue  # IPv6 half disabled (containers): tornado skips it too
                if exc.errno == errno.EADDRINUSE:
                    raise InvalidArgumentError(
                        f"{address}:{port} is already in use (another server listens there): "
                        "pick another --port") from None
                raise InvalidArgumentError(
                    f"cannot listen on {address}:{port}: {exc.strerror or exc}") from None


def _check_servable(path: str) -> None:
    """``serve`` shows any checkpoint ``ckptlab.open`` reads: refuse, up front and in one line,
    a file that is no checkpoint at all and an empty directory (the server opens the rest)."""
    from ckptlab.format.inspect import not_a_checkpoint, sniff
    from ckptlab.source._bytes import ByteSource

    _input_path(path, "serve", directory=True)
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        from ckptlab.checkpoint.runs import find_run

        with os.scandir(path) as entries:
            if not any(e.is_file() for e in entries) and find_run(path) is None:
                raise InvalidArgumentError(
                    f"{path}: a directory without files: give a checkpoint file or a "
                    "directory of one (Hugging Face, DCP, shards)")
        return
    with ByteSource(path) as src:
        kind = sniff(src)
        if kind in ("empty", "unknown"):
            raise not_a_checkpoint(src, kind)


def _check(args: argparse.Namespace) -> None:
    """Check every argument that names something outside (paths, ports) before any work."""
    verb = args.verb
    if _is_url(args.path) and _local_url(args.path) is not None:  # file://: a local path
        args.path = _local_url(args.path)
    if verb == "serve" and _is_url(args.path):
        raise InvalidArgumentError(
            f"{args.path}: ckptlab serve shows a checkpoint on this machine; for a URL, "
            f"'ckptlab inspect {args.path}' lists its tensors and 'ckptlab report "
            f"{args.path}' draws its bytes (or download the file and serve it)")
    if verb == "serve":
        _check_listen(args.address, args.port)
    if verb == "serve" and getattr(args, "compare", None) is not None:
        if _is_url(args.compare) or args.path is None:
            raise InvalidArgumentError(
                f"{args.compare if args.path else '--compare'}: ckptlab serve --compare shows "
                "two checkpoints on this machine (PATH and OTHER); for URLs, 'ckptlab report "
                "A --compare B' draws the same")
        _input_path(args.path, verb, directory=True)
        _input_path(args.compare, verb, directory=True)
    elif verb == "serve" and args.path is not None:
        _check_servable(args.path)
    elif verb != "sample" and args.path is not None:
        _input_path(args.path, verb, directory=True)
    if verb == "scan":
        args.paths = [_local_url(p) if _is_url(p) and _local_url(p) is not None else p
                      for p in args.paths]
        for path in args.paths:
            _input_path(path, verb, directory=True)
    if verb == "diff":
        if _is_url(args.other) and _local_url(args.other) is not None:
            args.other = _local_url(args.other)
        _input_path(args.other, verb, directory=True)
    if verb == "sample":
        _output_path(args.path, "sample")
    if verb == "convert":
        if args.shard_size is None:
            _output_path(args.output, "converted checkpoint")
        else:  # a sharded directory, new or replacing one: its parent must take it
            out = args.output.rstrip("/") or "/"
            st = _stat(out, "cannot write the converted checkpoint")
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise InvalidArgumentError(f"{out}: exists and is not a directory; a sharded "
                                           "checkpoint is a directory: give another name")
            parent = os.path.dirname(os.path.abspath(out))
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
                raise InvalidArgumentError(f"{out}: cannot write the converted checkpoint: "
                                           f"{parent} is not a directory this user can write "
                                           "into")
    if verb == "report":
        _output_path(args.output, "report")
        if args.path is not None and not _is_url(args.path) and os.path.exists(
                args.output) and os.path.samefile(args.path, args.output):
            raise InvalidArgumentError(
                f"{args.output}: is the checkpoint being reported on; give the report another "
                "name (-o)")
