"""What ``torch.load(weights_only=True)`` of the installed torch would do with a pickle, decided
from torch's own rules at call time, without running its unpickler.

torch's weights-only unpickler (``torch._weights_only_unpickler``) is an opcode loop that refuses,
in the order the opcodes come:

- an opcode it does not implement (it supports the protocol-2 subset torch.save writes; the set
  is read from the opcode names the module imports from :mod:`pickle`);
- a ``GLOBAL`` whose module is blocked (``_blocklisted_modules``), or whose name, after torch's
  own Python 2 mapping (``torch._utils.NAME_MAPPING``/``IMPORT_MAPPING``), is neither in its
  default allow-list (``_get_allowed_globals``) nor added by the user
  (:func:`torch.serialization.get_safe_globals`);
- a ``REDUCE`` or ``NEWOBJ`` of something other than an allowed global;
- a ``BUILD`` on anything but a tensor, a parameter, an ``OrderedDict`` or an instance of an
  allowed class;
- an ``APPEND(S)`` on anything but a list, a ``SETITEM(S)`` on anything but a dict,
  ``OrderedDict`` or ``Counter``;
- a persistent id that is not a tuple or int, or a tuple not starting with ``"storage"``.

:class:`Policy` holds those rules as read from the installed torch; the scan gives it what the
pickle did, opcode by opcode, as ckptlab's interpreter found it (:mod:`ckptlab.safety.scan`).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Policy", "Refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why torch's weights-only unpickler stops, at which opcode of the pickle."""

    offset: int
    refused: str  # the global as torch names it, or what else was refused ("opcode FRAME")
    reason: str  # torch's message, in short


def _torch_message_name(full: str) -> str:
    # torch names builtins without their module in its message ("GLOBAL eval was not ...")
    return full[len("builtins."):] if full.startswith("builtins.") else full


@dataclass(frozen=True)
class Policy:
    """torch's weights-only rules as the installed torch has them."""

    version: str
    opcodes: frozenset[int]
    allowed: dict[str, Any]
    blocked: frozenset[str]
    name_mapping: dict[tuple[str, str], tuple[str, str]]
    import_mapping: dict[str, str]
    parameter: Any

    @classmethod
    def installed(cls) -> Policy | None:
        """The installed torch's rules, read now (the user's safe globals included), or None
        without torch (or with a torch whose weights-only unpickler is not the one this reads).
        """
        try:
            import torch

            from ckptlab import _torch_compat as tc
            from ckptlab.errors import TorchInternalsError

            allowed_fn, user_fn, blocked_modules, unpickler, names, modules = \
                tc.weights_only_rules()
        except (ImportError, TorchInternalsError):
            return None
        allowed = dict(allowed_fn())
        allowed.update(user_fn())
        wo = sys.modules[unpickler.__module__]
        opcodes = frozenset(
            value[0] for name, value in vars(wo).items()
            if name.isupper() and isinstance(value, bytes) and len(value) == 1
            and getattr(pickle, name, None) == value)
        return cls(torch.__version__, opcodes, allowed, frozenset(blocked_modules),
                   dict(names), dict(modules), torch.nn.Parameter)

    def allowed_names(self) -> frozenset[str]:
        return frozenset(self.allowed)

    def mapped(self, module: str, name: str) -> tuple[str, str]:
        """``(module, name)`` after torch's Python 2 mapping."""
        if (module, name) in self.name_mapping:
            return self.name_mapping[(module, name)]
        return self.import_mapping.get(module, module), name

    def opcode(self, code: int, offset: int) -> Refusal | None:
        if code in self.opcodes:
            return None
        from ckptlab.format._optable import OPCODE_NAMES

        name = OPCODE_NAMES.get(code, ("?", 0))[0]
        return Refusal(offset, f"opcode {name}",
                       f"Unsupported operand {code} ({name}): torch's weights-only unpickler "
                       f"implements the protocol-2 opcodes torch.save writes")

    def global_(self, module: str, name: str, offset: int) -> Refusal | None:
        module, name = self.mapped(module, name)
        full = f"{module}.{name}"
        if module in self.blocked:
            return Refusal(offset, full, f"Trying to load unsupported GLOBAL {full} whose "
                                         f"module {module} is blocked")
        if full in self.allowed:
            return None
        shown = _torch_message_name(full)
        return Refusal(offset, shown, f"Unsupported global: GLOBAL {shown} was not an allowed "
                                      f"global by default")

    def builds(self, full: str) -> bool:
        """Whether torch's unpickler BUILDs what calling allowed global ``full`` made: a
        tensor, a parameter or an instance of an allowed class."""
        value = self.allowed.get(full)
        if value is None:
            return False
        if isinstance(value, type):
            return True
        return full.startswith(("torch._utils._rebuild_", "torch._tensor._rebuild_from_type"))

    def sets_items(self, full: str) -> bool:
        """Whether SETITEM(S) may fill what calling ``full`` made (an OrderedDict, a Counter)."""
        return full in ("collections.OrderedDict", "collections.Counter")
