"""Run a function on N real torch.distributed ranks (gloo, CPU processes) and collect results."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

from ckptlab.errors import InvalidArgumentError, RankError

__all__ = ["RankError", "free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int,
               args: tuple[Any, ...], results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
    except BaseException:  # report first: tearing the group down makes the others fail too
        results.put((rank, False, traceback.format_exc()))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            raise SystemExit(1) from None
    results.put((rank, True, value))
    dist.destroy_process_group()


_ECHOES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks, one process each.

    Each process is started with ``spawn`` (so ``fn`` and ``args`` must be picklable:
    module-level functions), gets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, an
    initialized gloo process group, and returns ``fn``'s value to the caller.

    Returns
    -------
    list
        Each rank's return value, by rank.

    Raises
    ------
    RankError
        If a rank raised (its traceback is in ``failures``), died (exit code), or the ranks
        did not finish within ``timeout`` seconds; the other ranks are terminated.
    """
    import time

    import torch.multiprocessing as mp

    if type(world_size) is not int or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in values and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                if dead:
                    deadline = min(deadline, time.monotonic() + 5.0)
                if time.monotonic() > deadline:
                    for r in range(world_size):
                        if r not in values and r not in failures:
                            failures[r] = (f"rank {r} did not finish (timeout {timeout:.0f} s, "
                                           "or stuck after another rank failed)")
                    break
                continue
            (values if ok else failures)[rank] = value
            if not ok:  # the others may now wait forever in a collective: a short grace
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
    if failures:
        # the first to report that is not a peer's broken connection: the cause, not an echo
        first = next((r for r, text in failures.items()
                      if not any(e in text for e in _ECHOES)), next(iter(failures)))
        raise RankError(f"{len(failures)} of {world_size} ranks failed; first rank {first}: "
                        f"{failures[first].strip().splitlines()[-1]}", failures)
    return [values[r] for r in range(world_size)]
