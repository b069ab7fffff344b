"""environment.yml, binder/ and pyproject.toml install the same things."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch-cpu", "playwright": "playwright-python"}  # conda-forge names


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower()


def _pyproject_names(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {CONDA_NAMES.get(_name(r), _name(r)) for r in reqs}


def _conda_names(path: Path) -> set[str]:
    deps = yaml.safe_load(path.read_text())["dependencies"]
    names = {_name(d) for d in deps if isinstance(d, str)} - {"python", "pip"}
    for d in deps:  # packages conda-forge lacks, installed by pip (not "-e .")
        if isinstance(d, dict):
            names |= {_name(p) for p in d.get("pip", ()) if not p.startswith("-")}
    return names


def test_environment_yml_matches_pyproject():
    assert _conda_names(ROOT / "environment.yml") == _pyproject_names(("widgets", "dev"))


def test_binder_matches_pyproject_for_the_workbench():
    binder = _conda_names(ROOT / "binder" / "environment.yml")
    assert _pyproject_names(("widgets",)) <= binder
    assert binder <= _pyproject_names(("widgets", "dev"))
    assert "pip install --no-deps -e ." in (ROOT / "binder" / "postBuild").read_text()


def _notebook_imports() -> set[str]:
    """The top-level modules the notebooks' code cells import (magics left out)."""
    found: set[str] = set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            code = "\n".join(line for line in "".join(cell["source"]).splitlines()
                             if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"ckptlab"}


def test_binder_has_what_the_notebooks_import():
    binder = _conda_names(ROOT / "binder" / "environment.yml")
    provided_by = {"IPython": "jupyterlab"}  # (a dependency of JupyterLab)
    missing = {m for m in _notebook_imports()
               if provided_by.get(m, CONDA_NAMES.get(m, m).lower()) not in binder}
    assert not missing, f"notebooks import {sorted(missing)}: add them to binder/environment.yml"


def test_torch_is_pinned_before_anything_else_installs():
    makefile = (ROOT / "Makefile").read_text()
    pin = makefile.index("install --quiet torch==$(TORCH_VERSION)")
    rest = makefile.index('-c constraints.txt -e ".[widgets,dev]"')
    assert pin < rest
    assert "TORCH_VERSION := 2.13.0" in makefile
    assert (ROOT / "constraints.txt").read_text().strip() == "torch==2.13.0"
    assert "make test" in (ROOT / ".ci" / "run").read_text()
