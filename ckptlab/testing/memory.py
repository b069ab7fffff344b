"""What the kernel says about a mapping: its ``VmFlags`` in ``/proc/self/smaps`` (Linux).

Tests use it to check how ckptlab maps host memory (private, huge-page advised) from the
kernel's own account rather than from the flags ckptlab meant to pass.
"""

from __future__ import annotations

__all__ = ["mapping_flags"]


def mapping_flags(address: int) -> frozenset[str] | None:
    """The two-letter ``VmFlags`` of the mapping that contains ``address`` (``"sh"`` shared,
    ``"hg"`` huge-page advised, ...), or None where ``/proc/self/smaps`` cannot be read or no
    mapping contains it.

    Parameters
    ----------
    address
        Any address inside the mapping.
    """
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return frozenset(line.split()[1:])
    return None
