"""The one tensor query (ckptlab.checkpoint.query): its rules, sort keys and paging, and the
same searches giving the same rows on every surface: the CLI, the notebook explorer, the
served app (the quick page's rows and the workbench's table) and the report's search box."""

from __future__ import annotations

import fnmatch
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.checkpoint._cache import CheckpointIndex
from ckptlab.checkpoint.query import (
    SORT_KEYS,
    TensorCatalog,
    TensorQuery,
    _compiled_glob,
    glob_regex,
    natural_key,
    select_tensors,
)
from ckptlab.errors import InvalidArgumentError


def catalog(names, **columns) -> TensorCatalog:
    return TensorCatalog(names, **columns)


def found(cat: TensorCatalog, pattern: str) -> list[str]:
    return [cat.names[i] for i in cat.matches(pattern)]


NAMES = ["model.h.0.mlp.c_fc.weight", "model.h.1.MLP.c_fc.weight", "model.h.10.attn.weight",
         "model.h.2.attn.weight", "model.wte.weight", "lm_head.weight", "h.1x.", "x[1].y"]


# -- the rules --------------------------------------------------------------------------------
def test_empty_and_blank_patterns_find_every_tensor() -> None:
    cat = catalog(NAMES)
    assert found(cat, "") == found(cat, "  \t") == NAMES
    assert TensorQuery("  mlp \n").pattern == "mlp"


def test_a_name_part_is_found_anywhere_in_any_case() -> None:
    cat = catalog(NAMES)
    assert found(cat, "mlp") == found(cat, "MLP") == found(cat, " Mlp ") == NAMES[:2]
    assert found(cat, "h.1") == ["model.h.1.MLP.c_fc.weight", "model.h.10.attn.weight", "h.1x."]
    # a [ makes a glob, even unclosed (then it is an ordinary character): the whole name
    assert found(cat, "x[1") == [] and found(cat, "x[1*") == ["x[1].y"]
    assert found(cat, "no such thing") == []


def test_a_glob_matches_the_whole_name_in_any_case() -> None:
    cat = catalog(NAMES)
    assert found(cat, "*.mlp.*") == found(cat, "*.MLP.*") == NAMES[:2]
    assert found(cat, "mlp*") == []  # the whole name, not a part of it
    assert found(cat, "model.h.1?.*") == ["model.h.10.attn.weight"]
    assert found(cat, "h.1?.") == ["h.1x."]
    assert found(cat, "*.h.[02].*") == ["model.h.0.mlp.c_fc.weight", "model.h.2.attn.weight"]
    assert found(cat, "*.h.[!02].*") == ["model.h.1.MLP.c_fc.weight"]
    assert found(cat, "*.h.[0-1].*") == ["model.h.0.mlp.c_fc.weight", "model.h.1.MLP.c_fc.weight"]
    assert found(cat, "*.h.[1-0].*") == []  # a reversed range matches nothing
    assert found(cat, "x[[]1].y") == ["x[1].y"]
    assert found(cat, "*[") == []  # "[" at the end: an ordinary character
    assert found(cat, "**.WTE.**") == ["model.wte.weight"]


def test_sets_translate_to_one_regular_expression() -> None:
    assert glob_regex("*.mlp.*") == r".*\.mlp\..*"
    assert glob_regex("h.[!0-4]?") == r"h\.[^0-4]."
    assert glob_regex("[]a-]") == r"[\]a\-]"
    assert glob_regex("[z-a]") == "(?!)" and glob_regex("[!z-a]") == "."
    assert glob_regex("[&&|~]") == r"[\x26\x26\x7c\x7e]"  # no set operations for re
    assert glob_regex("a[b") == r"a\[b" and glob_regex("***") == ".*"


GLOB_ALPHABET = "ab.*?[]!-^\\&|AZ0" + "ÄäİσΣ\u00df"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(alphabet="abAB.0[]!-\\^*?|", max_size=10), max_size=30),
       st.text(alphabet=GLOB_ALPHABET, max_size=8))
def test_the_catalog_matches_as_each_name_alone(names: list[str], pattern: str) -> None:
    """One pass over many names finds what matching each name alone finds, and what
    fnmatch (for globs without sets) or ``in`` find on the lower-cased texts."""
    cat = catalog(names)
    query = TensorQuery(pattern)
    want = [n for n in names if query.matches(n)]
    assert found(cat, pattern) == want
    p = query.pattern.lower()
    if not p:
        assert want == names
    elif not any(c in p for c in "*?["):
        assert want == [n for n in names if p in n.lower()]
    elif "[" not in p:
        assert want == [n for n in names if fnmatch.fnmatchcase(n.lower(), p)]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab.*?[]!-", max_size=12), st.text(alphabet="ab.-!", max_size=12))
