"""Read back what :func:`ckptlab.viz.hex_html` shows, for tests of views that embed it."""

from __future__ import annotations

import re

__all__ = ["hex_bytes"]


def hex_bytes(doc: str) -> bytes:
    """The bytes a ``hex_html`` block shows (between the offset column and the ASCII text)."""
    out = bytearray()
    for line in re.sub(r"</?pre[^>]*>", "", doc).split("\n"):
        body = re.sub(r'<span class="off">[^<]*</span>  ', "", line, count=1)
        body = re.sub(r"<span[^>]*>|</span>", "", body)
        out += bytes.fromhex(" ".join(re.findall(r"(?<![^ ])[0-9a-f]{2}(?![^ ])",
                                                 body.split("  ")[0])))
    return bytes(out)
