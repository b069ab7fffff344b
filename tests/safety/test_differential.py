"""``ckptlab.scan`` held to the loaders themselves (issue 29's proof).

- Every payload of :mod:`ckptlab.testing.payloads`, in every file that carries a pickle, is
  loaded for real in a subprocess (:mod:`ckptlab.testing.torch_oracle`); each leaves its
  sentinel file, which proves it live, and each is ``code``: **0 misses**.
- ``weights_only.accepted`` equals what ``torch.load(weights_only=True)`` does, for every
  file here: the payloads, the benign data shapes, and files real libraries wrote.
- No file a real library wrote is ``code``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.testing.payloads import carriers, payloads
from ckptlab.testing.torch_oracle import run_oracle

LOADER = {".npy": "numpy", ".npz": "numpy"}


def _loader(path: str) -> str:
    return LOADER.get(os.path.splitext(path)[1], "torch")


@pytest.fixture(scope="module")
def payload_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``{file: sentinel}``: one file per payload and carrier."""
    root = tmp_path_factory.mktemp("payloads")
    names = sorted(payloads(str(root / "probe"), str(root)))
    out = {}
    for name in names:
        for carrier in carriers(b"\x80\x02N.").keys():
            sentinel = str(root / f"ran-{carrier}-{name}")
            pkl = payloads(sentinel, str(root))[name]
            suffix, data = carriers(pkl)[carrier]
            path = root / f"{carrier}-{name}{suffix}"
            path.write_bytes(data)
            out[str(path)] = sentinel
    return out


@pytest.fixture(scope="module")
def benign_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Files of plain data: what torch.load allows, and what needs weights_only=False
    without running code."""
    root = tmp_path_factory.mktemp("benign")
    sd = torch.nn.Linear(3, 2).state_dict()
    cases = {
        "state_dict": sd,
        "parameter": {"p": torch.nn.Parameter(torch.ones(2))},
        "shapes": {"size": torch.Size([2, 3]), "dev": torch.device("cpu"),
                   "dtype": torch.bfloat16, "set": {1, 2}, "bytes": bytearray(b"ab"),
                   "complex": 1 + 2j, "counter": collections.Counter("aab")},
        "namespace": {"args": argparse.Namespace(lr=0.1), "w": torch.ones(1)},
        "numpy": {"a": np.arange(3)},
        "datetime": {"when": datetime.datetime(2026, 1, 1)},
        "path": {"p": pathlib.PurePosixPath("/tmp/x")},
        "ordered": collections.OrderedDict(a=torch.zeros(2)),
        "sparse": {"s": torch.eye(3).to_sparse()},
        "quantized": {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
        "module": torch.nn.Sequential(torch.nn.Linear(2, 2)),
        "optimizer": torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).state_dict(),
    }
    out = []
    for name, obj in cases.items():
        for protocol in (2, 4):
            path = root / f"{name}-p{protocol}.pt"
            torch.save(obj, path, pickle_protocol=protocol)
            out.append(str(path))
        path = root / f"{name}-legacy.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=False)
        out.append(str(path))
    path = root / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": [1, 2.0, "x"]}))
    out.append(str(path))
    # a benign data.pkl with a payload after its STOP: torch never runs the payload
    from ckptlab.testing.pickles import torch_zip

    evil_tail = pickle.dumps(__import__("ckptlab.testing.payloads").testing.payloads.Reduce(
        os.system, (f"touch {root / 'ran-after-stop'}",)), protocol=2)
    path = root / "after-stop.pt"
    path.write_bytes(torch_zip(b"\x80\x02}." + evil_tail))
    out.append(str(path))
    np.save(root / "objects.npy", np.array([{"a": 1}, [2]], dtype=object), allow_pickle=True)
    out.append(str(root / "objects.npy"))
    return out


@pytest.fixture(scope="module")
def library_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Files transformers, diffusers and DCP wrote with their own save functions."""
    import transformers

    root = tmp_path_factory.mktemp("libraries")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32,
                                     n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2",
                                                          safe_serialization=False)
    args = transformers.TrainingArguments(output_dir=str(root / "out"), report_to=[])
    torch.save(args, root / "training_args.bin")
    import diffusers

    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=2,
                                  layers_per_block=1)
    vae.save_pretrained(root / "vae", safe_serialization=False)
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4), "extra": {"step": 3, "note": "x"}},
             checkpoint_id=str(root / "dcp"), no_dist=True)
    files = [str(p) for p in sorted(root.rglob("*")) if p.is_file()
             and p.suffix in (".bin", ".pt")]
    return files + [str(root / "dcp")]


def _scan_one(path: str) -> ckptlab.safety.FileSafety:
    report = ckptlab.scan(path)
    assert len(report.files) == 1, (path, report.summary())
    return report.files[0]


def test_every_live_payload_is_code(payload_files: dict[str, str], tmp_path) -> None:
    files = [(p, _loader(p)) for p in payload_files]
    run_oracle(files, "unsafe", cwd=str(tmp_path))
    live = {p for p, s in payload_files.items() if os.path.exists(s)}
    dead = sorted(set(payload_files) - live)
    assert not dead, f"payloads that did not run under their loader: {dead}"
    misses = [(p, r.verdict) for p in sorted(live) if (r := _scan_one(p)).verdict != "code"]
    assert not misses, misses
    assert len(live) >= 200


def test_weights_only_matches_torch(payload_files: dict[str, str], benign_files: list[str],
                                    library_files: list[str], tmp_path) -> None:
    paths = [p for p in [*payload_files, *benign_files, *library_files]
             if not os.path.isdir(p)]
    oracle = run_oracle([(p, "torch") for p in paths], "safe", cwd=str(tmp_path))
    wrong = []
    for path in paths:
        wo = _scan_one(path).weights_only
        if wo.accepted != oracle[path]["ok"]:
            wrong.append((os.path.basename(path), wo.accepted, wo.reason, oracle[path]["error"]))
    assert not wrong, wrong