def test_the_fast_glob_is_the_plain_one(pattern: str, name: str) -> None:
    """The atomic runs that keep ``*a*a*a*b`` fast match exactly what the plain regex does."""
    plain = re.compile(glob_regex(pattern), re.DOTALL).fullmatch(name) is not None
    assert (_compiled_glob(pattern).fullmatch(name) is not None) == plain


def test_a_glob_of_many_stars_does_not_backtrack_for_ever() -> None:
    """A hang guard, not a speed check: with plain ``.*`` runs this match backtracks through
    about C(300, 12) ways per name (hours); the atomic runs answer at once. The child is
    killed after 120 s, which only a regression reaches."""
    code = ("from ckptlab.checkpoint.query import TensorCatalog\n"
            "import numpy as np\n"
            "names = ['a' * 300] * 100\n"
            "cat = TensorCatalog(names, nbytes=np.zeros(100, dtype=np.int64))\n"
            "print(len(cat.matches('*a*a*a*a*a*a*a*a*a*a*a*a*b')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


# -- sort keys ---------------------------------------------------------------------------------
@pytest.fixture
def table() -> TensorCatalog:
    return catalog(["h.10.w", "h.2.w", "h.1.w", "emb", "h.02.w", "empty"],
                   nbytes=[40, 80, 40, 160, 10, 0], parameters=[10, 20, 10, 40, 5, 0],
                   files=["b", "a", "a", "a", "b", ""], offsets=[0, 100, 200, 50, 64, -1],
                   dtypes=["f32", "bf16", "f32", "f32", "i8", "f32"],
                   kinds=["dense"] * 5 + ["sparse"])


def names_in(cat: TensorCatalog, sort: str, descending: bool | None = None) -> list[str]:
    return [cat.names[i] for i in cat.order(sort, descending)]


def test_natural_name_order(table: TensorCatalog) -> None:
    # h.02 and h.2 are one key: they keep the checkpoint's order
    assert names_in(table, "name") == ["emb", "empty", "h.1.w", "h.2.w", "h.02.w", "h.10.w"]
    assert names_in(table, "name", True) == ["h.10.w", "h.2.w", "h.02.w", "h.1.w", "empty",
                                             "emb"]
    assert natural_key("h.2") < natural_key("h.10") and natural_key("a") < natural_key("a1")


def test_size_is_largest_first_and_ties_keep_order(table: TensorCatalog) -> None:
    assert names_in(table, "size") == ["emb", "h.2.w", "h.10.w", "h.1.w", "h.02.w", "empty"]
    assert names_in(table, "size", False) == ["empty", "h.02.w", "h.10.w", "h.1.w", "h.2.w",
                                              "emb"]
    assert names_in(table, "parameters") == names_in(table, "size")


def test_offset_is_file_order_with_bytesless_tensors_last(table: TensorCatalog) -> None:
    assert names_in(table, "offset") == ["emb", "h.2.w", "h.1.w", "h.10.w", "h.02.w", "empty"]
    assert names_in(table, "offset", True) == ["empty", "h.02.w", "h.10.w", "h.1.w", "h.2.w",
                                               "emb"]


def test_order_text_keys_and_errors(table: TensorCatalog) -> None:
    assert names_in(table, "order") == list(table.names)
    assert names_in(table, "order", True) == list(reversed(table.names))
    assert names_in(table, "dtype") == ["h.2.w", "h.10.w", "h.1.w", "emb", "empty", "h.02.w"]
    assert names_in(table, "kind")[-1] == "empty"
    assert names_in(table, "file") == ["empty", "h.2.w", "h.1.w", "emb", "h.10.w", "h.02.w"]
    assert set(SORT_KEYS) == {"order", "name", "size", "parameters", "offset", "dtype", "kind",
                              "file"}
    with pytest.raises(InvalidArgumentError, match="sort: expected one of"):
        TensorQuery(sort="bytes")
    with pytest.raises(InvalidArgumentError, match="no nbytes column"):
        catalog(["a"]).order("size")
    for bad in ({"pattern": 3}, {"descending": "yes"}, {"start": -1}, {"limit": -1},
                {"start": 1.0}):
        with pytest.raises(InvalidArgumentError):
            TensorQuery(**bad)


# -- paging ------------------------------------------------------------------------------------
def test_pages_and_counts() -> None:
    names = [f"layers.{i}.{w}" for i in range(30) for w in ("w", "b")]
    cat = catalog(names, nbytes=np.arange(60))
    first = cat.select(TensorQuery("*.w", sort="name", limit=7))
    second = cat.select(TensorQuery("*.w", sort="name", start=7, limit=7))
    assert (first.matched, first.total, len(first), len(second)) == (30, 60, 7, 7)
    assert first.names(cat) == [f"layers.{i}.w" for i in range(7)]
    assert second.names(cat) == [f"layers.{i}.w" for i in range(7, 14)]
    last = cat.select(TensorQuery("*.w", sort="name", start=28, limit=7))
    assert last.names(cat) == ["layers.28.w", "layers.29.w"]
    assert len(cat.select(TensorQuery("*.w", start=99))) == 0
    assert len(cat.select(TensorQuery(limit=0))) == 0 and cat.select(TensorQuery()).matched == 60
    every = cat.select(TensorQuery("b", sort="size"))
    assert every.names(cat)[:2] == ["layers.29.b", "layers.28.b"]  # the largest first
    assert select_tensors(cat, "layers.1.").names(cat) == ["layers.1.w", "layers.1.b"]


def test_100k_tensors_answer_fast() -> None:
    names = [f"model.layers.{i // 10}.{('mlp', 'attn')[i % 2]}.w{i % 5}" for i in range(100_000)]
    cat = catalog(names, nbytes=np.arange(100_000) % 977)
    cat.prepare()
    for pattern, matched in (("mlp", 50_000), ("*.MLP.w3", 10_000), ("*layers.99?.*", 100)):
        sel = cat.select(TensorQuery(pattern, sort="size", limit=100))
        assert sel.matched == matched and len(sel) == 100
        sizes = cat.nbytes[sel.rows].tolist()
        assert sizes == sorted(sizes, reverse=True)


# -- sources and the default order ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face directory whose index names shard 2 first (its keys sorted, as
    transformers writes them): the tensors still list in file order."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf_order")
    sd = {k: v.clone() for k, v in cl.samples.tiny_gpt(n_layer=12, d_model=8, vocab=16,
                                                       context=4).items()}
    names = list(sd)
    half = names.index("transformer.h.6.ln_1.weight")
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, root / shard)
    weight_map = {k: s for s, keys in shards.items() for k in keys}
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict(sorted(weight_map.items()))}))
    return root


