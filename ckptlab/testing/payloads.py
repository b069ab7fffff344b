"""Pickles that run code when loaded, one of each shape scanners are tested with, built here.

Every payload writes the file ``sentinel`` when the standard unpickler runs it (nothing else:
no network, no deletion), so a test proves it live by loading it in a subprocess
(:mod:`ckptlab.testing.torch_oracle`) and finding the file. Only tests import this module.

:func:`payloads` gives ``{name: pickle bytes}`` for one sentinel; :func:`carriers` puts a
pickle into the files that hold one (a plain pickle, a torch.save zip's ``data.pkl``, a legacy
torch.save file's first or third pickle, a nested ``_load_from_bytes``, a NumPy object array).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
from typing import Any

__all__ = ["Reduce", "carriers", "payloads", "raw"]


class Reduce:
    """An object that pickles as ``func(*args)``."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data if len(data) < 256 else \
        b"X" + struct.pack("<I", len(data)) + data


def raw(sentinel: str) -> dict[str, bytes]:
    """Payloads written opcode by opcode: the shapes a pickler never writes."""
    touch = f"touch {sentinel}"
    text = touch.encode()
    p0 = text.replace(b"\\", b"\\\\").replace(b"'", b"\\'")
    return {
        # getattr(__import__('os'), 'system')('touch ...'): a call of a call's result
        "getattr-chain": (b"\x80\x02cbuiltins\ngetattr\n(cbuiltins\n__import__\n(X"
                          + struct.pack("<I", 2) + b"ostRX" + struct.pack("<I", 6)
                          + b"systemtR(X" + struct.pack("<I", len(text)) + text + b"tR."),
        # STACK_GLOBAL of a dotted name: protocol 4 resolves it with getattr
        "dotted-stack-global": (b"\x80\x04" + _short("torch") + _short("serialization.os.system")
                                + b"\x93" + _short(touch) + b"\x85R."),
        # the module and name reach STACK_GLOBAL through the memo
        "memo-stack-global": (b"\x80\x04" + _short("os") + b"\x94" + _short("system") + b"\x94"
                              + b"0h\x00h\x01\x93" + _short(touch) + b"\x85R."),
        # protocol 0 INST and OBJ
        "inst": b"(S'" + p0 + b"'\nios\nsystem\n.",
        "obj": b"(cos\nsystem\nS'" + p0 + b"'\no.",
        # a legitimate-looking dict with the call hidden in a value, then dropped (POP)
        "popped-call": (b"\x80\x02}cos\nsystem\n(X" + struct.pack("<I", len(text)) + text
                        + b"tR0."),
        # the call's result, called again: functools.partial(os.system, cmd)()
        "partial-called": (b"\x80\x02cfunctools\npartial\ncos\nsystem\nX"
                           + struct.pack("<I", len(text)) + text + b"\x86R)R."),
    }


def payloads(sentinel: str, workdir: str) -> dict[str, bytes]:
    """``{name: pickle}``: each writes ``sentinel`` when unpickled (``workdir``: where a
    payload may put a helper file)."""
    script = f"{sentinel}.py"  # (its own: it names this sentinel)
    with open(script, "w") as f:
        f.write(f"open({sentinel!r}, 'w').close()\n")
    stmt = f"open({sentinel!r}, 'w').close()"
    import cProfile
    import runpy
    import shutil
    import timeit

    out: dict[str, bytes] = {}
    shapes = {
        "os.system": Reduce(os.system, (f"touch {sentinel}",)),
        "exec": Reduce(exec, (stmt,)),
        "eval": Reduce(eval, (stmt,)),
        "open": Reduce(open, (sentinel, "w")),
        "subprocess.call": Reduce(subprocess.call, (["touch", sentinel],)),
        "subprocess.check_output": Reduce(subprocess.check_output, (["touch", sentinel],)),
        "timeit": Reduce(timeit.timeit, (stmt, "pass", timeit.default_timer, 1)),
        "cProfile.run": Reduce(cProfile.run, (stmt,)),
        "runpy.run_path": Reduce(runpy.run_path, (script,)),
        "shutil.copyfile": Reduce(shutil.copyfile, (script, sentinel)),
        "pickle.loads": Reduce(pickle.loads, (pickle.dumps(Reduce(exec, (stmt,))),)),
    }
    for name, obj in shapes.items():
        for protocol in (0, 2, 4):
            out[f"{name}-p{protocol}"] = pickle.dumps({"weights": [1.0], "x": obj},
                                                      protocol=protocol)
    for name, data in raw(sentinel).items():
        out[name] = data
    return out


def _legacy_with(first: bytes | None = None, third: bytes | None = None) -> bytes:
    """A legacy torch.save file whose first (magic) or third (system info) pickle is replaced."""
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    from ckptlab.checkpoint._legacy import pickle_end
    from ckptlab.source import ByteSource

    src = ByteSource(data)
    ends = [0]
    for what in ("magic", "protocol", "sys_info"):
        ends.append(pickle_end(src, ends[-1], what=what))
    parts = [data[ends[0]:ends[1]], data[ends[1]:ends[2]], data[ends[2]:ends[3]]]
    if first is not None:
        parts[0] = first
    if third is not None:
        parts[2] = third
    return b"".join(parts) + data[ends[3]:]


def carriers(pkl: bytes) -> dict[str, tuple[str, bytes]]:
    """``{carrier: (suffix, file bytes)}``: the files that would run ``pkl`` when loaded."""
    import numpy as np
    import torch

    from ckptlab.testing.pickles import torch_zip

    buf = io.BytesIO()
    from ckptlab._torch_compat import load_from_bytes

    torch.save(Reduce(load_from_bytes(), (pkl,)), buf)
    arr = np.empty(2, dtype=object)
    npy = io.BytesIO()
    # an object array whose pickle is the payload's: numpy.load(allow_pickle=True) runs it
    np.save(npy, arr, allow_pickle=True)
    head = npy.getvalue()
    header_end = head.index(b"\n") + 1
    return {
        "plain": (".pkl", pkl),
        "zip": (".pt", torch_zip(pkl)),
        "legacy-first": (".pt", _legacy_with(first=pkl)),
        "legacy-third": (".pt", _legacy_with(third=pkl)),
        "nested-bytes": (".pt", buf.getvalue()),
        "npy": (".npy", head[:header_end] + pkl),
    }


if __name__ == "__main__":  # pragma: no cover - a manual check
    print(sorted(payloads(sys.argv[1], os.path.dirname(sys.argv[1]))))
