"""Helpers for the real-browser tests: find chromium, serve a local process, guard the network.

Import them in a test module under tests/browser/ with ``from browser_support import ...``
(pytest puts this folder on sys.path; the tests folders have no ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]

# Debian's package; `playwright install` is never run (no browser download).
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
CHROMIUM_MISSING = (
    "Debian chromium is not installed: the browser tests need it at /usr/bin/chromium "
    "(`make test` installs it; by hand: `sudo apt-get install --no-install-recommends "
    "chromium`, or point CKPTLAB_CHROMIUM at a chromium binary)"
)
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def chromium_executable() -> str | None:
    """$CKPTLAB_CHROMIUM if set, else Debian's /usr/bin/chromium, else chromium on PATH."""
    override = os.environ.get("CKPTLAB_CHROMIUM")
    if override:
        return shutil.which(override)
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def is_external_url(url: str) -> bool:
    """True for network URLs (http, https, ws, wss) to any host but this machine's loopback."""
    parts = urlsplit(url)
    return parts.scheme in {"http", "https", "ws", "wss"} and parts.hostname not in LOCAL_HOSTS


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ServedProcess:
    """A process started by `serve_process`; its stdout and stderr go to `log_path`."""

    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self, tail: int | None = None) -> str:
        """The process's stdout + stderr so far (the last `tail` characters if given)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-tail:] if tail else text


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group, wait `grace` s, then SIGKILL the group and any descendant
    that left it (jupyter starts kernels in sessions of their own)."""
    children = _descendants(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def serve_process(
    cmd: Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 60.0,
    grace: float = 10.0,
) -> Iterator[ServedProcess]:
    """Start `cmd` in a new process group and yield once `host:port` accepts TCP connections.

    Raises RuntimeError if the process exits first and TimeoutError after `timeout` seconds,
    both with the end of the process's output. On exit the whole group is stopped (SIGTERM,
    `grace` seconds, SIGKILL). The output is kept in a temp file, never a pipe, so a chatty
    server cannot block on a full pipe.
    """
    log_dir = Path(tempfile.mkdtemp(prefix="ckptlab-serve-"))
    log_path = log_dir / "output.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
        )
    served = ServedProcess(proc=proc, host=host, port=port, log_path=log_path)
    try:
        deadline = time.monotonic() + timeout
        while not _port_open(host, port):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{cmd[0]} exited with status {proc.returncode} before {host}:{port} "
                    f"accepted connections; its output ends:\n{served.output(4000)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{host}:{port} accepted no connection within {timeout:.0f} s of starting "
                    f"{' '.join(map(str, cmd))}; its output ends:\n{served.output(4000)}"
                )
            time.sleep(0.1)
        yield served
    finally:
        _stop(proc, grace)
        shutil.rmtree(log_dir, ignore_errors=True)


def wait_for_workbench(url: str, timeout: float = 120.0) -> None:
    """Wait until ``ckptlab serve`` at ``url`` answers ``/`` with the panel workbench (it
    answers the quick page first: ckptlab.widgets.quick), for clients that are no browser
    (a browser's quick page reloads itself into the workbench)."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ckptlab/quick/state", timeout=10) as r:
                state = json.load(r)
        except OSError:
            state = {}
        if state.get("workbench"):
            return
        if state.get("error") or state.get("workbench_error") or time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become the workbench: {state}")
        time.sleep(0.1)


@dataclass
class PageLog:
    """What a `page` did that a test may want to assert on.

    blocked_urls: requests (and websockets) to hosts other than 127.0.0.1/localhost, which
    the page's context aborted. console_errors: console.error messages. page_errors:
    uncaught exceptions in the page.
    """

    blocked_urls: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def assert_offline(self, allowed: Iterable[str] = ()) -> None:
        """Fail if the page tried to reach the network, except URLs containing an `allowed` part."""
        allowed = tuple(allowed)
        unexpected = [u for u in self.blocked_urls if not any(a in u for a in allowed)]
        assert not unexpected, f"the page tried to reach the network: {unexpected}"

    def assert_no_errors(self, ignore: Iterable[str] = ()) -> None:
        """Fail on uncaught page exceptions and console errors, except those containing an
        `ignore` part. Blocked requests log "net::ERR_BLOCKED_BY_CLIENT" console errors; check
        those with `assert_offline` instead."""
        ignore = (*tuple(ignore), "net::ERR_BLOCKED_BY_CLIENT")
        errors = [e for e in self.page_errors + self.console_errors
                  if not any(i in e for i in ignore)]
        assert not errors, f"errors in the page: {errors}"

    def summary(self) -> str:
        def block(title: str, items: list[str]) -> str:
            return f"{title} ({len(items)}):\n" + "".join(f"  {i}\n" for i in items)

        return (block("blocked URLs", self.blocked_urls)
                + block("console errors", self.console_errors)
                + block("page errors", self.page_errors))


def open_offline_page(browser, log: PageLog, *, width: int = 1280, height: int = 900,
                      timeout_ms: int = 30_000):
    """A page in a fresh context of `browser` that, like conftest's `page` fixture, aborts
    and records (in `log`) every request to a host but this machine's loopback, and records
    console errors and page exceptions. For pages that several tests share (a module-scoped
    fixture); close it with ``page.context.close()``."""
    context = browser.new_context(viewport={"width": width, "height": height},
                                  service_workers="block")
    context.set_default_timeout(timeout_ms)

    def block(route) -> None:
        log.blocked_urls.append(route.request.url)
        route.abort("blockedbyclient")

    def block_websocket(ws) -> None:
        log.blocked_urls.append(ws.url)
        ws.close()

    context.route(is_external_url, block)
    context.route_web_socket(is_external_url, block_websocket)
    page = context.new_page()
    page.on("console", lambda msg: msg.type == "error" and log.console_errors.append(
        f"{msg.text} @ {msg.location.get('url', '')}:{msg.location.get('lineNumber', '')}"))
    page.on("pageerror", lambda exc: log.page_errors.append(str(exc)))
    return page
