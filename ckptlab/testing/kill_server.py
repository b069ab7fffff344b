"""A fork server for kill -9 tests of :class:`ckptlab.write.AsyncWriter`.

``python -m ckptlab.testing.kill_server PATH`` imports torch once, then forks one child per
save into ``PATH``, so that many killed saves cost forks, not torch imports. Each child stops
itself with SIGKILL at a chosen step of its save (:func:`save_and_note`): the step, not a
moment in time, so which phase of the save each kill lands in is the same on every host.

stdin commands, one per line; each answer is one line on stdout:
``save SEED PHASE_PATH DIE_AT`` -> the child's pid; ``reap PID`` -> its wait status;
``quit``. ``DIE_AT`` is ``-`` (run to the end), ``plan`` (before ``dcp.save`` is called) or
``PHASE:J``: on entering the J-th (from 1) I/O step of that phase, before its I/O. The phases
are the writer's ``io_hook`` ones: ``open``, ``write``, ``fsync`` (on the workers), ``commit``
(before ``.metadata.tmp`` is written), ``rename`` (after it is written and synced, before the
rename) and ``remove`` (each old data file, after the rename).
"""

from __future__ import annotations

from typing import Any

__all__ = ["kill_state", "save_and_note", "serve_saves"]


def kill_state(seed: int) -> dict[str, Any]:
    """The small state dict the kill -9 test saves: the same structure for every seed,
    different bytes (float32, bfloat16, int64, a 0-d tensor and a plain int)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=g),
            "b": torch.randn(300, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (129,), generator=g),
            "scale": torch.randn((), generator=g),
            "optim": {"m": torch.randn(33, 7, generator=g)},
            "step": seed}


def save_and_note(writer: Any, seed: int, phase_path: str, die_at: str = "-") -> None:
    """Save kill_state(seed) with ``writer``, writing each step it enters to ``phase_path``
    (one line each: ``plan``, then the phase of every ``io_hook`` call, then ``done``), and
    SIGKILL this process on entering step ``die_at`` (see the module docstring). Meant for a
    forked child (:func:`serve_saves`): the kill takes the whole process, the writer's worker
    threads with it, wherever they are."""
    import os
    import signal
    import threading

    import torch.distributed.checkpoint as dcp

    fd = os.open(phase_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    die_phase, _, nth = die_at.partition(":")
    die_nth = int(nth) if nth else 1
    seen: dict[str, int] = {}
    lock = threading.Lock()  # the workers call the hook from two threads

    def enter(phase: str) -> None:
        with lock:
            os.write(fd, phase.encode() + b"\n")
            seen[phase] = count = seen.get(phase, 0) + 1
            if phase == die_phase and count == die_nth:
                os.kill(os.getpid(), signal.SIGKILL)

    def hook(bucket: Any, phase: str, file: Any, offset: int, nbytes: int) -> None:
        enter(phase)

    enter("plan")
    writer.io_hook = hook
    dcp.save(kill_state(seed), storage_writer=writer, no_dist=True)
    writer.wait()
    os.write(fd, b"done\n")


def serve_saves(path: str) -> None:
    """The fork server (module docstring).

    It holds an AsyncWriter for ``path`` whose staging memory is reserved and whose blob
    templates are built (no worker thread runs before a fork: the pool starts on the first
    save, in the child), so a child spends its time saving, not faulting in 64 MiB.
    """
    import os
    import sys
    import traceback
    import warnings

    import torch

    torch.set_num_threads(1)  # no thread pool in the parent before fork
    # imported once, before fork (torch.distributed.checkpoint uses torch itself)
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.default_planner
    import torch.distributed.checkpoint.filesystem

    from ckptlab.write import AsyncWriter

    warnings.simplefilter("ignore")
    writer = AsyncWriter(path, workers=2)
    writer.reserve(1 << 20)
    for t in (kill_state(0)[k] for k in ("w", "b", "ids", "scale")):
        writer._res.templates.get(t.dtype, tuple(t.shape))
    m = kill_state(0)["optim"]["m"]
    writer._res.templates.get(m.dtype, tuple(m.shape))
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "save":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    save_and_note(writer, int(cmd[1]), cmd[2], cmd[3])
                except BaseException:
                    traceback.print_exc()
                    code = 1
                os._exit(code)  # no atexit, no flush of the parent's buffers
            print(pid, flush=True)
        elif cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            print(status, flush=True)


if __name__ == "__main__":
    import sys

    serve_saves(sys.argv[1])
