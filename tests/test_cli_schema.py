"""The command line's ``--json`` output against the JSON Schemas kept in ``ckptlab/schemas``
(issue 27, item 4): the contract of README's *The command line* and DESIGN's *CLI contract*.

One small checkpoint of every format ``ckptlab.open`` reads is written by its real library
(torch.save zip and legacy, TorchScript, torch.export, safetensors, a Hugging Face sharded
directory, DCP directories of each serialization, a plain directory), and each output of
``ckptlab inspect PATH --json``, ``ckptlab inspect PATH --records --json`` and ``ckptlab offsets
PATH --json`` must validate (``jsonschema``, draft 2020-12): in this process through
``ckptlab.cli.main``, once as the real command, and behind a URL served by a real nginx. The
schemas themselves must be valid, must not be vacuous (a dropped key, a negative offset, a
``torch.``-prefixed dtype fail) and must list the formats, tensor kinds and dtypes the code knows.

``jsonschema`` comes with the dev extra through nbmake -> nbformat.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from ckptlab.checkpoint.model import FORMATS, KINDS
from ckptlab.cli import main
from ckptlab.errors import InvalidArgumentError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE, SAFETENSORS_PACKED, SAFETENSORS_SUBBYTE_BITS
from ckptlab.format.layout import SegmentKind
from ckptlab.schemas import NAMES, schema, schema_text
from ckptlab.testing.archives import mixed_state_dict
from ckptlab.testing.modules import Small

ROOT = Path(__file__).resolve().parents[1]
PT2_27 = ROOT / "tests" / "checkpoint" / "data" / "pt2_27_const.pt2"
TIMEOUT_S = 120

# verb -> (schema, the command's arguments around PATH)
VERBS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "inspect": ("inspect", ("inspect",), ("--json",)),
    "records": ("records", ("inspect",), ("--records", "--json")),
    "offsets": ("offsets", ("offsets",), ("--json",)),
}

# every checkpoint made below -> its `format`
MADE_FORMATS = {
    "torch-zip": "torch-zip",  # a state dict: views, an empty tensor, bool, bfloat16
    "torch-zip-training": "torch-zip",  # model, Adam state, step, every tensor kind
    "torch-zip-empty": "torch-zip",  # torch.save({})
    "torch-zip-zip64": "torch-zip",  # a sparse 4 GiB storage: zip64 extras
    "torch-legacy": "torch-legacy",
    "torchscript": "torchscript",
    "pt2": "pt2",  # torch.export.save of this torch (the archive_format layout)
    "pt2-torch27": "pt2",  # torch 2.7's layout (tests/checkpoint/data, written by torch 2.7)
    "safetensors": "safetensors",
    "hf": "hf",  # shards and model.safetensors.index.json
    "hf-single": "hf",  # model.safetensors beside config.json
    "hf-dcp-shards": "hf",  # HuggingFaceStorageWriter(save_distributed=True)
    "dcp": "dcp",  # torch.save items, with objects
    "dcp-safetensors": "dcp",  # SerializationFormat.SAFETENSORS
    "dcp-zstd": "dcp",  # the ZStandard extension: compressed chunks
    "dir": "dir",  # .pt files of both torch.save formats, a JSON file, a text file
    "deepspeed": "deepspeed",  # a ZeRO 3 run written by DeepSpeed (CPU, two gloo ranks)
    "tensorizer": "tensorizer",  # TensorSerializer.write_state_dict
}
# `--records` shows one torch.save zip or safetensors file, or a DCP directory: the rest of
# the local paths are refused in one line (behind a URL, a single file of any kind has one)
NO_RECORDS = ("torch-legacy", "torchscript", "pt2", "pt2-torch27", "hf", "hf-single",
              "hf-dcp-shards", "dir", "deepspeed")


# -- running the command -----------------------------------------------------------------------
def run_cli(*args: Any) -> tuple[int, str, str]:
    """``ckptlab ARGS`` in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def run_verb(verb: str, path: Any) -> tuple[int, str, str]:
    _, before, after = VERBS[verb]
    return run_cli(*before, path, *after)