def test_hf_tensors_are_in_file_order(hf_dir: Path) -> None:
    ck = cl.open(hf_dir)
    entries = list(ck.tensors.values())
    assert [(t.file, t.offset) for t in entries] == sorted((t.file, t.offset) for t in entries)
    # the first shard first, though the index's first name (lm_head) is in the second
    assert entries[0].file == "model-00001-of-00002.safetensors"
    assert entries[-1].file == ck.tensors["lm_head.weight"].file != entries[0].file
    cat = TensorCatalog.of(ck)
    assert cat.order("order").tolist() == cat.order("offset").tolist()
    assert TensorCatalog.of(CheckpointIndex.from_checkpoint(ck)).names == cat.names
    with pytest.raises(InvalidArgumentError, match="expected a Checkpoint"):
        TensorCatalog.of(["a"])


# -- the same rows on every surface ----------------------------------------------------------------
QUERIES = ["mlp", "*.mlp.*", "MLP", "h.1?.", "wte", "", "*.H.1?.*", "[!t]*", "attn.c_",
           "*.[lw]*.weight"]
SORTS = ["order", "name", "size", "offset"]
COLUMN = {"name": "name", "size": "bytes", "offset": "offset"}  # the tables' columns


def _node() -> str | None:
    found_node = shutil.which("node")
    if found_node:
        return found_node
    try:
        import playwright

        bundled = Path(playwright.__file__).parent / "driver" / "node"
        return str(bundled) if os.access(bundled, os.X_OK) else None
    except ImportError:
        return None


_FAKE_PAGE = r"""
const fs = require("fs");
const input = JSON.parse(fs.readFileSync(0, "utf8"));
const box = {value: "", handlers: {}, addEventListener(t, f) { this.handlers[t] = f; }};
const els = {"ckptlab-tensor-rows": {textContent: input.rows},
             "ckptlab-tensor-numeric": {textContent: input.numeric},
             "ckptlab-filter": box, "ckptlab-filter-count": {textContent: ""}};
const body = {innerHTML: ""};
globalThis.document = {getElementById: id => els[id], querySelector: () => body};
globalThis.setTimeout = f => { f(); return 0; };
globalThis.clearTimeout = () => {};
(0, eval)(input.script);
const out = [];
for (const q of input.queries) { box.value = q; box.handlers.input(); out.push(body.innerHTML); }
console.log(JSON.stringify(out));
"""


