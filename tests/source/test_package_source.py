"""ckptlab.source is the bottom room (DESIGN: source <- pickle <- format <- dcp <- checkpoint):
it imports no reader of ckptlab, and nothing of fsspec until a URL is opened."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckptlab.source

ROOT = Path(ckptlab.source.__file__).resolve().parent


def _imported(path: Path) -> list[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_source_imports_no_reader():
    offenders = [f"{path.name}: {module}" for path in sorted(ROOT.rglob("*.py"))
                 for module in _imported(path)
                 if module.startswith("ckptlab.") and not module.startswith(
                     ("ckptlab.source", "ckptlab.errors"))]
    assert not offenders, offenders
    code = ("import sys, ckptlab.source; print(sorted(m for m in sys.modules if "
            "m.startswith(('fsspec', 'aiohttp'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_public_names():
    for name in ckptlab.source.__all__:
        assert hasattr(ckptlab.source, name), name
