"""The loaders themselves, run on files in a subprocess: what ``ckptlab.scan`` is held to.

``python -m ckptlab.testing.torch_oracle MODE`` reads ``[[path, loader], ...]`` as JSON on
stdin and prints a JSON line per file: ``{"path", "ok", "error"}``. ``MODE`` is ``safe``
(``torch.load(weights_only=True)``: what ``weights_only.accepted`` must equal) or ``unsafe``
(each file's real loader without restriction: payloads run, and leave their sentinel files).
``loader`` is ``torch``, ``numpy`` (``numpy.load(allow_pickle=True)``, every array of an
``.npz``) or ``dcp`` (a DCP directory's ``FileSystemReader.read_metadata``).

:func:`run_oracle` runs it from a test: a fresh interpreter in an empty working directory,
with a timeout, restarted past a file that kills it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Any

__all__ = ["run_oracle"]


def _load(path: str, loader: str, mode: str) -> None:
    if mode == "safe" or loader == "torch":
        import torch

        torch.load(path, weights_only=mode == "safe", map_location="cpu")
    elif loader == "numpy":
        import numpy as np

        loaded = np.load(path, allow_pickle=True)
        if hasattr(loaded, "files"):
            for name in loaded.files:
                loaded[name]
    elif loader == "dcp":
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader(path).read_metadata()
    else:
        raise ValueError(loader)


def main(mode: str) -> None:
    warnings.simplefilter("ignore")
    for path, loader in json.load(sys.stdin):
        try:
            _load(path, loader, mode)
        except BaseException as exc:  # every outcome is an answer
            print(json.dumps({"path": path, "ok": False,
                              "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
        else:
            print(json.dumps({"path": path, "ok": True, "error": None}), flush=True)


def run_oracle(files: list[tuple[str, str]], mode: str, *, cwd: str,
               timeout_s: float = 600) -> dict[str, dict[str, Any]]:
    """``{path: {"ok", "error"}}`` for each ``(path, loader)``, from a subprocess."""
    out: dict[str, dict[str, Any]] = {}
    todo = list(files)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path),
           "HOME": cwd}
    while todo:
        proc = subprocess.run([sys.executable, "-m", "ckptlab.testing.torch_oracle", mode],
                              input=json.dumps(todo), capture_output=True, text=True,
                              cwd=cwd, env=env, timeout=timeout_s, check=False)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[row["path"]] = row
        todo = [f for f in todo if f[0] not in out]
        if todo:  # the first one not answered killed the interpreter: that is its answer
            out[todo[0][0]] = {"path": todo[0][0], "ok": False,
                               "error": f"the loader died (exit {proc.returncode})"}
            todo = todo[1:]
    return out


if __name__ == "__main__":
    main(sys.argv[1])
