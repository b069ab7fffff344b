"""The opcode loop of ckptlab's pickle interpreter: a pickle's bytes read one opcode at a time.

:func:`ckptlab.format._unpickle.interpret` runs a :class:`_Machine` over a pickle's bytes. The
machine reads each opcode and its argument (protocols 0-5), checks every declared length
against the bytes left before it reads them, and keeps the stack and the metastack of MARKs;
what an opcode makes or changes (a global, a call, the memo, a dict, list or set, a BUILD) goes
through the rules it is made of, :class:`ckptlab.format._unpickle._Rules`, which keep that
module's guarantees (nothing imported or run, memory bounded by the input, nothing deep hashed).
An error of the loop becomes a :class:`~ckptlab.errors.PickleDataError` at the offset of the
opcode that raised it.

:meth:`_Machine.run` handles the opcodes torch pickles are mostly made of first and inline,
with the budget in a local; every other opcode is one branch of :meth:`_Machine.rare`.
:mod:`ckptlab.format._interp` is the same loop in C.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable
from typing import Any

from ckptlab.errors import PickleDataError
from ckptlab.format._optable import memo_reads
from ckptlab.format._unpickle import (
    _ERRORS,
    _MAX_TEXT_LINE,
    MAX_INT_NBYTES,
    Handler,
    Interpretation,
    _position,
    _Rules,
)

_unpack_i = struct.Struct("<i").unpack_from
_unpack_I = struct.Struct("<I").unpack_from
_unpack_H = struct.Struct("<H").unpack_from
_unpack_Q = struct.Struct("<Q").unpack_from
_unpack_d = struct.Struct(">d").unpack_from


def _pop_mark(stack: list[Any], metastack: list[list[Any]], code: int
              ) -> tuple[list[Any], list[Any]]:
    """The items since the last MARK, and the stack below it."""
    if not metastack:
        raise PickleDataError(f"opcode {code:#04x} without a MARK")
    return stack, metastack.pop()


def _need(stack: list[Any], k: int, code: int) -> None:
    if len(stack) < k:
        raise PickleDataError(f"opcode {code:#04x} needs {k} items on the stack, "
                              f"found {len(stack)}")


class _Machine(_Rules):
    """One interpretation: the bytes, the position in them and the protocol, over the state
    and rules of :class:`~ckptlab.format._unpickle._Rules`."""

    __slots__ = ("data", "pos", "proto")

    def __init__(self, data: Any, handlers: dict[tuple[str, str], Handler],
                 persistent: Callable[[Any], Any] | None,
                 build: Callable[[Any, Any], None] | None,
                 budget: int) -> None:
        super().__init__(len(data), handlers, persistent, build, budget, memo_reads(data))
        self.data = data
        self.pos = 0
        self.proto = 0

    # -- reading the bytes --------------------------------------------------------------
    def take(self, nbytes: int, what: str) -> Any:
        start = self.pos
        end = start + nbytes
        if nbytes < 0 or end > self.n:
            raise PickleDataError(
                f"{what} declares {nbytes:,} bytes but only {self.n - start:,} are left")
        self.pos = end
        return self.data[start:end]

    def line(self, what: str) -> str:
        data, start = self.data, self.pos
        limit = min(self.n, start + _MAX_TEXT_LINE)
        end = bytes(data[start:limit]).find(b"\n")
        if end < 0:
            raise PickleDataError(f"{what}: no newline within {_MAX_TEXT_LINE} bytes")
        self.pos = start + end + 1
        return bytes(data[start:start + end]).decode("latin-1")

    def int_from_bytes(self, raw: Any) -> int:
        if len(raw) > MAX_INT_NBYTES:
            raise PickleDataError(f"an int of {len(raw):,} bytes (at most {MAX_INT_NBYTES})")
        self.charge(64 + len(raw))
        return int.from_bytes(raw, "little", signed=True)

    def text_int(self, text: str) -> int:
        text = text.strip().rstrip("L")
        if len(text) > 2 * MAX_INT_NBYTES:
            raise PickleDataError(f"an int of {len(text):,} digits")
        try:
            return int(text, 0) if text.startswith(("0x", "0X")) else int(text)
        except ValueError:
            raise PickleDataError(f"not an int: {text[:40]!r}") from None

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> Interpretation:
        data = self.data
        n = self.n
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        push = stack.append
        memo = self.memo
        reads = self.reads
        # the budget lives in a local in the loop; methods that charge get it through
        # self.budget (synced around their calls)
        budget = self.budget
        pos = 0
        op = 0
        try:
            while True:
                if pos >= n:
                    raise PickleDataError("the pickle ends without a STOP opcode")
                op = pos
                code = data[pos]
                pos += 1
                # the hot opcodes of torch pickles first (LONG_* once the memo passes 256)
                if code == 0x58:  # BINUNICODE
                    if pos + 4 > n:
                        raise PickleDataError("BINUNICODE without its length")
                    (length,) = _unpack_I(data, pos)
                    pos += 4
                    if pos + length > n:
                        raise PickleDataError(
                            f"BINUNICODE declares {length:,} bytes but only {n - pos:,} are left")
                    text = str(data[pos:pos + length], "utf-8", "surrogatepass")
                    push(text)
                    pos += length
                    budget -= 96 + 4 * length
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x72 or code == 0x71:  # LONG_BINPUT / BINPUT
                    if code == 0x71:
                        if pos >= n:
                            raise PickleDataError("BINPUT without its index")
                        idx = data[pos]
                        pos += 1
                        if not stack:
                            raise PickleDataError("BINPUT with an empty stack")
                    else:
                        if pos + 4 > n:
                            raise PickleDataError("LONG_BINPUT without its index")
                        (idx,) = _unpack_I(data, pos)
                        pos += 4
                        if not stack:
                            raise PickleDataError("LONG_BINPUT with an empty stack")
                    if idx == len(memo):
                        memo.append(stack[-1] if reads is None or idx in reads else None)
                        budget -= 16
                        if budget < 0:
                            raise self.over_budget()
                    else:
                        self.budget = budget
                        self.memo_put(idx, stack[-1])
                        budget = self.budget
                    continue
                if code == 0x6A or code == 0x68:  # LONG_BINGET / BINGET
                    if code == 0x68:
                        if pos >= n:
                            raise PickleDataError("BINGET without its index")
                        idx = data[pos]
                        pos += 1
                    else:
                        if pos + 4 > n:
                            raise PickleDataError("LONG_BINGET without its index")
                        (idx,) = _unpack_I(data, pos)
                        pos += 4
                    value = memo[idx] if idx < len(memo) else self.memo_get(idx)
                    push(value)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4B:  # BININT1
                    if pos >= n:
                        raise PickleDataError("BININT1 without its value")
                    push(data[pos])
                    pos += 1
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                    push = stack.append
                    budget -= 88
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x74:  # TUPLE
                    if not metastack:
                        raise PickleDataError("TUPLE without a MARK")
                    items = tuple(stack)
                    stack = metastack.pop()
                    push = stack.append
                    push(items)
                    budget -= 72 + 8 * len(items)
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x85 or code == 0x86 or code == 0x87:  # TUPLE1/2/3
                    k = code - 0x84
                    if len(stack) < k:
                        raise PickleDataError(f"TUPLE{k} with {len(stack)} items on the stack")
                    items = tuple(stack[-k:])
                    del stack[-k:]
                    push(items)
                    budget -= 72 + 8 * k
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x52:  # REDUCE
                    if len(stack) < 2:
                        raise PickleDataError("REDUCE with fewer than two items on the stack")
                    args = stack.pop()
                    self.budget = budget
                    stack[-1] = self.call(stack[-1], args)
                    budget = self.budget
                    continue
                if code == 0x51:  # BINPERSID
                    if not stack:
                        raise PickleDataError("BINPERSID with an empty stack")
                    if self.persistent is None:
                        raise PickleDataError("a persistent id where none is expected")
                    stack[-1] = self.persistent(stack[-1])
                    budget -= 160
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x89 or code == 0x88:  # NEWFALSE / NEWTRUE
                    push(code == 0x88)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x29:  # EMPTY_TUPLE
                    push(())
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x7D:  # EMPTY_DICT
                    push({})
                    budget -= 96
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x75:  # SETITEMS
                    if not metastack:
                        raise PickleDataError("SETITEMS without a MARK")
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    if not stack:
                        raise PickleDataError("SETITEMS with nothing to set items on")
                    self.budget = budget
                    self.setitems(stack[-1], items)
                    budget = self.budget
                    continue
                if code == 0x63:  # GLOBAL
                    self.pos = pos
                    module = self.line("GLOBAL module")
                    name = self.line("GLOBAL name")
                    pos = self.pos
                    self.budget = budget
                    push(self.global_(module, name, op))
                    budget = self.budget - 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x94:  # MEMOIZE
                    if not stack:
                        raise PickleDataError("MEMOIZE with an empty stack")
                    memo.append(stack[-1] if reads is None or len(memo) in reads else None)
                    budget -= 16
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4D:  # BININT2
                    if pos + 2 > n:
                        raise PickleDataError("BININT2 without its value")
                    push(_unpack_H(data, pos)[0])
                    pos += 2
                    budget -= 48
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x4A:  # BININT
                    if pos + 4 > n:
                        raise PickleDataError("BININT without its value")
                    push(_unpack_i(data, pos)[0])
                    pos += 4
                    budget -= 48
                    if budget < 0:
                        raise self.over_budget()
                    continue
                if code == 0x2E:  # STOP
                    if len(stack) != 1 or metastack:
                        raise PickleDataError(
                            f"STOP with {len(stack)} objects on the stack and "
                            f"{len(metastack)} open MARKs")
                    self.budget = budget
                    return Interpretation(stack[0], self.proto, self.seen_globals, pos,
                                          self.seen_at)
                # everything else, less frequent in checkpoints
                self.pos = pos
                self.budget = budget
                stack, push = self.rare(code, stack, metastack)
                pos = self.pos
                budget = self.budget
        except _ERRORS as exc:
            raise _position(op, exc) from None

    def rare(self, code: int, stack: list[Any], metastack: list[list[Any]]
             ) -> tuple[list[Any], Any]:
        op = self.pos - 1  # the opcode byte (a GLOBAL below is named at it)
        push = stack.append
        charge = self.charge
        take = self.take
        if code == 0x80:  # PROTO
            self.proto = take(1, "PROTO")[0]
            if self.proto > 5:
                raise PickleDataError(f"unsupported pickle protocol {self.proto}")
        elif code == 0x95:  # FRAME: a buffering hint; check the length and read straight on
            (length,) = _unpack_Q(take(8, "FRAME"))
            if length > self.n - self.pos:
                raise PickleDataError(f"FRAME of {length:,} bytes with "
                                      f"{self.n - self.pos:,} bytes left")
        elif code == 0x4E:  # NONE
            push(None)
            charge(16)
        elif code == 0x8C:  # SHORT_BINUNICODE
            length = take(1, "SHORT_BINUNICODE")[0]
            push(str(take(length, "SHORT_BINUNICODE"), "utf-8", "surrogatepass"))
            charge(96 + 4 * length)
        elif code == 0x8D:  # BINUNICODE8
            (length,) = _unpack_Q(take(8, "BINUNICODE8"))
            push(str(take(length, "BINUNICODE8"), "utf-8", "surrogatepass"))
            charge(96 + 4 * length)
        elif code in (0x42, 0x43, 0x8E, 0x96):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
            if code == 0x43:
                length = take(1, "SHORT_BINBYTES")[0]
            elif code == 0x42:
                (length,) = _unpack_I(take(4, "BINBYTES"))
            else:
                (length,) = _unpack_Q(take(8, "BINBYTES8"))
            raw = take(length, "bytes payload")
            push(bytearray(raw) if code == 0x96 else bytes(raw))
            charge(80 + length)
        elif code in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str)
            if code == 0x55:
                length = take(1, "SHORT_BINSTRING")[0]
            else:
                (length,) = _unpack_i(take(4, "BINSTRING"))
            raw = bytes(take(length, "BINSTRING"))
            push(raw.decode("utf-8", "surrogateescape"))
            charge(96 + 4 * length)
        elif code == 0x53:  # STRING (protocol 0, quoted)
            text = self.line("STRING").rstrip("\r")
            if len(text) < 2 or text[0] != text[-1] or text[0] not in "'\"":
                raise PickleDataError("STRING is not quoted")
            try:
                raw = codecs.escape_decode(text[1:-1].encode("latin-1"))[0]
            except (ValueError, DeprecationWarning):  # (the warning: when warnings are errors)
                raise PickleDataError("STRING with a bad escape") from None
            push(raw.decode("utf-8", "surrogateescape"))
            charge(96 + 4 * len(raw))
        elif code == 0x56:  # UNICODE (protocol 0)
            text = self.line("UNICODE")
            push(codecs.raw_unicode_escape_decode(text.encode("latin-1"))[0])
            charge(96 + 4 * len(text))
        elif code == 0x49:  # INT (protocol 0; also the old bools)
            text = self.line("INT").strip()
            push(True if text == "01" else False if text == "00" else self.text_int(text))
            charge(64 + len(text))
        elif code == 0x4C:  # LONG (protocol 0)
            text = self.line("LONG")
            push(self.text_int(text))
            charge(64 + len(text))
        elif code == 0x8A:  # LONG1
            length = take(1, "LONG1")[0]
            push(self.int_from_bytes(take(length, "LONG1")))
        elif code == 0x8B:  # LONG4
            (length,) = _unpack_i(take(4, "LONG4"))
            push(self.int_from_bytes(take(length, "LONG4")))
        elif code == 0x46:  # FLOAT (protocol 0)
            text = self.line("FLOAT")
            try:
                push(float(text))
            except ValueError:
                raise PickleDataError(f"not a float: {text[:40]!r}") from None
            charge(48)
        elif code == 0x47:  # BINFLOAT
            push(_unpack_d(take(8, "BINFLOAT"))[0])
            charge(48)
        elif code == 0x5D:  # EMPTY_LIST
            push([])
            charge(88)
        elif code == 0x8F:  # EMPTY_SET
            push(set())
            charge(256)
        elif code == 0x6C:  # LIST
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(items)
        elif code == 0x64:  # DICT
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            target: dict[Any, Any] = {}
            push(target)
            charge(96)
            self.setitems(target, items)
        elif code == 0x91:  # FROZENSET
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(frozenset(self.make_set(items)))
        elif code == 0x90:  # ADDITEMS
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            _need(stack, 1, code)
            target = stack[-1]
            if type(target) is not set:
                raise PickleDataError(f"ADDITEMS on a {type(target).__name__}")
            target.update(self.make_set(items))
        elif code == 0x61:  # APPEND
            _need(stack, 2, code)
            item = stack.pop()
            self.appends(stack[-1], [item])
        elif code == 0x65:  # APPENDS
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            _need(stack, 1, code)
            self.appends(stack[-1], items)
        elif code == 0x73:  # SETITEM
            _need(stack, 3, code)
            value = stack.pop()
            key = stack.pop()
            self.setitems(stack[-1], [key, value])
        elif code == 0x62:  # BUILD
            _need(stack, 2, code)
            state = stack.pop()
            self.build(stack[-1], state)
        elif code == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                _, stack = _pop_mark(stack, metastack, code)
                push = stack.append
        elif code == 0x31:  # POP_MARK
            _, stack = _pop_mark(stack, metastack, code)
            push = stack.append
        elif code == 0x32:  # DUP
            _need(stack, 1, code)
            push(stack[-1])
            charge(16)
        elif code == 0x67:  # GET (protocol 0)
            push(self.memo_get(self.text_int(self.line("GET"))))
            charge(16)
        elif code == 0x70:  # PUT (protocol 0)
            index = self.text_int(self.line("PUT"))
            _need(stack, 1, code)
            if index < 0:
                raise PickleDataError("negative PUT index")
            self.memo_put(index, stack[-1])
        elif code == 0x93:  # STACK_GLOBAL
            _need(stack, 2, code)
            name = stack.pop()
            module = stack.pop()
            push(self.global_(module, name, op))
        elif code == 0x81:  # NEWOBJ
            _need(stack, 2, code)
            args = stack.pop()
            stack[-1] = self.call(stack[-1], args)
        elif code == 0x92:  # NEWOBJ_EX
            _need(stack, 3, code)
            kwargs = stack.pop()
            args = stack.pop()
            stack[-1] = self.call(stack[-1], args, kwargs)
        elif code == 0x6F:  # OBJ: MARK cls args... OBJ
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            if not items:
                raise PickleDataError("OBJ without a class")
            push(self.call(items[0], tuple(items[1:])))
        elif code == 0x69:  # INST: MARK args... INST module\nname\n
            module = self.line("INST module")
            name = self.line("INST name")
            items, stack = _pop_mark(stack, metastack, code)
            push = stack.append
            push(self.call(self.global_(module, name, op), tuple(items)))
        elif code == 0x50:  # PERSID (protocol 0)
            pid = self.line("PERSID")
            if self.persistent is None:
                raise PickleDataError("a persistent id where none is expected")
            push(self.persistent(pid))
            charge(160)
        elif code in (0x82, 0x83, 0x84):  # EXT1/2/4
            raise PickleDataError(
                "EXT opcode: extension codes name globals through Python's process-wide copyreg "
                "registry; ckptlab never consults it")
        elif code in (0x97, 0x98):  # NEXT_BUFFER / READONLY_BUFFER
            raise PickleDataError("out-of-band buffers (protocol 5) are not used by checkpoints")
        else:
            raise PickleDataError(f"unknown opcode {code:#04x}")
        return stack, push
