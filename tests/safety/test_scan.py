"""``ckptlab.scan``: the documented classes, each kind of file that holds a pickle, the CLI's
lines, JSON and exit status, URLs, and bad input (truncations and mutations never raise
anything but a report, and nothing from the file runs)."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import tarfile
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab.cli import main
from ckptlab.errors import InvalidArgumentError
from ckptlab.safety import classify
from ckptlab.safety._pickle_scan import render
from ckptlab.testing.payloads import Reduce, raw
from ckptlab.testing.pickles import torch_zip


# -- the classes -----------------------------------------------------------------------------
@pytest.mark.parametrize(("module", "name", "uses", "klass"), [
    ("builtins", "eval", {"call"}, "code"),
    ("__builtin__", "exec", {"call"}, "code"),  # Python 2's name, as the unpickler maps it
    ("builtins", "getattr", {"name"}, "code"),
    ("builtins", "set", {"call"}, "data"),
    ("posix", "system", {"call"}, "code"),
    ("os.path", "join", {"name"}, "code"),
    ("subprocess", "Popen", {"new"}, "code"),
    ("timeit", "timeit", {"call"}, "code"),
    ("torch.serialization", "load", {"call"}, "code"),
    ("torch.fx.graph_module", "reduce_graph_module", {"call"}, "code"),
    ("torch", "serialization.os.system", {"call"}, "code"),  # a dotted name: getattr
    ("functools", "reduce", {"call"}, "code"),
    ("functools", "partial", {"call"}, "data"),
    ("argparse", "Namespace", {"new"}, "data"),
    ("collections", "OrderedDict", {"call"}, "data"),
    ("datetime", "datetime", {"call"}, "data"),
    ("myproject.config", "TrainConfig", {"new"}, "data"),  # a user's class, created
    ("myproject.config", "Mode", {"call"}, "data"),  # a class called: an enum member
    ("myproject.config", "Outer.Inner", {"new"}, "data"),  # a nested class
    ("myproject.tools", "run", {"call"}, "code"),  # a function ckptlab does not know, called
    ("myproject.tools", "run", {"name"}, "data"),  # only referred to
    ("argparse", "Namespace", {"new", "build"}, "code"),  # BUILD on the class itself
    ("torch._utils", "_rebuild_tensor_v2", {"call"}, "torch"),
])
def test_documented_classes(module: str, name: str, uses: set[str], klass: str) -> None:
    allowed = frozenset({"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"})
    got, why = classify(module, name, uses, torch_allowed=allowed)
    assert got == (klass if f"{module}.{name}" not in allowed or "build" in uses
                   else "torch"), (module, name, why)
    assert why


def test_render_is_bounded_and_inert() -> None:
    assert render(("ls", 1, b"x", None)) == "('ls', 1, b'x', None)"
    assert render(("x",)) == "('x',)"
    long = render(["a" * 1000] * 1000)
    assert len(long) <= 160 and long.endswith("...")
    deep: object = ()
    for _ in range(10_000):
        deep = (deep,)
    assert len(render(deep)) <= 160
    assert "bits" in render(1 << 4000)


# -- kinds of files --------------------------------------------------------------------------
def _one(path) -> ckptlab.safety.FileSafety:
    report = ckptlab.scan(path)
    assert len(report.files) == 1, report.summary()
    return report.files[0]


def test_a_call_shows_the_persistent_id_it_is_given_and_long_args_are_cut(tmp_path) -> None:
    """A rebuild call's storage argument is the persistent_load call the unpickler would make
    (the id written down, nothing loaded); arguments past 160 characters end in '...'."""
    path = tmp_path / "p.pt"
    torch.save({"tail": torch.arange(10.0)[4:], "p": torch.nn.Parameter(torch.ones(2))}, path)
    calls = {c.global_: c.args for c in _one(path).calls}
    assert calls["torch._utils._rebuild_tensor_v2"] == (
        "persistent_load(('storage', torch.FloatStorage, '0', 'cpu', 10)), 4, (6,), (1,), "
        "False, collections.OrderedDict()")
    wrapped = calls["torch._utils._rebuild_parameter"]
    assert len(wrapped) == 160 and wrapped.endswith("...")
    assert wrapped.startswith("torch._utils._rebuild_tensor_v2(persistent_load(('storage', "
                              "torch.FloatStorage, '1', 'cpu', 2)), 0, (2,), (1,), False")


def test_each_call_says_where_in_the_loaded_object_it_sits(tmp_path) -> None:
    """A call's ``where`` is the key path of the value it makes (a payload's key, a tensor's
    name for its rebuild call), and the command line names it."""
    path = tmp_path / "nested.pt"
    torch.save({"w": torch.ones(2), "cfg": {"hooks": [1, Reduce(os.system, ("echo hi",))]}},
               path)
    f = _one(path)
    where = {c.global_: c.where for c in f.calls}
    assert where["posix.system"] == "cfg.hooks.1"
    assert where["torch._utils._rebuild_tensor_v2"] == "w"  # the first call: tensor w's
    assert where["torch.FloatStorage"] is None  # named, never called: no value of its own
    assert all(c.to_dict()["where"] == c.where for c in f.calls)
    line = next(x for x in ckptlab.scan(path).summary().splitlines()
                if x.startswith("  code: posix.system"))
    assert "under 'cfg.hooks.1'" in line
    whole = tmp_path / "whole.pkl"
    whole.write_bytes(pickle.dumps(Reduce(os.system, ("echo hi",))))
    [call] = _one(whole).code_calls
    assert call.where == "<root>"
    assert "the loaded object itself" in ckptlab.scan(whole).summary()


def test_code_call_is_spelled_out_with_where(tmp_path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Reduce(os.system, ("echo hi",))}, path)
    f = _one(path)
    assert f.verdict == "code" and f.kind == "torch.save"
    [call] = f.code_calls
    data_pkl = zipfile.ZipFile(path).read("evil/data.pkl")
    assert call.global_ == "posix.system" and call.args == "'echo hi'"
    assert call.pickle == "data.pkl" and data_pkl[call.offset] == ord("R")  # the REDUCE
    assert f.weights_only.refused == "posix.system"
    assert "blocked" in f.weights_only.reason  # torch blocks the posix module outright


def test_every_global_of_a_state_dict_is_listed_once(tmp_path) -> None:
    path = tmp_path / "sd.pt"
    torch.save({f"w{i}": torch.ones(2) for i in range(50)}, path)
    f = _one(path)
    names = [c.global_ for c in f.calls]
    assert len(names) == len(set(names))
    rebuild = next(c for c in f.calls if c.global_ == "torch._utils._rebuild_tensor_v2")
    assert rebuild.count == 50 and rebuild.klass == "torch"


def test_user_safe_globals_are_read_at_call_time(tmp_path) -> None:
    path = tmp_path / "ns.pt"
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    assert not _one(path).weights_only.accepted
    with torch.serialization.safe_globals([argparse.Namespace]):
        f = _one(path)
        assert f.weights_only.accepted and f.verdict == "weights-only"
        assert torch.load(path, weights_only=True)["args"].lr == 0.1  # as torch says
    assert not _one(path).weights_only.accepted


def test_torchscript_is_refused_by_weights_only_and_is_data(tmp_path) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    f = _one(path)
    assert f.kind == "torchscript" and f.loader == "torch.jit.load"
    assert not f.weights_only.accepted and "TorchScript" in f.weights_only.reason
    assert f.verdict == "data" and "constants.pkl" in f.pickles
    with pytest.raises(RuntimeError, match="TorchScript"):
        torch.load(path, weights_only=True)


def test_legacy_tar_members_are_scanned(tmp_path) -> None:
    path = tmp_path / "old.tar"
    with tarfile.open(path, "w") as tar:
        for member, obj in (("sys_info", {"protocol_version": 1001}),
                            ("pickle", Reduce(os.system, ("echo tar",)))):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    f = _one(path)
    assert f.kind == "legacy tar" and f.verdict == "code"
    assert [c.pickle for c in f.code_calls] == ["pickle"]
    assert not f.weights_only.accepted and ".tar" in f.weights_only.reason


def test_npz_object_arrays_are_scanned_and_numeric_ones_skipped(tmp_path) -> None:
    np.savez(tmp_path / "plain.npz", a=np.arange(3))
    report = ckptlab.scan(tmp_path / "plain.npz")
    assert not report.files and report.exit_status == 0
    np.savez(tmp_path / "objects.npz", a=np.array([{"k": 1}], dtype=object))
    f = _one(tmp_path / "objects.npz")
    assert f.kind == "npz" and f.verdict == "data" and f.pickles == ["a.npy (array pickle)"]


def test_files_without_pickles_are_listed_as_skipped(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    report = ckptlab.scan(tmp_path)
    assert report.files == [] and report.exit_status == 0 and report.verdict == "weights-only"
    assert {os.path.basename(p): k for p, k in report.skipped} == {
        "model.safetensors": "safetensors", "config.json": "JSON"}


def test_pickle_after_stop_is_not_run_by_torch_nor_called_code(tmp_path) -> None:
    tail = pickle.dumps(Reduce(os.system, ("echo after",)), protocol=2)
    path = tmp_path / "tail.pt"
    path.write_bytes(torch_zip(b"\x80\x02}." + tail))
    f = _one(path)
    assert f.verdict == "weights-only" and any("after its STOP" in n for n in f.notes)


def test_raw_payload_shapes_are_code_in_a_plain_pickle(tmp_path) -> None:
    for name, data in raw(str(tmp_path / "never")).items():
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(data)
        f = _one(path)
        assert f.verdict == "code", (name, f.notes, [c.to_dict() for c in f.calls])
    assert not os.path.exists(tmp_path / "never")


# -- the command ------------------------------------------------------------------------------
def test_cli_lines_json_and_exit_status(tmp_path, capsys) -> None:
    good, evil = tmp_path / "good.pt", tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2)}, good)
    torch.save({"x": Reduce(eval, ("1+1",))}, evil)
    assert main(["scan", str(good)]) == 0
    assert "WEIGHTS-ONLY" in capsys.readouterr().out
    assert main(["scan", str(good), str(evil)]) == 1
    out = capsys.readouterr().out
    assert "CODE" in out and "code: builtins.eval('1+1')" in out
    assert main(["scan", "--json", str(evil)]) == 1
    doc = json.loads(capsys.readouterr().out)
    [entry] = doc["files"]
    assert entry["verdict"] == "code" and doc["verdict"] == "code"
    assert entry["weights_only"]["accepted"] is False
    assert entry["weights_only"]["refused"] == "eval"
    for call in entry["calls"]:
        assert {"global", "class", "args", "file", "pickle", "offset"} <= set(call)
    assert main(["scan", str(tmp_path / "missing.pt")]) == 2


def test_scan_of_a_url(tmp_path) -> None:
    from ckptlab.testing.nginx import NGINX_MISSING, NginxServer, nginx_executable

    if nginx_executable() is None:
        if os.environ.get("CI"):
            pytest.fail(NGINX_MISSING)
        pytest.skip(NGINX_MISSING)
    torch.save({"x": Reduce(os.system, ("echo url",))}, tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    with NginxServer(tmp_path) as server:
        assert _one(server.url("evil.pt")).verdict == "code"
        assert _one(server.url("good.pt")).verdict == "weights-only"


# -- bad input ---------------------------------------------------------------------------------
def _payload_files() -> list[bytes]:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": Reduce(os.system, ("echo m",))}, buf)
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    return [buf.getvalue(), legacy.getvalue(),
            pickle.dumps(Reduce(os.system, ("echo m",)), protocol=0)]


FILES = _payload_files()


@settings(max_examples=60)
@given(which=st.integers(0, len(FILES) - 1), cut=st.floats(0, 1),
       flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
def test_truncated_and_mutated_files_give_a_report(tmp_path_factory, which: int, cut: float,
                                                    flips: list[tuple[float, int]]) -> None:
    data = bytearray(FILES[which][: max(1, int(len(FILES[which]) * cut))])
    for where, value in flips:
        data[int(where * (len(data) - 1))] = value
    path = tmp_path_factory.mktemp("mut") / "m.pt"
    path.write_bytes(bytes(data))
    report = ckptlab.scan(path)  # a report, never an exception
    for f in report.files:
        assert f.verdict in ckptlab.safety.VERDICTS
        json.dumps(f.to_dict())


# -- the hostile shapes of issue 15: bounded, and a report ------------------------------------
@pytest.fixture(scope="module")
def isolated():
    from ckptlab.testing.isolated import IsolatedReader

    # the timeout only detects hangs; never a speed assertion
    with IsolatedReader(budget_nbytes=2 << 30, timeout_s=300) as reader:
        yield reader


@pytest.mark.parametrize("shape", ["deep-key", "amplifier", "globals"])
def test_hostile_shapes_give_a_report_within_budget(isolated, tmp_path, shape: str) -> None:
    from ckptlab.format._unpickle import MEMORY_FLOOR, MEMORY_PER_BYTE
    from ckptlab.testing.pickles import amplifier, deep_tuple_key, distinct_globals

    pkl = {"deep-key": lambda: deep_tuple_key(150_000),
           "amplifier": lambda: amplifier(b"]", 2_000_000),
           "globals": lambda: distinct_globals(20_000)}[shape]()
    for name, data in (("plain.pkl", pkl), ("zip.pt", torch_zip(pkl))):
        outcome = isolated.run("scan", data, name=name)
        assert outcome.clean, outcome
        # the interpreter's budget, the opcode arrays (9 bytes an opcode) and the report
        assert outcome.peak_nbytes <= max(MEMORY_FLOOR, (MEMORY_PER_BYTE + 16) * len(data)) \
            + (64 << 20), (shape, name, outcome.peak_nbytes)


def test_inspect_says_whether_it_is_safe_up_front(tmp_path, capsys) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Reduce(os.system, ("echo i",))}, evil)
    assert main(["inspect", str(evil)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  safe to load? CODE: ") and "posix.system('echo i')" in lines[2]
    assert main(["inspect", "--json", str(evil)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["safety"]["verdict"] == "code"
    assert doc["safety"]["code"][0]["global"] == "posix.system"
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    assert main(["inspect", str(good)]) == 0
    assert "safe to load? WEIGHTS-ONLY" in capsys.readouterr().out


def test_report_level_calls_and_weights_only(tmp_path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(1), "x": Reduce(eval, ("1",))}, tmp_path / "b.pt")
    one = ckptlab.scan(tmp_path / "a.pt")
    assert one.weights_only.accepted and one.calls == one.files[0].calls
    both = ckptlab.scan(tmp_path)
    assert both.verdict == "code" and not both.weights_only.accepted
    assert both.weights_only.refused == "eval"
    assert {c.global_ for c in both.calls} >= {"builtins.eval", "torch._utils._rebuild_tensor_v2"}


def test_a_file_object_is_scanned_where_it_is(tmp_path) -> None:
    """A binary file object (an open file, a BytesIO) is scanned like its path or bytes;
    anything else is one clear ckptlab error, not a TypeError."""
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, path)
    expected = ckptlab.scan(path)
    with open(path, "rb") as f:
        opened = ckptlab.scan(f)
    in_memory = ckptlab.scan(io.BytesIO(path.read_bytes()))
    for got in (opened, in_memory):
        assert got.verdict == expected.verdict == "data"
        assert [(c.global_, c.args, c.offset) for c in got.calls] == [
            (c.global_, c.args, c.offset) for c in expected.calls]
    assert opened.source == str(path) and in_memory.source == "<BytesIO>"
    with pytest.raises(InvalidArgumentError, match="binary file object"):
        ckptlab.scan(3)
