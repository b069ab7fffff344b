"""Every verb on every format: ``offsets``, ``report``, ``readiness`` and ``serve`` on a torch.save
file, a safetensors file, a Hugging Face sharded directory and DCP directories.

Each output is checked against the checkpoint model (``ckptlab.open``) and against the bytes
themselves: an offset the CLI prints must hold the tensor's bytes as they were saved. Words must
fit the format: no zip records or torch config for a safetensors file, no alignment what-if
where the writer has no alignment to choose.
"""

from __future__ import annotations

import html
import json
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.gds.readiness import tensor_ranges
from ckptlab.testing.modules import Small

TIMEOUT_S = 120


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command, in its own process (what a user sees, tracebacks included)."""
    return subprocess.run([sys.executable, "-m", "ckptlab", *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """``ckptlab ARGS`` in this process: (status, stdout, stderr); faster than ``run``."""
    def call(*args: str) -> subprocess.CompletedProcess[str]:
        status = main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), status, out.out, out.err)
    return call


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"emb.weight": torch.randn(16, 8, generator=g),
            "ln.bias": torch.randn(8, generator=g).to(torch.bfloat16),
            "steps": torch.arange(5, dtype=torch.int64),
            "head.weight": torch.randn(8, 4, generator=g)}


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint of each format, all holding ``state()`` (DCP under ``model.``)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter, filesystem

    SerializationFormat = getattr(filesystem, "SerializationFormat", None)  # torch >= 2.8
    base = tmp_path_factory.mktemp("formats")
    sd = state()
    torch.save(sd, base / "model.pt")
    save_file(sd, str(base / "model.safetensors"))
    hf = base / "hf"
    hf.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["emb.weight", "ln.bias"],
              "model-00002-of-00002.safetensors": ["steps", "head.weight"]}
    for shard, names in shards.items():
        save_file({n: sd[n] for n in names}, str(hf / shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.nbytes for t in sd.values())},
        "weight_map": {n: shard for shard, names in shards.items() for n in names}}))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "step": 7}, checkpoint_id=str(base / "dcp"))
        if SerializationFormat is not None:
            dcp.save(sd, storage_writer=FileSystemWriter(
                str(base / "dcp-st"), serialization_format=SerializationFormat.SAFETENSORS))
    made = Made({"torch": base / "model.pt", "safetensors": base / "model.safetensors",
                 "hf": hf, "dcp": base / "dcp"})
    if SerializationFormat is not None:
        made["dcp-st"] = base / "dcp-st"
    return made


class Made(dict):
    """The checkpoints this torch could write; asking for another skips the test."""

    def __missing__(self, kind: str) -> Path:
        pytest.skip(f"torch {torch.__version__} cannot write a {kind!r} checkpoint "
                    "(DCP's SerializationFormat came in 2.8)")


# the original tensor of each checkpoint's tensor name
def original(kind: str, name: str) -> torch.Tensor:
    return state()[name.removeprefix("model.") if kind == "dcp" else name]


def file_of(path: Path, rel: str) -> Path:
    return path / rel if path.is_dir() else path


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("ckptlab: error: ")
    return line


# ---------------------------------------------------------------------------------------------
# offsets


def test_offsets_of_a_torch_save_file_keeps_its_contract(made, cli) -> None:
    proc = cli("offsets", str(made["torch"]), "--json")
    assert proc.returncode == 0 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert next(iter(doc)) == "offsets"
    layout = cl.inspect(made["torch"])
    assert doc["offsets"] == {s.key: s.data_offset for s in layout.storages}
    assert 1 <= doc["reads"] <= 3 and doc["bytes_read"] > 0 and doc["method"] == "cursor"
    text = cli("offsets", str(made["torch"]))
    assert text.returncode == 0 and text.stdout.startswith("storage")


@pytest.mark.parametrize("kind", ["safetensors", "hf", "dcp", "dcp-st"])
def test_offsets_json_are_the_models_and_hold_the_bytes(made, kind, cli) -> None:
    path = made[kind]
    proc = cli("offsets", str(path), "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    doc = json.loads(proc.stdout)
    assert next(iter(doc)) == "offsets" and doc["method"] == "headers"
    ck = cl.open(path)
    assert doc["format"] == ck.format
    ranges = tensor_ranges(ck)
    assert list(doc["offsets"]) == [r.name for r in ranges]
    parts = [p for t in ck.tensors.values() for p in t.parts]
    for r, part in zip(ranges, parts, strict=True):
        assert doc["offsets"][r.name] == part.offset
        assert doc["files"][r.name] == part.file
        assert doc["nbytes"][r.name] == part.nbytes
    # the bytes at each offset are the tensor as saved
    for key, offset in doc["offsets"].items():
        with open(file_of(path, doc["files"][key]), "rb") as f:
            f.seek(offset)
            got = f.read(doc["nbytes"][key])
        assert got == raw(original(kind.removesuffix("-st"), doc["tensors"][key])), key
    assert isinstance(doc["reads"], int) and doc["bytes_read"] > 0
    assert doc["uncounted_files"] == []


def test_offsets_reads_what_the_format_needs(made, cli) -> None:
    st = json.loads(cli("offsets", str(made["safetensors"]), "--json").stdout)
    (n,) = [int.from_bytes(made["safetensors"].read_bytes()[:8], "little")]
    assert (st["reads"], st["bytes_read"]) == (2, 8 + n)  # the length, then the header
    hf = json.loads(cli("offsets", str(made["hf"]), "--json").stdout)
    index = made["hf"] / "model.safetensors.index.json"
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little")
                  for p in made["hf"].glob("*.safetensors"))
    assert (hf["reads"], hf["bytes_read"]) == (1 + 2 * 2, index.stat().st_size + headers)
    dcp = json.loads(cli("offsets", str(made["dcp"]), "--json").stdout)
    assert dcp["read_per_file"][".metadata"] == {
        "how": ".metadata", "reads": 1, "bytes_read": (made["dcp"] / ".metadata").stat().st_size}
    items = len(dcp["offsets"])
    assert 1 + items <= dcp["reads"] <= 1 + 3 * items  # .metadata + each item's zip directory


@pytest.mark.parametrize("kind, words", [
    ("safetensors", "safetensors header (2 reads)"),
    ("hf", "safetensors header of 2 files"),
    ("dcp", "item zip directories"),
])
def test_offsets_text_speaks_the_format(made, kind, words, cli) -> None:
    proc = cli("offsets", str(made[kind]))
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("tensor") and words in proc.stdout
    for name in cl.open(made[kind]).tensors:
        assert name in proc.stdout
    if kind != "dcp":
        assert not re.search(r"storage|record|zip", proc.stdout)


def test_offsets_scan_is_for_torch_save_files(made, cli) -> None:
    line = one_error_line(cli("offsets", str(made["safetensors"]), "--scan"))
    assert "--scan" in line and "safetensors" in line


@pytest.fixture(scope="module")
def other_zips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Zips torch writes that are no torch.save archive: a TorchScript archive
    (``torch.jit.save``) and a torch.export one (``torch.export.save``, .pt2) of one module."""
    base = tmp_path_factory.mktemp("other-zips")
    torch.manual_seed(0)
    module = Small()
    with warnings.catch_warnings():  # torch.jit is deprecated
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(module), str(base / "scripted.pt"))
        torch.export.save(torch.export.export(module, (torch.randn(1, 3),)),
                          base / "exported.pt2")
    return {"torchscript": base / "scripted.pt", "pt2": base / "exported.pt2"}


