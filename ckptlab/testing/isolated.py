"""Run ckptlab readers on hostile inputs in a child process with a memory limit and a timeout.

A hostile file may crash the interpreter (a C recursion), hang a reader or allocate without
bound; a test must see that as a result, not die with it. :class:`IsolatedReader` keeps one
worker process (``python -m ckptlab.testing.isolated``) and sends it cases one at a time:

- the worker imports what the readers need first, then limits its address space
  (``RLIMIT_AS``) to what it uses after those imports plus the case's budget, so a reader that
  allocates past the budget gets a ``MemoryError`` (and a C-level failure kills only the
  worker);
- before each case the worker resets its peak resident size (``/proc/self/clear_refs``); the
  reply carries the outcome (``ok``, or the error's type and message), the peak resident
  bytes the case added (``VmHWM`` after minus ``VmRSS`` before: real memory, C allocations
  included) and the seconds it took;
- a case that takes longer than its timeout, or a worker that dies (a signal), is reported as
  such and the worker is restarted for the next case.

Readers (the ``reader`` argument): ``inspect`` (:func:`ckptlab.inspect`), ``scan_pickle`` (a
torch pickle), ``metadata`` (DCP ``.metadata`` bytes), ``open`` (:func:`ckptlab.open`) and
``scan`` (:func:`ckptlab.scan`, its report made into JSON).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["IsolatedReader", "Outcome"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one case did in the worker."""

    status: str  # "ok", "error" (an exception was raised), "timeout", "signal"
    error_type: str | None = None  # class name of the exception
    error_module: str | None = None  # its module ("ckptlab.errors" for ckptlab's own)
    message: str = ""
    peak_nbytes: int = 0  # peak resident bytes the case added to the worker
    seconds: float = 0.0
    returncode: int | None = None  # the worker's, when it died

    @property
    def is_ckptlab_error(self) -> bool:
        return self.status == "error" and (self.error_module or "").startswith("ckptlab.")

    @property
    def clean(self) -> bool:
        """A correct result or a ckptlab error: what every hostile input must give."""
        return self.status == "ok" or self.is_ckptlab_error


class IsolatedReader:
    """One worker process reading cases; see the module docstring.

    Parameters
    ----------
    budget_nbytes
        Address space the worker may add on top of what it uses after its imports.
    timeout_s
        Seconds one case may take.
    """

    def __init__(self, budget_nbytes: int = 1 << 30, timeout_s: float = 30.0) -> None:
        self.budget_nbytes = budget_nbytes
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="ckptlab-isolated-")

    def __enter__(self) -> IsolatedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop()
        self._dir.cleanup()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ckptlab.testing.isolated", str(self.budget_nbytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1)
            ready = self._reply(self._proc, 120.0)
            if ready is None or ready.get("ready") is not True:
                raise RuntimeError(f"the isolated worker did not start: {ready}")
        return self._proc

    @staticmethod
    def _reply(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any] | None:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = proc.stdout.readline()
        return json.loads(line) if line else {}

    def run(self, reader: str, data: bytes | None = None, *, path: str | os.PathLike[str]
            | None = None, name: str = "case.bin") -> Outcome:
        """Run ``reader`` on ``data`` (written to a fresh file named ``name``) or on ``path``."""
        if path is None:
            case_dir = Path(tempfile.mkdtemp(dir=self._dir.name))
            target = case_dir / name
            target.write_bytes(data or b"")
            path = target
        proc = self._start()
        assert proc.stdin is not None
        start = time.perf_counter()
        try:
            proc.stdin.write(json.dumps({"reader": reader, "path": os.fspath(path)}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        reply = self._reply(proc, self.timeout_s)
        if reply is None:
            self._stop()
            return Outcome("timeout", seconds=time.perf_counter() - start)
        if not reply:  # EOF: the worker died during the case
            code = proc.wait()
            self._proc = None
            return Outcome("signal" if code < 0 else "error", returncode=code,
                           error_type="WorkerDied", seconds=time.perf_counter() - start)
        return Outcome(**reply)


def _worker(budget_nbytes: int) -> None:  # pragma: no cover - runs in the child
    import resource

    import torch.distributed.checkpoint.filesystem
    import torch.distributed.checkpoint.metadata  # noqa: F401

    import ckptlab
    import ckptlab.dcp
    import ckptlab.format._pickle as pickle_scan
    from ckptlab.dcp._decode import decode_metadata

    readers = {
        "inspect": lambda p: ckptlab.inspect(p),
        "open": lambda p: ckptlab.open(p).tensors,
        "scan_pickle": lambda p: pickle_scan.scan_pickle(Path(p).read_bytes(), path=p),
        "metadata": lambda p: decode_metadata(Path(p).read_bytes()),
        "scan": lambda p: ckptlab.scan(p).to_dict(),
    }
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    vm = status("VmSize:")
    resource.setrlimit(resource.RLIMIT_AS, (vm + budget_nbytes, vm + budget_nbytes))
    sys.setrecursionlimit(10_000)  # deep enough that a C recursion would show up as a crash
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        case = json.loads(line)
        reset_peak()
        rss = status("VmRSS:")
        start = time.perf_counter()
        reply: dict[str, Any]
        try:
            readers[case["reader"]](case["path"])
            reply = {"status": "ok"}
        except BaseException as exc:  # every outcome is data here
            reply = {"status": "error", "error_type": type(exc).__name__,
                     "error_module": type(exc).__module__,
                     "message": str(exc)[:500].encode("utf-8", "backslashreplace").decode()}
        reply["seconds"] = time.perf_counter() - start
        reply["peak_nbytes"] = max(0, status("VmHWM:") - rss)
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":  # pragma: no cover
    _worker(int(sys.argv[1]))
