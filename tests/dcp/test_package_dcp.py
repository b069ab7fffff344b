"""ckptlab.dcp is the one home for reading DCP directories: it imports neither ckptlab.plan nor
ckptlab.checkpoint (they build on it), they import only its public names, and the names
ckptlab.plan exported before the move are the same objects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckptlab.dcp
import ckptlab.plan

ROOT = Path(ckptlab.dcp.__file__).resolve().parent.parent


def test_plan_names_are_the_dcp_ones():
    for name in ("DcpItem", "DcpLayout", "inspect_dcp", "is_dcp_dir", "load_metadata"):
        assert name in ckptlab.plan.__all__
        assert getattr(ckptlab.plan, name) is getattr(ckptlab.dcp, name), name
    for name in ckptlab.dcp.__all__:
        assert hasattr(ckptlab.dcp, name), name


def _imported(path: Path) -> list[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_dcp_imports_neither_plan_nor_checkpoint():
    """The dependency direction (DESIGN): format <- dcp <- checkpoint; plan uses dcp."""
    offenders = [f"{path.relative_to(ROOT)}: {module}"
                 for path in sorted((ROOT / "dcp").rglob("*.py")) for module in _imported(path)
                 if module.startswith(("ckptlab.plan", "ckptlab.checkpoint"))]
    assert not offenders, offenders
    code = ("import sys; sys.argv[0] = '-m'; import ckptlab.dcp.layout, ckptlab.dcp.items; "
            "print(sorted(m for m in sys.modules if m.startswith(('ckptlab.plan', "
            "'ckptlab.checkpoint'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"  # (as the command starts: no eager public names)


def test_plan_and_checkpoint_import_only_public_dcp_names():
    offenders = []
    for package in ("plan", "checkpoint"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and (
                        node.module == "ckptlab.dcp" or node.module.startswith("ckptlab.dcp.")):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    if any(p.startswith("_") for p in node.module.split(".")) or private:
                        offenders.append(f"{path.relative_to(ROOT)}: from {node.module} "
                                         f"import {', '.join(a.name for a in node.names)}")
                elif isinstance(node, ast.Import):
                    offenders.extend(f"{path.relative_to(ROOT)}: import {a.name}"
                                     for a in node.names if a.name.startswith("ckptlab.dcp")
                                     and any(p.startswith("_") for p in a.name.split(".")))
    assert not offenders, offenders
