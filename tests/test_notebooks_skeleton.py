"""Every workbench notebook follows the Project Pythia cookbook skeleton (STYLE.md).

Checked on the committed JSON, without a kernel (nbmake runs the cells):

- a prerequisites table (a markdown table whose header is Concepts | Importance | Notes) and a
  "Time to learn" in minutes, before the first code cell;
- links: at least one http(s) link, and a References section made of links;
- it ends with "What's next" and then "References": no code after "What's next";
- a private-API note (an admonition-style warning) at or before the first code cell that uses
  a private torch symbol (``torch._C...``, ``torch._subclasses...``, ``x._attr``), naming it;
- only ckptlab's public API (names in ``__all__``, public submodules);
- committed clean: no outputs, no execution counts, every cell with an id.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import re
import tokenize
import types
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))

TABLE_HEADER = re.compile(r"^\|\s*Concepts?\s*\|\s*Importance\s*\|\s*Notes\s*\|\s*$",
                          re.IGNORECASE | re.MULTILINE)
TABLE_RULE = re.compile(r"^\|(\s*:?-{3,}:?\s*\|){3}\s*$")
TIME_TO_LEARN = re.compile(r"time to learn\W*\s*(\d+)\s*min", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]+\]\((https?://[^)\s]+)\)")
BARE_URL = re.compile(r"https?://\S+")
WHATS_NEXT = re.compile(r"^#{1,3}\s*What['’]s next\s*$", re.IGNORECASE | re.MULTILINE)
REFERENCES = re.compile(r"^#{1,3}\s*(?:Resources and )?References\s*$",
                        re.IGNORECASE | re.MULTILINE)
ANY_HEADING = re.compile(r"^#{1,3}\s", re.MULTILINE)
ADMONITION = re.compile(r'<div class="admonition alert alert-warning">', re.IGNORECASE)
# private torch modules or attributes (torch._C.PyTorchFileReader, torch._subclasses.fake_tensor)
PRIVATE_TORCH = re.compile(r"\btorch\._[A-Za-z]\w*(?:\.\w+)*")
# a private attribute of some object (storage._checkpoint_offset); a notebook's own classes
# may use self._x freely
PRIVATE_ATTRIBUTE = re.compile(r"(?<!\bself)(?<!\bcls)\.(_[a-z]\w*)")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _code_without_strings_and_comments(source: str) -> str:
    """The code of a cell with comments and string literals blanked (so prose in a comment
    or a message does not count as using a symbol)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    for tok in reversed(tokens):  # from the end, so earlier positions stay valid
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        (row0, col0), (row1, col1) = tok.start, tok.end
        head, tail = lines[row0 - 1][:col0], lines[row1 - 1][col1:]
        lines[row0 - 1:row1] = [head + " " + tail]
    return "".join(lines)


def private_symbols(source: str) -> dict[str, str]:
    """Private torch symbols a code cell uses: {what a note must name: what the code says}."""
    code = _code_without_strings_and_comments(source)
    found: dict[str, str] = {}
    for m in PRIVATE_TORCH.finditer(code):
        private_module = ".".join(m.group(0).split(".")[:2])  # torch._C, torch._subclasses
        found.setdefault(private_module, m.group(0))
    for m in PRIVATE_ATTRIBUTE.finditer(PRIVATE_TORCH.sub(" ", code)):
        found.setdefault(m.group(1), m.group(0))
    return found


def _is_private_note(cell: dict) -> bool:
    text = _source(cell)
    return (cell["cell_type"] == "markdown" and bool(ADMONITION.search(text))
            and "private" in text.lower())


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=lambda p: p.name)
def notebook(request) -> tuple[str, dict]:
    return request.param.name, _load(request.param)


def test_the_notebooks_are_found_numbered_in_order():
    assert [p.stem[:2] for p in NOTEBOOKS] == [f"{i:02}" for i in range(10)]


def test_prerequisites_table_and_time_to_learn_come_first(notebook):
    name, nb = notebook
    first_code = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
    intro = "\n".join(_source(c) for c in nb["cells"][:first_code] if c["cell_type"] == "markdown")
    header = TABLE_HEADER.search(intro)
    assert header, f"{name}: no '| Concepts | Importance | Notes |' table before the first code cell"
    following = intro[header.end():].lstrip("\n").split("\n")
    assert following and TABLE_RULE.match(following[0]), (
        f"{name}: the prerequisites table header is not followed by a '| --- | --- | --- |' rule")
    rows = [line for line in following[1:] if line.startswith("|")]
    assert rows, f"{name}: the prerequisites table has no rows"
    minutes = TIME_TO_LEARN.search(intro)
    assert minutes and int(minutes.group(1)) > 0, (
        f"{name}: no 'Time to learn: N minutes' before the first code cell")


def test_links_its_sources(notebook):
    name, nb = notebook
    markdown = "\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert LINK.search(markdown) or BARE_URL.search(markdown), f"{name}: no http(s) link"


