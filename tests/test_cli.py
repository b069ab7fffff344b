"""The ckptlab command as users and scripts call it (a real subprocess each time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckptlab as cl


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptlab", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_inspect_json_schema(sample_file):
    proc = run("inspect", str(sample_file), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    layout = cl.inspect(sample_file)
    assert doc["format"] == "torch-zip"
    assert doc["path"] == str(sample_file)
    assert (doc["file_nbytes"], doc["archive_name"], doc["alignment"], doc["zip64"]) == (
        layout.file_nbytes, "sample", layout.alignment, False)
    for rec, r in zip(doc["records"], layout.records, strict=True):
        for key in ("name", "header_offset", "data_offset", "data_nbytes", "padding_nbytes",
                    "descriptor_nbytes", "end_offset"):
            assert rec[key] == getattr(r, key)
    for st, s in zip(doc["storages"], layout.storages, strict=True):
        assert {k: st[k] for k in ("key", "record", "dtype", "nbytes", "data_offset")} == {
            "key": s.key, "record": s.record, "dtype": s.dtype, "nbytes": s.nbytes,
            "data_offset": s.data_offset}
    first = doc["tensors"][0]
    assert first["path"] == ["model", "transformer.wte.weight"]
    assert (first["dtype"], first["shape"], first["stride"]) == ("float32", [256, 64], [64, 1])
    assert {"storage_key", "storage_offset"} <= set(first)
    assert {t["dtype"] for t in doc["tensors"]} >= {"bfloat16", "int64", "bool"}


def test_inspect_without_path_uses_the_embedded_sample(tmp_path):
    proc = run("inspect", "--json", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["archive_name"] == "sample" and len(doc["storages"]) > 100
    table = run("inspect", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert table.returncode == 0
    assert "transformer.wte.weight" in table.stdout and "bfloat16" in table.stdout
    assert "data/0" not in table.stdout  # tensors first; records behind --records
    records = run("inspect", "--records", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert records.returncode == 0 and "data/0" in records.stdout


def test_offsets_json(sample_file):
    proc = run("offsets", str(sample_file), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    layout = cl.inspect(sample_file)
    assert doc["offsets"] == {s.key: s.data_offset for s in layout.storages}
    assert 1 <= doc["reads"] <= 3 and doc["bytes_read"] > 0


def test_safetensors_json(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(3, 2), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(path))
    doc = json.loads(run("inspect", str(path), "--json").stdout)
    assert doc["format"] == "safetensors"
    assert sorted(s["key"] for s in doc["storages"]) == ["a", "b"]


@pytest.mark.parametrize("content, words", [
    (b"", "empty file"),
    (b"hello world, not a checkpoint", "not a checkpoint format"),
    (b"PK\x03\x04" + b"\0" * 60, "end-of-central-directory"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, content, words):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    for verb in ("inspect", "offsets"):
        proc = run(verb, str(path), "--json")
        assert proc.returncode == 2
        assert proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptlab: error: ")
        assert str(path) in lines[0] and "offset" in lines[0] and words in lines[0]
        assert "Traceback" not in proc.stderr


def test_truncated_sample_names_file_and_offset(sample_file, tmp_path):
    path = tmp_path / "cut.pt"
    path.write_bytes(sample_file.read_bytes()[:-50])
    proc = run("inspect", str(path))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"ckptlab: error: {path}") and "offset" in proc.stderr


def test_missing_file(tmp_path):
    proc = run("inspect", str(tmp_path / "nope.pt"))
    assert proc.returncode == 2 and "No such file" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_sample_verb_writes_aligned_file(tmp_path):
    out = tmp_path / "s4k.pt"
    proc = run("sample", str(out), "--alignment", "4096")
    assert proc.returncode == 0, proc.stderr
    assert cl.inspect(out).alignment == 4096