def loaded_back(kind: str, path: Path) -> dict[str, torch.Tensor]:
    """The tensors torch itself loads from ``path``, by state dict name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "torchscript":
            return dict(torch.jit.load(str(path)).state_dict())
        return dict(torch.export.load(path).state_dict)


@pytest.mark.parametrize("kind", ["torchscript", "pt2"])
def test_offsets_of_torchscript_and_torch_export_zips_are_torchs_records(other_zips, kind,
                                                                         cli) -> None:
    """A TorchScript or torch.export zip is no torch.save archive: ``offsets`` prints each
    tensor's data offset from the checkpoint model, and each is where torch's own zip reader
    puts the data of the record holding the tensor's storage
    (``PyTorchFileReader.get_record_offset``), plus the tensor's place in that storage."""
    path = other_zips[kind]
    proc = cli("offsets", str(path), "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == kind and doc["method"] == "model"
    assert doc["uncounted_files"] == [path.name] and doc["reads"] is None
    tensors = loaded_back(kind, path)
    assert sorted(doc["tensors"].values()) == sorted(tensors)
    reader = torch._C.PyTorchFileReader(str(path))
    records = {name: reader.get_record(name) for name in reader.get_all_records()}
    for key, offset in doc["offsets"].items():
        t = tensors[doc["tensors"][key]]
        storage = bytes(t.untyped_storage().tolist())
        (record,) = [name for name, data in records.items() if data == storage]
        assert offset == reader.get_record_offset(record) + t.storage_offset() * t.element_size()
        assert doc["nbytes"][key] == t.nbytes and doc["files"][key] == path.name
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(t.nbytes) == raw(t), key
    text = cli("offsets", str(path))
    assert text.returncode == 0 and text.stderr == "" and text.stdout.startswith("tensor")
    for key, offset in doc["offsets"].items():
        assert re.search(rf"^{re.escape(key)} +{offset:,} ", text.stdout, re.M), key
    line = one_error_line(cli("offsets", str(path), "--scan"))
    assert "--scan" in line and kind in line


# ---------------------------------------------------------------------------------------------
# report


def report_of(cli, path: Path, out: Path) -> str:
    proc = cli("report", str(path), "-o", str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == str(out)
    doc = out.read_text(encoding="utf-8")
    assert doc.startswith("<!DOCTYPE html>") and doc.rstrip().endswith("</html>")
    assert doc.count("plotly.js v") == 1 and not re.search(r"<script[^>]+src=", doc)
    return doc


def page_of(doc: str) -> str:
    """The page without the inlined plotly.js library (whose code holds every word)."""
    banner = doc.index("plotly.js v")
    start = doc.rindex("<script", 0, banner)
    end = doc.index("</script>", banner) + len("</script>")
    return doc[:start] + doc[end:]


def figure_kinds(doc: str) -> list[str]:
    return re.findall(r'"meta":\{"kind":"(\w+)"', doc)


def test_report_of_a_safetensors_file_speaks_safetensors(made, tmp_path, cli) -> None:
    doc = report_of(cli, made["safetensors"], tmp_path / "st.html")
    page = page_of(doc)
    for word in ("record", "zip64", "FB padding", "storage_alignment", "Alignment cost"):
        assert word not in page, word
    assert "header padding" in page or "JSON header" in page
    assert figure_kinds(doc) == ["treemap", "bytemap", "overhead", "placement"]
    ck = cl.open(made["safetensors"])
    for t in ck.tensors.values():  # name, dtype, shape, kind, bytes, params, offset
        assert (f"<td>{html.escape(t.name)}</td><td>{t.dtype}</td>"
                f"<td>{'x'.join(map(str, t.shape))}</td><td>dense</td>"
                f'<td style="text-align:right">{t.nbytes:,}</td>') in doc
        assert f'<td style="text-align:right">{t.offset:,}</td></tr>' in doc


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_report_of_a_directory_has_a_section_per_file(made, kind, tmp_path, cli) -> None:
    doc = report_of(cli, made[kind], tmp_path / f"{kind}.html")
    page = page_of(doc)
    ck = cl.open(made[kind])
    assert "<h2>Files</h2>" in page
    holding = {t.file for t in ck.tensors.values()}
    for f in ck.files:  # the overview table: every file with its bytes
        assert f"<td>{html.escape(f.path)}</td><td>{f.format}</td>" \
               f'<td style="text-align:right">{f.nbytes:,}</td>' in page
        # the byte map of every file that holds tensor bytes
        assert (f"<h2>Byte map · {html.escape(f.path)}</h2>" in page) == (f.path in holding)
    kinds = figure_kinds(doc)
    assert kinds[:2] == ["treemap", "files"] and kinds.count("bytemap") == len(holding)
    n = len(holding)
    assert (f"of the {'one' if n == 1 else n} file{'s' * (n != 1)} that hold{'s' * (n == 1)} "
            "tensor bytes; the table above lists every file") in page
    assert "overhead" not in kinds and "alignment" not in kinds
    for t in ck.tensors.values():  # the tensor table names file and offset
        assert (f"<td>{html.escape(t.file)}</td>"
                f'<td style="text-align:right">{t.offset:,}</td></tr>') in doc
    if kind == "hf":
        assert "record" not in page and "zip64" not in page


def test_report_says_which_byte_maps_it_left_out(made) -> None:
    from ckptlab.viz import report_html

    ck = cl.open(made["hf"])
    doc = report_html(ck, max_file_maps=1)
    counts = {f.path: sum(t.file == f.path for t in ck.tensors.values()) for f in ck.files}
    most = max(ck.files, key=lambda f: (counts[f.path], f.nbytes))  # the most tensors first
    assert figure_kinds(doc).count("bytemap") == 1
    assert f"Byte map · {most.path}" in doc
    assert "Byte maps of the 1 with the most tensors of the 2 files that hold tensor bytes" \
        in doc


def test_report_of_a_torch_save_file_keeps_records_and_what_if(made, tmp_path, cli) -> None:
    doc = report_of(cli, made["torch"], tmp_path / "pt.html")
    assert figure_kinds(doc) == ["treemap", "bytemap", "overhead", "alignment", "storages"]
    assert "<h2>Records</h2>" in doc


def test_report_validates_its_input_before_plotting(tmp_path) -> None:
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    out = tmp_path / "never.html"
    code = ("import sys\nfrom ckptlab.cli import main\n"
            f"rc = main(['report', {str(empty)!r}, '-o', {str(out)!r}])\n"
            "print(rc, 'plotly' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.stdout.split() == ["2", "False"]  # refused before plotly was imported
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"ckptlab: error: {empty}") and "without checkpoint files" in line
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# readiness


def readiness_of(cli, path: Path) -> tuple[str, dict]:
    text = cli("readiness", str(path))
    assert text.stderr == "", text.stderr
    doc = cli("readiness", str(path), "--json")
    ready = json.loads(doc.stdout)["ready"]
    assert text.returncode == doc.returncode == (0 if ready else 1)  # 1: NOT READY
    return text.stdout, json.loads(doc.stdout)


def test_readiness_of_a_torch_save_file_is_as_before(made, cli) -> None:
    text, doc = readiness_of(cli, made["torch"])
    assert "storages 4 KiB aligned" in text and "storage_alignment = 4096" in text
    assert doc["format"] == "torch-zip" and doc["padding_cost_nbytes"] > 0


def test_readiness_of_a_safetensors_file(made, cli) -> None:
    text, doc = readiness_of(cli, made["safetensors"])
    assert "torch.utils.serialization" not in text and "storage_alignment" not in text
    assert "tensors 4 KiB aligned" in text and "pad the JSON header" in text
    n = int.from_bytes(made["safetensors"].read_bytes()[:8], "little")
    (f,) = doc["files"]
    assert f["data_offset"] == 8 + n and f["header_padding_nbytes"] == -(8 + n) % 4096
    ck = cl.open(made["safetensors"])
    assert {r["name"]: r["offset"] for r in f["ranges"]} == {
        t.name: t.offset for t in ck.tensors.values()}
    for r in f["ranges"]:  # listed with their absolute data offsets
        assert f"{r['offset']:,}" in text
        assert r["aligned"] == (r["offset"] % 4096 == 0)
    assert doc["padding_cost_nbytes"] is None  # no alignment what-if: no writer option


def test_a_safetensors_file_padded_as_advised_is_ready(made, tmp_path, cli) -> None:
    """Follow the advice: pad the header so the data starts at 4096; tensors whose sizes
    keep the next start on 4096 are then aligned, and safetensors still loads the file."""
    from safetensors.torch import load_file

    sd = {"a": torch.ones(1024), "b": torch.arange(2048, dtype=torch.int16)}  # 4096 B each
    header = {k: {"dtype": {"float32": "F32", "int16": "I16"}[str(v.dtype)[6:]],
                  "shape": list(v.shape), "data_offsets": [i * 4096, (i + 1) * 4096]}
              for i, (k, v) in enumerate(sd.items())}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (4096 - 8 - len(text))
    path = tmp_path / "aligned.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(raw(v) for v in sd.values()))
    assert all(torch.equal(load_file(str(path))[k], v) for k, v in sd.items())
    out, doc = readiness_of(cli, path)
    assert doc["storages_4k_aligned"] == doc["storages"] == 2
    assert "fix" not in out and doc["fixes"] == []


def test_readiness_of_a_hugging_face_directory_goes_per_shard(made, cli) -> None:
    text, doc = readiness_of(cli, made["hf"])
    shards = sorted(p.name for p in made["hf"].glob("*.safetensors"))
    assert [f["path"] for f in doc["files"]] == shards
    for shard in shards:
        assert f"fix {shard}: pad the JSON header" in text
    assert "Hugging Face directory" in text and "storage_alignment" not in text


def test_readiness_of_a_dcp_directory_goes_per_item(made, cli) -> None:
    from ckptlab.dcp import inspect_dcp

    text, doc = readiness_of(cli, made["dcp"])
    items = {i.fqn: i for i in inspect_dcp(made["dcp"]).items if i.kind == "tensor"}
    ranges = {r["name"]: r for f in doc["files"] for r in f["ranges"]}
    assert set(ranges) == set(items)
    for fqn, item in items.items():
        assert ranges[fqn]["offset"] == item.data_offset
        assert ranges[fqn]["alignment"] == item.data_alignment
    assert "AsyncWriter" in text and "storage_alignment" not in text
    assert "items 4 KiB aligned" in text


def test_a_dcp_directory_saved_by_the_async_writer_is_aligned(tmp_path, cli) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptlab.write import AsyncWriter

    writer = AsyncWriter(str(tmp_path / "aw"), workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(), storage_writer=writer)
    writer.wait()
    text, doc = readiness_of(cli, tmp_path / "aw")
    assert doc["storages_4k_aligned"] == doc["storages"] == len(state())
    assert doc["fixes"] == [] and "fix" not in text


# ---------------------------------------------------------------------------------------------
# serve


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["torch", "safetensors", "hf", "dcp"])
def test_serve_serves_every_format(monkeypatch, made, kind) -> None:
    from ckptlab import cli
    from ckptlab.widgets import quick

    calls = []
    monkeypatch.setattr(quick, "serve", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(cli._checks, "_check_listen", lambda address, port: None)
    assert main(["serve", str(made[kind])]) == 0
    assert calls == [(str(made[kind]),)]


def test_serve_refuses_an_empty_directory_in_plain_words(tmp_path) -> None:
    proc = run("serve", str(tmp_path), "--port", free_port())
    line = one_error_line(proc)
    assert str(tmp_path) in line and "directory without files" in line
    assert not re.search(r"ckptlab\.\w|\w\(\)|Error\b", line)  # no Python API names


@pytest.mark.parametrize("verb, kind", [("readiness", "hf"), ("report", "dcp")])
def test_the_real_command_exits_0_without_a_traceback(made, verb, kind, tmp_path) -> None:
    extra = ("-o", str(tmp_path / "r.html")) if verb == "report" else ()
    proc = run(verb, str(made[kind]), *extra)
    ready = verb != "readiness" or "NOT READY" not in proc.stdout  # (readiness: 1 when not)
    assert proc.returncode == (0 if ready else 1) and proc.stderr == "", proc.stderr
    assert proc.stdout.strip()