def test_no_library_file_is_code(library_files: list[str]) -> None:
    for path in library_files:
        report = ckptlab.scan(path)
        assert report.files, path
        for f in report.files:
            assert f.verdict in ("weights-only", "data"), (path, f.verdict, f.notes,
                                                           [c.to_dict() for c in f.code_calls])


def test_a_dcp_data_file_is_read_as_its_metadata_places_its_items(
        library_files: list[str]) -> None:
    root = next(p for p in library_files if os.path.isdir(p))
    whole = ckptlab.scan(root)
    assert [f.kind for f in whole.files] == ["dcp-metadata", "dcp data file"]
    assert whole.files[0].loader.startswith("pickle.load")
    assert whole.headline().startswith("DATA: pickle.load (dcp.load) runs .metadata without "
                                       "weights_only")
    # each item is a torch.save of its own, scanned: the bytes item too
    assert any("item extra.note" in p for p in whole.files[1].pickles), whole.files[1].pickles
    one = ckptlab.scan(os.path.join(root, "__0_0.distcp"))
    assert [f.kind for f in one.files] == ["dcp-metadata", "dcp data file"]


def test_benign_files_are_never_code(benign_files: list[str], tmp_path) -> None:
    run_oracle([(p, _loader(p)) for p in benign_files], "unsafe", cwd=str(tmp_path))
    assert not os.path.exists(os.path.join(os.path.dirname(benign_files[0]), "ran-after-stop"))
    for path in benign_files:
        f = _scan_one(path)
        assert f.verdict in ("weights-only", "data"), (path, f.verdict,
                                                       [c.to_dict() for c in f.code_calls])


def test_the_state_dict_torch_writes_is_weights_only(tmp_path) -> None:
    path = tmp_path / "sd.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    f = _scan_one(str(path))
    assert f.verdict == "weights-only" and f.weights_only.accepted
    assert {c.klass for c in f.calls} == {"torch"}
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(a=1)}, buf)
    (tmp_path / "ns.pt").write_bytes(buf.getvalue())
    f = _scan_one(str(tmp_path / "ns.pt"))
    assert f.verdict == "data" and f.weights_only.refused == "argparse.Namespace"


def _flipped(data: bytes, regions: list[tuple[int, int]], count: int, rng: Any,
             stem: Path) -> list[str]:
    """``count`` files of ``data`` with one or two bytes changed, each in a region picked
    from ``regions``, named ``<stem>-<i>.pt``."""
    files = []
    for i in range(count):
        mutated = bytearray(data)
        lo, hi = rng.choice(regions)
        for _ in range(rng.randint(1, 2)):
            mutated[rng.randrange(lo, hi)] = rng.randrange(256)
        path = stem.parent / f"{stem.name}-{i}.pt"
        path.write_bytes(bytes(mutated))
        files.append(str(path))
    return files


def _against_torch(files: list[str], cwd: Path) -> tuple[list[Any], int, int]:
    """Each file's ``weights_only`` against ``torch.load(weights_only=True)``: the decided
    answers that differ, how many were decided, how many were not. A file left without a
    pickle must fail in torch too."""
    oracle = run_oracle([(p, "torch") for p in files], "safe", cwd=str(cwd))
    wrong, decided, undecided = [], 0, 0
    for path in files:
        report = ckptlab.scan(path)
        if not report.files:  # no pickle left: torch fails too
            assert not oracle[path]["ok"], path
            continue
        wo = report.files[0].weights_only
        if not wo.decided:
            undecided += 1
            continue
        decided += 1
        if wo.accepted != oracle[path]["ok"]:
            wrong.append((os.path.basename(path), wo.reason, oracle[path]["error"]))
    return wrong, decided, undecided


def test_weights_only_matches_torch_on_mutated_files(tmp_path) -> None:
    """Byte flips in the pickles of a torch.save zip and a legacy file: where ckptlab decides
    (``weights_only.decided``), its answer is torch's; it declines to decide on few."""
    import random
    import zipfile

    rng = random.Random(29)
    files = []
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save({"a": torch.ones(3), "b": torch.arange(4)}, buf,
                   _use_new_zipfile_serialization=not legacy)
        data = buf.getvalue()
        if legacy:
            lo, hi = 0, 400
        else:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                info = z.getinfo("archive/data.pkl")
            lo = data.index(b"\x80\x02", info.header_offset)
            hi = lo + info.file_size
        files += _flipped(data, [(lo, hi)], 60, rng, tmp_path / ("legacy" if legacy else "zip"))
    wrong, _, undecided = _against_torch(files, tmp_path)
    assert not wrong, wrong
    assert undecided <= len(files) // 10, undecided


def test_weights_only_on_damaged_zip_structure_is_torch_answer_or_undecided(tmp_path) -> None:
    """Byte flips in local headers, the central directory and the end records. ckptlab's zip
    reader checks more than torch's (miniz reads records by the central directory): where
    it refuses what torch might read, ``decided`` is false; where it decides, it is torch's
    answer."""
    import random
    import zipfile

    rng = random.Random(31)
    buf = io.BytesIO()
    torch.save({"a": torch.ones(3), "b": torch.arange(4)}, buf)
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        regions = [(i.header_offset, i.header_offset + 30 + len(i.filename))
                   for i in z.infolist()]
    regions.append((data.find(b"PK\x01\x02"), len(data)))
    files = _flipped(data, regions, 100, rng, tmp_path / "z")
    wrong, decided, _ = _against_torch(files, tmp_path)
    assert not wrong, wrong
    assert decided >= 20, decided  # (in this run's files: about a third)