def one_error_line(status: int, out: str, err: str) -> str:
    assert status == 2 and out == "" and "Traceback" not in err, (status, out, err)
    (line,) = err.splitlines()
    assert line.startswith("ckptlab: error: ")
    return line


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft202012Validator]:
    return {name: jsonschema.Draft202012Validator(schema(name)) for name in NAMES}


def assert_valid(validator: jsonschema.Draft202012Validator, doc: Any) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
        for e in errors[:10])


def is_valid(validator: jsonschema.Draft202012Validator, doc: Any) -> bool:
    return not any(True for _ in validator.iter_errors(doc))


# -- the checkpoints ---------------------------------------------------------------------------
class Made(dict):
    """The checkpoints this torch (and this machine) could write; asking for another skips."""

    def __missing__(self, kind: str) -> Path:
        pytest.skip(f"torch {torch.__version__} here cannot write a {kind!r} checkpoint")


def training_checkpoint() -> dict[str, Any]:
    """A model's state dict, its Adam optimizer state after one step, the step and lr, and a
    tensor of every kind: sparse (COO, CSR), quantized (per tensor, per channel), nested
    (strided: no shape in the metadata; jagged), a Tensor subclass."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]),
                                  torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "lr": 1e-3,
        "extra": {
            "coo": coo, "csr": coo.to_sparse_csr(),
            "q": torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 10, torch.quint8),
            "qc": torch.quantize_per_channel(torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]),
                                             torch.tensor([1, 2, 3]), 0, torch.qint8),
            "nested": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
            "jagged": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(1, 3)],
                                                 layout=torch.jagged),
            "two": TwoTensor(torch.randn(3), torch.randn(3)),
            "f8": torch.randn(4).to(torch.float8_e4m3fn), "scalar": torch.tensor(7),
            "param": torch.nn.Parameter(torch.randn(2)),
        },
    }


def save_zip64(path: Path) -> bool:
    """A torch.save zip whose one storage is 4 GiB (a zip64 record), written sparse: the
    storage is never touched and ``skip_data`` seeks past it. False where this machine cannot
    (no 4 GiB of address space, or a file system that does not keep holes)."""
    if shutil.disk_usage(path.parent).free < 1 << 30:
        return False
    try:
        big = torch.empty(1 << 32, dtype=torch.uint8)
    except RuntimeError:
        return False
    with torch.serialization.skip_data():
        torch.save({"big": big, "small": torch.ones(3)}, path)
    st = path.stat()
    if getattr(st, "st_blocks", 0) * 512 > 64 << 20:
        path.unlink()
        return False
    return True


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """One checkpoint of each kind of :data:`MADE_FORMATS`, each written by its real library."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter, filesystem

    base = tmp_path_factory.mktemp("schema")
    out = Made()
    sd = {"emb.weight": torch.randn(6, 4), "ln.bias": torch.randn(4).bfloat16(),
          "steps": torch.arange(5)}

    torch.save(mixed_state_dict(), base / "model.pt")
    out["torch-zip"] = base / "model.pt"
    with warnings.catch_warnings():  # sparse invariants, deprecated quantization
        warnings.simplefilter("ignore")
        torch.save(training_checkpoint(), base / "training.pt")
    out["torch-zip-training"] = base / "training.pt"
    torch.save({}, base / "empty.pt")
    out["torch-zip-empty"] = base / "empty.pt"
    if save_zip64(base / "zip64.pt"):
        out["torch-zip-zip64"] = base / "zip64.pt"
    torch.save(sd, base / "legacy.pt", _use_new_zipfile_serialization=False)
    out["torch-legacy"] = base / "legacy.pt"
    with warnings.catch_warnings():  # torch.jit is deprecated
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(Small()), str(base / "scripted.pt"))
        program = torch.export.export(Small(), (torch.randn(1, 3),))
        torch.export.save(program, base / "exported.pt2")
    out["torchscript"] = base / "scripted.pt"
    out["pt2"] = base / "exported.pt2"
    shutil.copy(PT2_27, base / PT2_27.name)  # under the served root too
    out["pt2-torch27"] = base / PT2_27.name

    save_file(sd, str(base / "model.safetensors"), metadata={"format": "pt"})
    out["safetensors"] = base / "model.safetensors"
    hf = base / "hf"
    hf.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["emb.weight"],
              "model-00002-of-00002.safetensors": ["ln.bias", "steps"]}
    for shard, names in shards.items():
        save_file({n: sd[n] for n in names}, str(hf / shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.nbytes for t in sd.values())},
        "weight_map": {n: shard for shard, names in shards.items() for n in names}}))
    out["hf"] = hf
    single = base / "hf-single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"))
    (single / "config.json").write_text(json.dumps({"hidden_size": 4, "model_type": "tiny"}))
    out["hf-single"] = single

    fmt = getattr(filesystem, "SerializationFormat", None)  # torch >= 2.8
    try:
        import zstandard  # noqa: F401  (DCP's extension writes with it)
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        ZStandard = None
    hf_writer = getattr(dcp, "HuggingFaceStorageWriter", None)
    writers: dict[str, Callable[[str], Any] | None] = {
        "dcp": FileSystemWriter,
        "dcp-safetensors": fmt and (lambda p: FileSystemWriter(
            p, serialization_format=fmt.SAFETENSORS)),
        "dcp-zstd": ZStandard and (lambda p: FileSystemWriter(p, _extensions=[ZStandard()])),
        "hf-dcp-shards": hf_writer and (lambda p: hf_writer(p, save_distributed=True)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, writer in writers.items():
            if writer is None:
                continue
            state: dict[str, Any] = {"model": dict(sd), "step": 7, "cfg": {"lr": 0.5}}
            if kind == "hf-dcp-shards":  # tensors only, flat
                state = {k: v for k, v in sd.items() if v.is_floating_point()}
            dcp.save(state, storage_writer=writer(str(base / kind)), no_dist=True)
            out[kind] = base / kind

    plain = base / "dir"
    plain.mkdir()
    torch.save({"w": torch.randn(2, 2)}, plain / "a.pt")
    torch.save({"v": torch.ones(3)}, plain / "b.pt", _use_new_zipfile_serialization=False)
    (plain / "meta.json").write_text(json.dumps({"epoch": 3}))
    (plain / "README.txt").write_text("notes\n")
    out["dir"] = plain
    if importlib.util.find_spec("tensorizer") is not None or os.environ.get("CI"):
        from tensorizer import TensorSerializer

        serializer = TensorSerializer(str(base / "model.tensors"))
        serializer.write_state_dict({**sd, "nested": {"w": torch.ones(2, 3).bfloat16()}})
        serializer.close()
        out["tensorizer"] = base / "model.tensors"
    if importlib.util.find_spec("deepspeed") is not None or os.environ.get("CI"):
        from ckptlab.testing.deepspeed_run import write_run

        out["deepspeed"] = write_run(3, base / "deepspeed", port=29637)
    return out


# -- every format, every verb -------------------------------------------------------------------
def _cases() -> list[Any]:
    cases = []
    for kind in MADE_FORMATS:
        for verb in VERBS:
            if verb == "records" and kind in NO_RECORDS:
                continue
            cases.append(pytest.param(kind, verb, id=f"{verb}-{kind}"))
    return cases


def check_beyond_schema(verb: str, kind: str, doc: dict[str, Any]) -> None:
    """What a schema cannot say: the format of each checkpoint, and keys that must agree."""
    if verb == "inspect":
        assert doc["format"] == MADE_FORMATS[kind]
        files = {f["path"] for f in doc["files"]}
        for t in doc["tensors"]:
            assert {p["file"] for p in t["parts"]} <= files, t["name"]
        segments = doc["segments"]  # a single file's tile it; a directory has none
        if len(doc["files"]) == 1 and doc["format"] != "dcp":
            assert segments and segments[0]["offset"] == 0
            for a, b in itertools.pairwise(segments):
                assert a["offset"] + a["nbytes"] == b["offset"], (a, b)
            assert segments[-1]["offset"] + segments[-1]["nbytes"] == doc["files"][0]["nbytes"]
        else:
            assert segments == []
    elif verb == "records":
        assert doc["format"] == MADE_FORMATS[kind]
    elif doc["method"] in ("cursor", "central_directory"):
        assert doc["format"] == "torch-zip" == MADE_FORMATS[kind]
    else:
        assert doc["format"] == MADE_FORMATS[kind]
        keys = set(doc["offsets"])
        assert set(doc["files"]) == set(doc["nbytes"]) == set(doc["tensors"]) == keys
        assert set(doc.get("compression", {})) <= keys


@pytest.mark.parametrize(("kind", "verb"), _cases())
def test_json_output_matches_its_schema(made, validators, kind: str, verb: str) -> None:
    status, out, err = run_verb(verb, made[kind])
    assert status == 0 and err == "", err
    doc = json.loads(out)
    assert_valid(validators[VERBS[verb][0]], doc)
    check_beyond_schema(verb, kind, doc)


@pytest.mark.parametrize("kind", NO_RECORDS)
def test_records_of_a_checkpoint_without_one_layout_is_one_error_line(made, kind: str) -> None:
    line = one_error_line(*run_verb("records", made[kind]))
    assert os.path.basename(str(made[kind])) in line


def test_the_checkpoints_cover_every_format_and_tensor_kind(made) -> None:
    assert set(MADE_FORMATS.values()) == set(FORMATS)
    status, out, _ = run_verb("inspect", made["torch-zip-training"])
    doc = json.loads(out)
    assert status == 0 and {t["kind"] for t in doc["tensors"]} == set(KINDS)
    assert any(t["shape"] is None for t in doc["tensors"])  # strided nested: shape unknown
    assert any(-1 in (t["shape"] or ()) for t in doc["tensors"])  # jagged: ragged dimension
    assert any(t["name"].startswith("optimizer.state.") for t in doc["tensors"])
    if "torch-zip-zip64" in made:
        status, out, _ = run_verb("inspect", made["torch-zip-zip64"])
        assert status == 0 and json.loads(out)["zip64"] is True
    if "dcp-zstd" in made:
        status, out, _ = run_verb("offsets", made["dcp-zstd"])
        assert status == 0 and set(json.loads(out)["compression"].values()) == {"zstd"}
    status, out, _ = run_verb("offsets", made["torch-legacy"])
    doc = json.loads(out)  # no header-only reader: the model's offsets, reads not counted
    assert (doc["method"], doc["reads"], doc["uncounted_files"]) == ("model", None, ["legacy.pt"])


def test_the_real_command_prints_valid_json(made, validators) -> None:
    """One run of each schema's verb as a user runs it (its own process, stdout a pipe)."""
    for verb, kind in (("inspect", "torch-zip-training"), ("offsets", "dcp")):
        _, before, after = VERBS[verb]
        proc = subprocess.run([sys.executable, "-m", "ckptlab", *before, str(made[kind]), *after],
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.count("\n") == 1  # one compact line in a pipe
        assert_valid(validators[VERBS[verb][0]], json.loads(proc.stdout))


# -- behind a URL ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(made):
    pytest.importorskip("fsspec", reason="the 'remote' extra (fsspec, aiohttp) is not installed")
    pytest.importorskip("aiohttp", reason="the 'remote' extra (fsspec, aiohttp) is not installed")
    from ckptlab.testing.nginx import NGINX_MISSING, NginxServer, nginx_executable

    if nginx_executable() is None:
        if os.environ.get("CI"):
            pytest.fail(NGINX_MISSING)
        pytest.skip(NGINX_MISSING)
    with NginxServer(made["torch-zip"].parent) as s:
        yield s


# (checkpoint, the URL's path under the served root, verbs); a URL of one file has a layout
# for --records whatever its kind (the local path refuses TorchScript, torch.export, legacy)
URL_CASES = (
    ("torch-zip-training", "training.pt", ("inspect", "records", "offsets")),
    ("torch-legacy", "legacy.pt", ("inspect", "records", "offsets")),
    ("torchscript", "scripted.pt", ("inspect", "records", "offsets")),
    ("pt2", "exported.pt2", ("inspect", "records", "offsets")),
    ("pt2-torch27", PT2_27.name, ("inspect", "offsets")),
    ("safetensors", "model.safetensors", ("inspect", "records", "offsets")),
    ("hf", "hf/model.safetensors.index.json", ("inspect", "offsets")),
    ("dcp", "dcp/", ("inspect", "records", "offsets")),
    ("dcp-zstd", "dcp-zstd/.metadata", ("inspect", "records", "offsets")),
)


def _url_cases() -> list[Any]:
    cases = []
    for kind, rel, verbs in URL_CASES:
        for verb in verbs:
            cases.append(pytest.param(kind, rel, verb, id=f"{verb}-{kind}"))
    return cases


@pytest.mark.parametrize(("kind", "rel", "verb"), _url_cases())
def test_json_output_of_a_url_matches_its_schema(made, server, validators, kind: str, rel: str,
                                                 verb: str) -> None:
    made[kind]  # skips a checkpoint this torch could not write
    status, out, err = run_verb(verb, server.url(rel))
    assert status == 0 and err == "", err
    doc = json.loads(out)
    assert_valid(validators[VERBS[verb][0]], doc)
    assert doc["format"] == MADE_FORMATS[kind]


@pytest.mark.parametrize(("kind", "rel"), [("torchscript", "scripted.pt"),
                                         ("pt2", "exported.pt2"),
                                         ("pt2-torch27", PT2_27.name),
                                         ("torch-legacy", "legacy.pt")])
def test_offsets_of_a_url_of_no_torch_save_archive_are_the_local_ones(
        made, server, kind: str, rel: str) -> None:
    """A file that is no torch.save archive (a zip told by its records, a legacy file) behind
    a URL: the offsets of its model, read from the bytes the first request moved (not asked
    for again); ``reads`` are the requests nginx answered."""
    status, out, err = run_verb("offsets", made[kind])
    assert status == 0, err
    local = json.loads(out)
    server.mark()
    status, out, err = run_verb("offsets", server.url(rel))
    seen = server.requests()
    assert status == 0 and err == "", err
    doc = json.loads(out)
    for key in ("offsets", "nbytes", "tensors", "format"):
        assert doc[key] == local[key], key
    assert doc["reads"] == len(seen) == 1, seen  # a small zip arrives whole in the first
    assert doc["bytes_read"] == sum(r.body_nbytes for r in seen)


# -- the schemas are not vacuous -----------------------------------------------------------------
@pytest.fixture(scope="module")
def docs(made) -> dict[str, dict[str, Any]]:
    """Valid documents to break: each schema's shapes."""
    out = {}
    for name, verb, kind in (("inspect", "inspect", "torch-zip-training"),
                             ("inspect-dcp", "inspect", "dcp"),
                             ("records", "records", "torch-zip-training"),
                             ("records-dcp", "records", "dcp"),
                             ("offsets-storage", "offsets", "torch-zip-training"),
                             ("offsets-parts", "offsets", "hf"),
                             ("offsets-model", "offsets", "torch-legacy")):
        status, text, err = run_verb(verb, made[kind])
        assert status == 0, err
        out[name] = json.loads(text)
    return out


def _sparse(doc: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["kind"] == "sparse")


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        at: Any = doc
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
    return mutate


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        at: Any = doc
        for key in path[:-1]:
            at = at[key]
        del at[path[-1]]
    return mutate


def _first_key(section: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc[section][next(iter(doc[section]))] = value
    return mutate


# (document, schema, what breaks it)
BROKEN: dict[str, tuple[str, str, Callable[[dict[str, Any]], None]]] = {
    "no tensors": ("inspect", "inspect", _drop(("tensors",))),
    "no files": ("inspect", "inspect", _drop(("files",))),
    "no zip64": ("inspect", "inspect", _drop(("zip64",))),
    "unknown format": ("inspect", "inspect", _set(("format",), "zip")),
    "file_nbytes a string": ("inspect", "inspect", _set(("file_nbytes",), "1725")),
    "alignment 3": ("inspect", "inspect", _set(("alignment",), 3)),
    "torch.-prefixed dtype": ("inspect", "inspect", _set(("tensors", 0, "dtype"),
                                                         "torch.float32")),
    "unknown kind": ("inspect", "inspect", _set(("tensors", 0, "kind"), "dense-ish")),
    "tensor without a name": ("inspect", "inspect", _drop(("tensors", 0, "name"))),
    "tensor without parts": ("inspect", "inspect", _drop(("tensors", 0, "parts"))),
    "negative shape": ("inspect", "inspect", _set(("tensors", 0, "shape"), [-2, 3])),
    "two ragged dimensions": ("inspect", "inspect", _set(("tensors", 0, "shape"), [2, -1, -1])),
    "negative stride": ("inspect", "inspect", _set(("tensors", 0, "stride"), [-1, 1])),
    "negative part offset": ("inspect", "inspect", _set(("tensors", 0, "parts", 0, "offset"),
                                                        -1)),
    "float part nbytes": ("inspect", "inspect", _set(("tensors", 0, "parts", 0, "nbytes"), 1.5)),
    "part without a role": ("inspect", "inspect", _drop(("tensors", 0, "parts", 0, "role"))),
    "part without a file": ("inspect", "inspect", _drop(("tensors", 0, "parts", 0, "file"))),
    "file without nbytes": ("inspect", "inspect", _drop(("files", 0, "nbytes"))),
    "unknown file format": ("inspect", "inspect", _set(("files", 0, "format"), "zip")),
    "storage without data_offset": ("inspect", "inspect", _drop(("storages", 0, "data_offset"))),
    "record without end_offset": ("inspect", "inspect", _drop(("records", 0, "end_offset"))),
    "crc32 past 32 bits": ("inspect", "inspect", _set(("records", 0, "crc32"), 1 << 32)),
    "no segments": ("inspect", "inspect", _drop(("segments",))),
    "dcp without items": ("inspect-dcp", "inspect", _drop(("items",))),
    "item without fqn": ("inspect-dcp", "inspect", _drop(("items", 0, "fqn"))),
    "negative chunk offset": ("inspect-dcp", "inspect", _set(("items", -1, "chunk_offsets"),
                                                             [-1, 0])),
    "negative item nbytes": ("inspect-dcp", "inspect", _set(("items", 0, "nbytes"), -8)),
    "layout tensor without storage_key": ("records", "records",
                                          _drop(("tensors", 0, "storage_key"))),
    "records dcp format": ("records", "records", _set(("format",), "dcp")),
    "dcp records not empty": ("records-dcp", "records",
                              lambda d: d["records"].append({"name": "x"})),
    "dcp tensor without chunks": ("records-dcp", "records", _drop(("tensors", 0, "chunks"))),
    "negative storage offset": ("offsets-storage", "offsets", _first_key("offsets", -64)),
    "storage reads not counted": ("offsets-storage", "offsets", _set(("reads",), None)),
    "storage method headers": ("offsets-storage", "offsets", _set(("method",), "headers")),
    "storage offsets no format": ("offsets-storage", "offsets", _drop(("format",))),
    "negative part offset key": ("offsets-parts", "offsets", _first_key("offsets", -1)),
    "parts without nbytes": ("offsets-parts", "offsets", _drop(("nbytes",))),
    "parts without uncounted_files": ("offsets-parts", "offsets", _drop(("uncounted_files",))),
    "parts method cursor": ("offsets-parts", "offsets", _set(("method",), "cursor")),
    "parts format torch-zip": ("offsets-parts", "offsets", _set(("format",), "torch-zip")),
    "read_per_file how unknown": ("offsets-parts", "offsets",
                                  lambda d: next(iter(d["read_per_file"].values())).update(
                                      how="guessed")),
    "reads null with method headers": ("offsets-model", "offsets",
                                       _set(("method",), "headers")),
}


@pytest.mark.parametrize("what", BROKEN)
def test_a_broken_document_fails_validation(docs, validators, what: str) -> None:
    source, name, mutate = BROKEN[what]
    doc = copy.deepcopy(docs[source])
    assert is_valid(validators[name], doc)
    mutate(doc)
    assert not is_valid(validators[name], doc), what


def test_extra_fields_are_welcome(docs, validators) -> None:
    for source, name in (("inspect", "inspect"), ("inspect-dcp", "inspect"),
                         ("records", "records"), ("offsets-storage", "offsets"),
                         ("offsets-parts", "offsets")):
        doc = copy.deepcopy(docs[source])
        doc["new_field"] = {"anything": [1, None]}
        for key in ("tensors", "records", "storages", "files", "items", "segments"):
            entries = doc.get(key)
            for entry in entries if isinstance(entries, list) else ():  # offsets: key maps
                entry["new_field"] = "x"
                for part in entry.get("parts", ()):
                    part["new_field"] = 1
        assert_valid(validators[name], doc)
    sparse = copy.deepcopy(docs["inspect"])
    _sparse(sparse)["parts"][0]["compression"] = "zstd"  # a compressed part names its size
    assert not is_valid(validators["inspect"], sparse)


# -- the schemas themselves ----------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    doc = schema(name)
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(doc)
    assert schema(name) is not schema(name) and json.loads(schema_text(name)) == doc


def test_schemas_list_what_the_code_emits() -> None:
    inspect, records = schema("inspect")["$defs"], schema("records")["$defs"]
    for defs in (inspect, records):
        dtypes = defs["dtype"]["enum"]
        assert len(dtypes) == len(set(dtypes))
        assert set(dtypes) == set(DTYPE_ITEMSIZE) | {
            tag.lower() for tag in SAFETENSORS_SUBBYTE_BITS if tag not in SAFETENSORS_PACKED}
        assert not any(d.startswith("torch.") for d in dtypes)
        assert defs["segment"]["properties"]["kind"]["enum"] == [k.value for k in SegmentKind]
    assert inspect["format"]["enum"] == list(FORMATS)
    assert inspect["tensor"]["properties"]["kind"]["enum"] == list(KINDS)
    parts = schema("offsets")["$defs"]["part_offsets"]["properties"]["format"]["enum"]
    assert set(parts) == set(FORMATS) - {"torch-zip"}
    # the definitions both byte-level schemas use are the same
    shared = set(inspect) & set(records)
    assert shared >= {"record", "storage", "segment", "item", "dtype", "alignment"}
    for key in shared:
        assert inspect[key] == records[key], key


def test_schemas_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["ckptlab.schemas"]
    shipped = sorted(p.name for p in (ROOT / "ckptlab" / "schemas").glob("*.json"))
    assert shipped == sorted(f"{n}.schema.json" for n in NAMES)
    assert all(any(Path(name).match(g) for g in globs) for name in shipped)
    with pytest.raises(InvalidArgumentError, match="no schema 'nope'"):
        schema("nope")
