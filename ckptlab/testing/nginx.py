"""A real nginx on 127.0.0.1 serving a directory, whose access log counts the requests.

Remote opening is judged by the requests a production HTTP server sees: ranged ``GET`` s as
nginx answers them (``206`` with ``Content-Range``, suffix ranges, ``416`` past the end), one
line per request in a log of its own. Python's ``http.server`` would not do: it ignores
``Range``. :class:`NginxServer` starts Debian's nginx (package ``nginx-light``) as a plain
subprocess (``daemon off``) with a configuration, pid file, error log, access log and temp
directories of its own in a temporary directory, on a free port of 127.0.0.1, optionally
throttled (``limit_rate``), and stops it on :meth:`NginxServer.stop` or leaving ``with``.

Examples
--------
>>> from ckptlab.testing.nginx import NginxServer, nginx_executable
>>> if nginx_executable():                                     # doctest: +SKIP
...     with NginxServer("/srv/checkpoints") as server:
...         ck = ckptlab.open(server.url("model.pt"))
...         print(len(server.requests()))
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType

__all__ = ["NGINX_MISSING", "AccessLogEntry", "NginxServer", "nginx_executable"]

NGINX_CANDIDATES = ("/usr/sbin/nginx", "nginx")
NGINX_MISSING = (
    "nginx is not installed: the remote-checkpoint tests count requests in a real nginx's "
    "access log (Debian: `apt-get install --no-install-recommends nginx-light`, or `make "
    "nginx`; or point CKPTLAB_NGINX at an nginx binary)")

# one line per request: method, path, the Range header as sent, status, body bytes, seconds
_LOG_FORMAT = "$request_method\\t$uri\\t$http_range\\t$status\\t$body_bytes_sent\\t$request_time"


def nginx_executable() -> str | None:
    """$CKPTLAB_NGINX if set, else Debian's /usr/sbin/nginx, else nginx on PATH (or None)."""
    env = os.environ.get("CKPTLAB_NGINX")
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in NGINX_CANDIDATES:
        found = candidate if os.path.isabs(candidate) and os.access(candidate, os.X_OK) \
            else shutil.which(candidate)
        if found:
            return found
    return None


@dataclass(frozen=True, slots=True)
class AccessLogEntry:
    """One request as nginx logged it."""

    method: str
    path: str  # the URI path (decoded)
    range: str | None  # the Range header, None when the request had none
    status: int
    body_nbytes: int  # body bytes sent
    request_s: float  # nginx's $request_time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NginxServer:
    """nginx serving ``root`` read-only on ``http://127.0.0.1:<port>/``.

    Parameters
    ----------
    root
        The directory served (files are served as they are; no listing, no compression).
    limit_rate_nbytes
        Throttle each response to this many bytes per second (nginx ``limit_rate``); None for
        no limit.
    executable
        The nginx binary (default: :func:`nginx_executable`).

    Raises
    ------
    FileNotFoundError
        No nginx binary (see :data:`NGINX_MISSING`).
    RuntimeError
        nginx did not start (its error log is in the message).
    """

    def __init__(self, root: str | os.PathLike[str], *, limit_rate_nbytes: int | None = None,
                 executable: str | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.limit_rate_nbytes = limit_rate_nbytes
        self.executable = executable or nginx_executable()
        if self.executable is None:
            raise FileNotFoundError(NGINX_MISSING)
        self.port = 0
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._mark = 0

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def access_log(self) -> str:
        """Path of the access log (one line per request)."""
        assert self._dir is not None, "start() the server first"
        return os.path.join(self._dir, "access.log")

    @property
    def error_log(self) -> str:
        """Path of nginx's error log."""
        assert self._dir is not None, "start() the server first"
        return os.path.join(self._dir, "error.log")

    def _config(self) -> str:
        assert self._dir is not None
        d = self._dir
        user = ""
        if os.geteuid() == 0:  # workers would run as nobody, unable to read a private tmp dir
            import pwd

            user = f"user {pwd.getpwuid(0).pw_name};\n"
        rate = f"limit_rate {self.limit_rate_nbytes};" if self.limit_rate_nbytes else ""
        temps = "\n".join(f"    {name}_temp_path {d}/{name};" for name in
                          ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        return f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format counted "{_LOG_FORMAT}";
    access_log {d}/access.log counted;
{temps}
    default_type application/octet-stream;
    types {{ }}
    sendfile on;
    keepalive_timeout 60;
    keepalive_requests 100000;
    gzip off;
    server_tokens off;
    server {{
        listen 127.0.0.1:{self.port};
        root {self.root};
        location / {{ autoindex off; {rate} }}
    }}
}}
"""

    def start(self) -> NginxServer:
        """Start nginx and wait until it accepts connections (tries a few free ports)."""
        last = ""
        for _ in range(5):
            self._dir = tempfile.mkdtemp(prefix="ckptlab-nginx-")
            self.port = _free_port()
            conf = os.path.join(self._dir, "nginx.conf")
            with open(conf, "w", encoding="utf-8") as f:
                f.write(self._config())
            self._proc = subprocess.Popen(
                [self.executable, "-c", conf, "-p", self._dir + "/", "-e", self.error_log],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                with contextlib.suppress(OSError), socket.create_connection(
                        ("127.0.0.1", self.port), timeout=0.2):
                    self._mark = 0
                    return self
                time.sleep(0.02)
            last = self._stop_and_read_errors()
        raise RuntimeError(f"nginx did not start: {last.strip()[-2000:]}")

    def _stop_and_read_errors(self) -> str:
        text = ""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(5)
                if self._proc.poll() is None:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stderr is not None:
                text += self._proc.stderr.read().decode(errors="replace")
                self._proc.stderr.close()
            self._proc = None
        if self._dir is not None:
            with contextlib.suppress(OSError), open(os.path.join(self._dir, "error.log"),
                                                    encoding="utf-8", errors="replace") as f:
                text += f.read()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        return text

    def stop(self) -> None:
        """Stop nginx (TERM, then KILL after 5 s) and remove its directory."""
        self._stop_and_read_errors()

    def __enter__(self) -> NginxServer:
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- use ----------------------------------------------------------------------------------
    def url(self, relative: str = "") -> str:
        """``http://127.0.0.1:<port>/<relative>``."""
        return f"http://127.0.0.1:{self.port}/{relative.lstrip('/')}"

    def _lines(self) -> list[str]:
        try:
            with open(self.access_log, encoding="utf-8", errors="replace") as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []

    def requests(self, *, since_mark: bool = True, settle_s: float = 0.05
                 ) -> list[AccessLogEntry]:
        """The requests nginx has logged (since the last :meth:`mark` unless told otherwise).

        nginx writes a request's line once the response is sent, which can be a moment after
        the client has read it: the log is read until it has not grown for ``settle_s``.
        """
        lines = self._lines()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            again = self._lines()
            if len(again) == len(lines):
                break
            lines = again
        out = []
        for line in lines[self._mark if since_mark else 0:]:
            method, path, rng, status, nbytes, seconds = line.split("\t")
            out.append(AccessLogEntry(method, path, None if rng in ("", "-") else rng,
                                      int(status), int(nbytes), float(seconds)))
        return out

    def mark(self) -> None:
        """Count requests from now on (:meth:`requests` returns those after the mark)."""
        self._mark = len(self.requests(since_mark=False))
