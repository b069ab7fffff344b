"""Words for counts, shared by the command line and every view: "1 tensor", "2 tensors"."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` (with thousands separators) and ``word``, in the plural (``many``, by default
    ``word + "s"``) unless ``n`` is 1."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
