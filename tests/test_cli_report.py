"""``ckptlab report`` and ``ckptlab serve``, called in-process through ``main([...])``.

The report is a standalone HTML file: plotly.js inline (no CDN), one div per figure, the
record and tensor tables, and a coloured hex view of the first bytes.
"""

from __future__ import annotations

import html
import re

import pytest

import ckptlab as cl
from ckptlab.cli import main


def read_report(path) -> str:
    doc = path.read_text(encoding="utf-8")
    assert doc.startswith("<!DOCTYPE html>") and doc.rstrip().endswith("</html>")
    return doc


def without_plotlyjs(doc: str) -> str:
    """The page without the inlined plotly.js library (whose code mentions URLs it never
    fetches unless asked: map tiles, topojson)."""
    banner = doc.index("plotly.js v")
    start = doc.rindex("<script", 0, banner)
    end = doc.index("</script>", banner) + len("</script>")
    return doc[:start] + doc[end:]


def figure_ids(doc: str) -> list[str]:
    return re.findall(r'Plotly\.newPlot\(\s*"([^"]+)"', doc)


def test_report_writes_a_standalone_page(sample_file, sample_layout, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(sample_file), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    doc = read_report(out)
    # offline: plotly.js inline once, nothing fetched from the network
    assert doc.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]+src=", doc)
    page = without_plotlyjs(doc)
    assert "http:" not in page and "https:" not in page  # the page itself links nowhere
    assert len(doc) - len(page) > 1_000_000  # the library really is inline
    assert figure_ids(doc) == [f"ckptlab-fig-{i}" for i in range(5)]
    for i in range(5):
        assert f'<div id="ckptlab-fig-{i}"' in doc
    for kind in ("bytemap", "overhead", "alignment", "storages"):
        assert f'"kind":"{kind}"' in doc
    # the tables name every record and tensor
    for r in sample_layout.records:
        assert f"<td>{html.escape(r.short_name)}</td>" in doc
    for t in sample_layout.tensors:
        assert f"<td>{html.escape('.'.join(map(str, t.path)))}</td>" in doc
    assert f"<td>{html.escape(str(sample_file))}</td>" in doc
    # the first bytes: the local header of data.pkl
    assert "<h2>First bytes</h2>" in doc
    assert f'title="local header of {sample_layout.records[0].name}">50 4b 03 04' in doc


def test_report_of_safetensors(safetensors_file, hostile_name, tmp_path):
    out = tmp_path / "st.html"
    assert main(["report", str(safetensors_file), "--output", str(out)]) == 0
    doc = read_report(out)
    assert figure_ids(doc) == [f"ckptlab-fig-{i}" for i in range(4)]  # no alignment cost
    assert hostile_name not in doc
    assert f"<td>{html.escape(hostile_name)}</td>" in doc


def test_report_of_a_small_file_reads_only_what_is_there(tmp_path):
    import torch

    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(1)}, path)
    assert cl.inspect(path).file_nbytes < 1024 * 2
    out = tmp_path / "t.html"
    assert main(["report", str(path), "-o", str(out)]) == 0
    assert "<td>data/0</td>" in read_report(out)


def test_report_defaults_to_the_sample_and_report_html(monkeypatch, sample_file, tmp_path,
                                                       capsys):
    monkeypatch.setattr(cl.samples, "sample_path", lambda: sample_file)
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 0
    assert capsys.readouterr().out.strip() == "report.html"
    doc = read_report(tmp_path / "report.html")
    assert "ckptlab report · sample.pt" in doc


@pytest.mark.parametrize("content, words", [
    (b"", "empty file"),
    (b"hello world, not a checkpoint", "not a checkpoint format"),
])
def test_report_of_a_bad_file_exits_2(tmp_path, capsys, content, words):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    out = tmp_path / "never.html"
    assert main(["report", str(bad), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("ckptlab: error: ") and str(bad) in line and words in line
    assert not out.exists()


def test_serve_verb_passes_its_options(monkeypatch, sample_file):
    from ckptlab import cli
    from ckptlab.widgets import quick

    calls = []
    monkeypatch.setattr(quick, "serve", lambda *a, **k: calls.append((a, k)))
    # the ports may be taken on this machine: the free-port check has tests of its own
    monkeypatch.setattr(cli._checks, "_check_listen", lambda address, port: None)
    assert main(["serve", str(sample_file), "--port", "6001", "--address", "0.0.0.0",
                 "--show"]) == 0
    assert calls == [((str(sample_file),), {"port": 6001, "address": "0.0.0.0", "show": True})]
    calls.clear()
    monkeypatch.setattr(cl.samples, "sample_path", lambda: sample_file)
    assert main(["serve"]) == 0
    assert calls == [((str(sample_file),), {"port": 5006, "address": "127.0.0.1",
                                            "show": False})]


def test_report_to_an_unwritable_path_exits_2(sample_file, tmp_path, capsys):
    out = tmp_path / "missing" / "r.html"
    assert main(["report", str(sample_file), "-o", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ckptlab: error: ") and str(out) in line
