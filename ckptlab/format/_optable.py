"""Pickle opcodes as data, and walks that read a pickle without running it.

From :mod:`pickletools`' opcode table (its data only): :data:`OPCODE_ARGUMENTS`, how each
opcode's argument is laid out, and :data:`OPCODE_NAMES`, each opcode's name and the protocol
that introduced it. Two walks follow the argument lengths alone, decoding no value and making
no object:

- :func:`opcode_spans`, where each opcode is (the safety scan reports calls at them; file-kind
  detection names a pickle's first opcodes);
- :func:`memo_reads`, the memo indices the pickle's GETs read, found before the interpreter
  runs (:mod:`ckptlab.format._opcodes` holds None for every other entry).

The legacy format's ``pickle_end`` (:mod:`ckptlab.checkpoint._legacy`) walks the same table to
find where each of its pickles ends.
"""

from __future__ import annotations

import struct
from typing import Any

from ckptlab.format._unpickle import _MAX_TEXT_LINE

__all__ = ["LENGTH_NBYTES", "LINE", "OPCODE_ARGUMENTS", "OPCODE_NAMES", "memo_reads",
           "opcode_spans"]

_unpack_I = struct.Struct("<I").unpack_from


# How each opcode's argument is laid out, from pickletools' opcode table (data only):
# opcode -> (kind, count): kind > 0 fixed bytes; LINE text lines (count 1, or 2 for
# GLOBAL/INST); a length prefix (LENGTH_NBYTES: -2 one byte, -3 four signed, -4 four, -5
# eight); 0 no argument. The one table for walking opcodes without interpreting them
# (memo_reads and opcode_spans here, the legacy format's pickle_end).
LINE = -1  # pickletools' UP_TO_NEWLINE
LENGTH_NBYTES = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}


def _opcode_table() -> dict[int, tuple[int, int]]:
    import pickletools

    table = {}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        if op.arg is None:
            table[code] = (0, 0)
        elif op.arg.n == LINE:
            table[code] = (LINE, 2 if op.arg.name == "stringnl_noescape_pair" else 1)
        else:
            table[code] = (op.arg.n, 0)
    return table


OPCODE_ARGUMENTS = _opcode_table()


def _opcode_names() -> dict[int, tuple[str, int]]:
    import pickletools

    return {op.code.encode("latin-1")[0]: (op.name, op.proto) for op in pickletools.opcodes}


# opcode -> (its name, the protocol that introduced it), from the same table
OPCODE_NAMES = _opcode_names()


def opcode_spans(data: Any, start: int = 0) -> Any:
    """The opcodes of the pickle at ``start`` walked by their argument lengths alone
    (:data:`OPCODE_ARGUMENTS`; nothing decoded or run): ``(offset, code)`` each, up to and
    including the first STOP. Ends early where ``data`` ends inside an opcode; raises
    ValueError at an unknown opcode or a negative length."""
    n = len(data)
    pos = start
    while pos < n:
        at, code = pos, data[pos]
        spec = OPCODE_ARGUMENTS.get(code)
        if spec is None:
            raise ValueError(f"unknown opcode {code:#04x} at {at}")
        kind, count = spec
        pos += 1
        if kind == LINE:
            for _ in range(count):
                newline = bytes(data[pos:pos + _MAX_TEXT_LINE]).find(b"\n")
                if newline < 0:
                    return
                pos += newline + 1
        elif kind in LENGTH_NBYTES:
            width, signed = LENGTH_NBYTES[kind]
            if pos + width > n:
                return
            length = int.from_bytes(bytes(data[pos:pos + width]), "little", signed=signed)
            if length < 0:
                raise ValueError(f"negative length at {at}")
            pos += width + length
        else:
            pos += kind
        if pos > n:
            return
        yield at, code
        if code == 0x2E:  # STOP
            return


def memo_reads(data: Any) -> set[int] | None:
    """The memo indices the pickle can read, found before it runs: the arguments of every
    BINGET and LONG_BINGET up to the first STOP.

    A memo entry no GET reads is stored as None (and charged as before): what only the
    pickler memoized (a tensor's argument tuple, a persistent id) is freed once used, instead
    of living, and being walked by the cyclic collector, until the end. None (keep every
    entry) where the scan cannot follow the pickle: a protocol-0 GET (its text is the loop's
    to parse), an unknown opcode, an argument past the end, no STOP.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    n = len(data)
    pos = 0
    reads: set[int] = set()
    while pos < n:
        code = data[pos]
        pos += 1
        if code == 0x2E:  # STOP
            return reads
        if code == 0x68:  # BINGET
            if pos >= n:
                return None
            reads.add(data[pos])
            pos += 1
            continue
        if code == 0x6A:  # LONG_BINGET
            if pos + 4 > n:
                return None
            reads.add(_unpack_I(data, pos)[0])
            pos += 4
            continue
        kind, count = OPCODE_ARGUMENTS.get(code, (None, 0))
        if kind is None or code == 0x67:  # an unknown opcode, or a GET (its text: the loop's)
            return None
        if kind > 0:
            pos += kind
        elif kind == LINE:
            for _ in range(count):
                end = data.find(b"\n", pos)
                if end < 0:
                    return None
                pos = end + 1
        elif kind < 0:
            width, signed = LENGTH_NBYTES[kind]
            if pos + width > n:
                return None
            length = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            if length < 0:
                return None
            pos += width + length
        if pos > n:
            return None
    return None