def _run_report_search(page: str, queries: list[str]) -> list[list[str]]:
    """The names the report's own search script lists for each query, run in node over a
    stand-in for the page's elements."""
    node = _node()
    if node is None:
        pytest.skip("node is needed to run the report's search script")

    def element(id_: str) -> str:
        m = re.search(f'<script type="application/json" id="{id_}">(.*?)</script>', page,
                      re.DOTALL)
        assert m, id_
        return m.group(1)

    script = next(s for s in re.findall(r"<script>(.*?)</script>", page, re.DOTALL)
                  if "ckptlabMatcher" in s)
    done = subprocess.run([node, "-e", _FAKE_PAGE], input=json.dumps({
        "rows": element("ckptlab-tensor-rows"), "numeric": element("ckptlab-tensor-numeric"),
        "script": script, "queries": queries}), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    bodies = json.loads(done.stdout)
    return [[html.unescape(n) for n in re.findall(r"<tr><td>(.*?)</td>", b)] for b in bodies]


@pytest.fixture(scope="module")
def surfaces_checkpoints(tmp_path_factory: pytest.TempPathFactory, hf_dir: Path
                         ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("surfaces")
    torch.save(cl.samples.tiny_gpt(n_layer=12, d_model=8, vocab=16, context=4), root / "m.pt")
    return {"torch-zip": root / "m.pt", "hf": hf_dir}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore:Widget.name is deprecated:PendingDeprecationWarning")
@pytest.mark.parametrize("fmt", ["torch-zip", "hf"])
def test_one_search_gives_the_same_rows_everywhere(surfaces_checkpoints, fmt: str,
                                                   capsys) -> None:
    """``inspect --filter Q --sort K --json``, the notebook explorer, the quick page's rows,
    the workbench's table and the report's search box list the same names in the same
    order, for every query and sort key (the report has no sort: its own order)."""
    from ckptlab.cli import main
    from ckptlab.viz.report import report_html
    from ckptlab.widgets.app import CheckpointApp, ServedCheckpoint
    from ckptlab.widgets.explorer import LayoutExplorer
    from ckptlab.widgets.quick import MAX_ROWS, CheckpointRows

    path = surfaces_checkpoints[fmt]
    ck = cl.open(path)
    core = TensorCatalog.of(ck)
    explorer = LayoutExplorer(ck)
    rows = CheckpointRows(path)
    app = CheckpointApp(ServedCheckpoint(path, rows=rows))
    report = _run_report_search(report_html(ck), QUERIES)
    assert len(ck.tensors) < MAX_ROWS and len(ck.tensors) < 200  # one page everywhere
    try:
        for sort in SORTS:
            column = COLUMN.get(sort, "")
            desc = sort == "size"  # the key's own direction
            app.tensors.table.sorters = ([{"field": column, "dir": "desc" if desc else "asc"}]
                                         if column else [])
            for qi, q in enumerate(QUERIES):
                want = core.select(TensorQuery(q, sort)).names(core)
                # the CLI
                assert main(["inspect", str(path), "--filter", q, "--json",
                             *(["--sort", sort] if sort != "order" else [])]) == 0
                cli = [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]]
                # the notebook explorer
                explorer.sort.value = sort
                explorer.search.value = q
                notebook = [v for _, v in explorer.tensors.options]
                # the served app: the quick page's rows, the workbench's table
                page = rows.page(q, sort=column, desc=desc, limit=MAX_ROWS)
                quick = [r[0] for r in page["rows"]]
                workbench = app.find(q)
                got = {"cli": cli, "notebook": notebook, "quick page": quick,
                       "workbench": workbench}
                if sort == "order":
                    got["report"] = report[qi]
                for surface, names in got.items():
                    assert names == want, (surface, q, sort)
                assert page["matched"] == len(want)
    finally:
        app.close()
    # the searches are not all trivial
    counts = {q: len(core.matches(q)) for q in QUERIES}
    assert counts["mlp"] == counts["MLP"] == counts["*.mlp.*"] == 48
    assert counts["h.1?."] == 0 and counts["*.H.1?.*"] == 26 and counts["wte"] == 1


@settings(max_examples=8, deadline=None)
@given(st.lists(st.text(alphabet=GLOB_ALPHABET, max_size=8), min_size=20, max_size=40))
def test_the_reports_glob_is_the_cores(patterns: list[str]) -> None:
    """The report's JavaScript turns every pattern into the regular expression
    :func:`glob_regex` makes, and finds the same names (run in node)."""
    from ckptlab.viz.report import _MATCH_JS

    node = _node()
    if node is None:
        pytest.skip("node is needed to run the report's search script")
    names = ["a.b", "A-B", "ä.ß", "İx", "σς", "ab]", "a[b", "a\nb", "x" * 5, "-", "!", "^a"]
    code = (_MATCH_JS + "\nconst input = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
            "\nconsole.log(JSON.stringify(input.patterns.map(p => {"
            "\n  const m = ckptlabMatcher(p);"
            "\n  return [ckptlabGlob(p), input.names.filter(n => !m || m(n.toLowerCase()))];"
            "\n})));")
    done = subprocess.run([node, "-e", code], input=json.dumps(
        {"patterns": patterns, "names": names}), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    cat = catalog(names)
    for pattern, (js_regex, js_found) in zip(patterns, json.loads(done.stdout), strict=True):
        assert js_regex == glob_regex(pattern), pattern
        assert js_found == found(cat, pattern), pattern