def test_ends_with_whats_next_then_references(notebook):
    name, nb = notebook
    cells = nb["cells"]
    nexts = [i for i, c in enumerate(cells)
             if c["cell_type"] == "markdown" and WHATS_NEXT.search(_source(c))]
    refs = [i for i, c in enumerate(cells)
            if c["cell_type"] == "markdown" and REFERENCES.search(_source(c))]
    assert nexts, f"{name}: no 'What's next' heading"
    assert refs, f"{name}: no 'References' heading"
    assert refs[-1] == len(cells) - 1, f"{name}: the References cell is not the last cell"
    assert nexts[-1] <= refs[-1], f"{name}: 'What's next' comes after 'References'"
    code_after = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and i > nexts[-1]]
    assert not code_after, f"{name}: code cells {code_after} after 'What's next'"
    last = _source(cells[refs[-1]])
    references = last[REFERENCES.search(last).end():]
    assert not ANY_HEADING.search(references), f"{name}: another section follows References"
    links = LINK.findall(references)
    assert links, f"{name}: the References section links nothing"
    items = [line for line in references.splitlines() if line.startswith("- ")]
    unlinked = [line for line in items if not LINK.search(line)]
    assert not unlinked, f"{name}: references without a link: {unlinked}"


def test_private_torch_api_is_announced(notebook):
    name, nb = notebook
    cells = nb["cells"]
    first_use: dict[str, tuple[int, str]] = {}
    for i, c in enumerate(cells):
        if c["cell_type"] == "code":
            for symbol, spelled in private_symbols(_source(c)).items():
                first_use.setdefault(symbol, (i, spelled))
    notes = [(i, _source(c)) for i, c in enumerate(cells) if _is_private_note(c)]
    for symbol, (at, spelled) in first_use.items():
        naming = [i for i, text in notes if symbol in text]
        assert naming, (f"{name}: cell {at} uses {spelled!r} but no private-API note (a "
                        f"'<div class=\"admonition alert alert-warning\">' naming {symbol!r})")
        assert min(naming) <= at, (f"{name}: the note naming {symbol!r} comes after its first "
                                   f"use in cell {at}")


def test_private_symbol_scan():
    """The scan behind the test above: what it flags and what it leaves alone."""
    assert private_symbols("r = torch._C.PyTorchFileReader(str(p))") == {
        "torch._C": "torch._C.PyTorchFileReader"}
    assert private_symbols("from torch._subclasses.fake_tensor import FakeTensorMode") == {
        "torch._subclasses": "torch._subclasses.fake_tensor"}
    assert private_symbols("o = t.untyped_storage()._checkpoint_offset") == {
        "_checkpoint_offset": "._checkpoint_offset"}
    assert private_symbols("self._f = open(p)\nx = cls._cache") == {}
    assert private_symbols("x = 1  # torch._C is not used here\ns = 'a._b'") == {}
    assert private_symbols("torch.save(s, p)\nconfig.save.storage_alignment") == {}


def _resolve(module: types.ModuleType, names: list[str], where: str) -> list[str]:
    """Walk ckptlab.a.b.c: each step through a module must be public (in ``__all__`` or a
    public submodule); stops at the first non-module. Returns the problems found."""
    problems = []
    obj: object = module
    for name in names:
        if not isinstance(obj, types.ModuleType):
            break
        public = getattr(obj, "__all__", None)
        if name.startswith("_"):
            problems.append(f"{where}: private name {obj.__name__}.{name}")
            break
        try:
            sub = importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            sub = None
        if sub is not None:
            obj = sub
            continue
        if public is None or name not in public:
            problems.append(f"{where}: {obj.__name__}.{name} is not in {obj.__name__}.__all__")
            break
        obj = getattr(obj, name)
    return problems


def _attribute_chain(node: ast.AST) -> tuple[str, list[str]] | None:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, names[::-1]
    return None


def test_uses_only_ckptlab_public_api(notebook):
    name, nb = notebook
    aliases: dict[str, str] = {}  # local name -> ckptlab module it is bound to
    problems: list[str] = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        where = f"{name} cell {i}"
        tree = ast.parse(_source(c))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "ckptlab":
                        continue
                    parts = alias.name.split(".")
                    problems += _resolve(importlib.import_module("ckptlab"), parts[1:], where)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases["ckptlab"] = "ckptlab"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ckptlab":
                parts = node.module.split(".")
                problems += _resolve(importlib.import_module("ckptlab"), parts[1:], where)
                module = importlib.import_module(node.module)
                for alias in node.names:
                    problems += _resolve(module, [alias.name], where)
                    bound = getattr(module, alias.name, None)
                    if isinstance(bound, types.ModuleType):
                        aliases[alias.asname or alias.name] = bound.__name__
        for node in ast.walk(tree):
            chain = _attribute_chain(node) if isinstance(node, ast.Attribute) else None
            if chain and chain[0] in aliases:
                root, names = chain
                problems += _resolve(importlib.import_module(aliases[root]), names, where)
    assert not problems, "\n".join(sorted(set(problems)))


def test_committed_without_outputs(notebook):
    name, nb = notebook
    assert nb.get("nbformat") == 4 and nb.get("nbformat_minor", 0) >= 5, name
    ids = [c.get("id") for c in nb["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), f"{name}: missing or repeated cell ids"
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{name}: code cells {dirty} have outputs or execution counts"
