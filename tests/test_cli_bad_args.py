"""Every verb of the ckptlab command, called with bad arguments: one line, exit status 2.

The table below runs each case as a real subprocess (in parallel, a few at a time): the
process must exit with status 2, print nothing on stdout and exactly one line on stderr,
``ckptlab: error: ...``, naming what was wrong; no traceback, no hang (a FIFO given as a path
must be refused, not opened). No case starts a server: ``serve`` fails on its arguments first.
"""

from __future__ import annotations

import io
import json
import os
import pty
import socket
import struct
import subprocess
import sys
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckptlab as cl
from ckptlab import cli
from ckptlab.cli import MAX_STORAGE_ALIGNMENT, VERBS, main

TIMEOUT_S = 60  # a case that hangs (a FIFO opened for reading) fails instead of blocking


def run(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptlab", *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})},
                          **kwargs)


# (verb, arguments, words the error line must contain); {names} are filled in by `where`
CASES: list[tuple[str, tuple[str, ...], str]] = [
    # inspect
    ("inspect", ("{missing}",), "No such file"),
    ("inspect", ("{fifo}",), "FIFO"),
    ("inspect", ("/dev/null",), "character device"),
    ("inspect", ("{fifo_dir}",), "FIFO"),
    ("inspect", ("{empty}",), "empty file"),
    ("inspect", ("{garbage}",), "not a checkpoint"),
    ("inspect", ("{file}/x.pt",), "Not a directory"),
    ("inspect", ("",), "path is empty"),
    ("inspect", ("{empty}", "--bogus"), "unrecognized arguments: --bogus"),
    ("inspect", ("--json=yes",), "--json"),
    # offsets
    ("offsets", (), "required: PATH"),
    ("offsets", ("{missing}", "--json"), "No such file"),
    ("offsets", ("{dir}",), "a directory without checkpoint files"),
    ("offsets", ("{fifo}", "--json"), "FIFO"),
    ("offsets", ("{fifo_dir}",), "FIFO"),
    ("offsets", ("{garbage}", "--scan"), "not a checkpoint"),
    # sample
    ("sample", (), "required: PATH"),
    ("sample", ("{out}", "--alignment", "0"), "power of two from 1 to 32768, got 0"),
    ("sample", ("{out}", "--alignment", "-5"), "power of two from 1 to 32768, got '-5'"),
    ("sample", ("{out}", "--alignment", "48"), "got 48"),
    ("sample", ("{out}", "--alignment", "65536"), "torch.load misreads"),
    ("sample", ("{out}", "--alignment", "4k"), "got '4k'"),
    ("sample", ("{out}", "--alignment"), "expected one argument"),
    ("sample", ("{missing_dir}/s.pt",), "does not exist"),
    ("sample", ("{file}/s.pt",), "Not a directory"),
    ("sample", ("{dir}",), "is a directory"),
    ("sample", ("{dir}/",), "names a directory"),
    ("sample", ("{fifo}",), "FIFO"),
    ("sample", ("/dev/null",), "character device"),
    ("sample", ("",), "path is empty"),
    ("sample", ("/proc/ckptlab-sample.pt",), "cannot create a file in /proc"),
    # report
    ("report", ("{missing}",), "No such file"),
    ("report", ("{dir}",), "a directory without checkpoint files"),
    ("report", ("{fifo}", "-o", "{out}"), "FIFO"),
    ("report", ("{fifo_dir}", "-o", "{out}"), "FIFO"),
    ("report", ("{garbage}", "-o", "{out}"), "not a checkpoint"),
    ("report", ("-o", "{missing_dir}/r.html"), "does not exist"),
    ("report", ("-o", "{dir}"), "is a directory"),
    ("report", ("-o", "{fifo}"), "FIFO"),
    ("report", ("-o", "{file}/r.html"), "Not a directory"),
    ("report", ("{garbage}", "-o", "{garbage}"), "is the checkpoint being reported on"),
    # readiness
    ("readiness", (), "required: PATH"),
    ("readiness", ("{missing}",), "No such file"),
    ("readiness", ("{dir}", "--json"), "a directory without checkpoint files"),
    ("readiness", ("{fifo}",), "FIFO"),
    ("readiness", ("{fifo_dir}",), "FIFO"),
    ("readiness", ("{garbage}",), "not a checkpoint"),
    ("readiness", ("{empty}",), "empty file"),
    # diff
    ("diff", (), "required: A, B"),
    ("diff", ("{garbage}",), "required: B"),
    ("diff", ("{missing}", "{garbage}"), "No such file"),
    ("diff", ("{garbage}", "{missing}"), "No such file"),
    ("diff", ("{garbage}", "{fifo}"), "FIFO"),
    ("diff", ("{garbage}", "{garbage}"), "not a checkpoint"),
    ("diff", ("{garbage}", "{garbage}", "--atol", "x"), "a tolerance"),
    ("diff", ("{garbage}", "{garbage}", "--rtol", "nan"), "a tolerance"),
    ("diff", ("{garbage}", "{garbage}", "--step", "-1"), "a step number"),
    # stats
    ("convert", (), "required: SRC, DST"),
    ("convert", ("{missing}", "{out}"), "No such file"),
    ("convert", ("{garbage}", "{missing_dir}"), "does not exist"),
    ("convert", ("{garbage}", "{out}", "--to", "onnx"), "invalid choice"),
    ("convert", ("{garbage}", "{out}", "--alignment", "3"), "power of two"),
    ("convert", ("{garbage}", "{out}", "--shard-size", "5XB"), "a size such as"),
    ("convert", ("{garbage}", "{file}", "--shard-size", "1GB"), "not a directory"),
    ("convert", ("{garbage}", "{out}"), "not a checkpoint"),
    ("scan", (), "required: PATH"),
    ("scan", ("{missing}",), "No such file"),
    ("scan", ("{garbage}", "{missing}"), "No such file"),
    ("scan", ("{fifo}",), "FIFO"),
    ("stats", (), "required: PATH"),
    ("stats", ("{missing}",), "No such file"),
    ("stats", ("{fifo}",), "FIFO"),
    ("stats", ("{garbage}",), "not a checkpoint"),
    ("stats", ("{garbage}", "--step", "x"), "a step number"),
    ("stats", ("{garbage}", "--check=1"), "--check"),
    # serve (none of these may start a server)
    ("serve", ("--port", "{busy_port}"), "already in use"),
    ("serve", ("{garbage}", "--port", "{busy_port}"), "already in use"),
    ("serve", ("--port", "0"), "TCP port from 1 to 65535, got 0"),
    ("serve", ("--port", "65536"), "got 65536"),
    ("serve", ("--port", "http"), "got 'http'"),
    ("serve", ("--address", "no-such-host.invalid", "--port", "{free_port}"),
     "not an address of this machine"),
    ("serve", ("--address", "", "--port", "{free_port}"), "--address is empty"),
    ("serve", ("{missing}", "--port", "{free_port}"), "No such file"),
    ("serve", ("{fifo}", "--port", "{free_port}"), "FIFO"),
    ("serve", ("{dir}", "--port", "{free_port}"), "a directory without files"),
    ("serve", ("{garbage}", "--port", "{free_port}"), "not a checkpoint"),
    ("serve", ("{empty}", "--port", "{free_port}"), "empty file"),
    ("serve", ("--show=1",), "--show"),
    ("serve", ("{garbage}", "--compare", "https://example.org/b.pt", "--port", "{free_port}"),
     "two checkpoints on this machine"),
    ("serve", ("--compare", "{garbage}", "--port", "{free_port}"), "--compare: ckptlab serve"),
    ("serve", ("{garbage}", "--compare", "{missing}", "--port", "{free_port}"),
     "No such file"),
    ("serve", ("{garbage}", "--compare", "{garbage}", "--port", "{free_port}"),
     "not a checkpoint"),
    ("report", ("{garbage}", "--compare", "{missing}", "-o", "{out}"), "not a checkpoint"),
    # no verb, unknown verb
    ("", ("--bogus",), "unrecognized arguments: --bogus"),
    ("", ("bogus",), "invalid choice: 'bogus'"),
]


@dataclass(frozen=True)
class Outcome:
    returncode: int | None
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Paths of every kind, a port something listens on and a free one."""
    base = tmp_path_factory.mktemp("bad-args")
    (base / "dir").mkdir()
    os.mkfifo(base / "fifo")
    (base / "fifo-dir").mkdir()
    (base / "fifo-dir" / ".metadata").write_bytes(b"x")
    os.mkfifo(base / "fifo-dir" / "__0_0.distcp")
    (base / "empty.pt").write_bytes(b"")
    (base / "garbage.pt").write_bytes(b"hello world, not a checkpoint")
    (base / "file").write_bytes(b"a regular file, not a directory")
    (base / "cache").mkdir()
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    yield {"missing": str(base / "missing.pt"), "missing_dir": str(base / "no" / "such"),
           "dir": str(base / "dir"), "fifo": str(base / "fifo"),
           "fifo_dir": str(base / "fifo-dir"), "empty": str(base / "empty.pt"),
           "garbage": str(base / "garbage.pt"), "file": str(base / "file"),
           "out": str(base / "out.pt"), "cache": str(base / "cache"),
           "busy_port": str(busy.getsockname()[1]), "free_port": str(free_port)}
    busy.close()


def _argv(verb: str, args: tuple[str, ...], where: dict[str, str]) -> list[str]:
    return ([verb] if verb else []) + [a.format(**where) for a in args]


@pytest.fixture(scope="module")
def outcomes(where: dict[str, str]) -> dict[int, Outcome]:
    """Every case of CASES run once, a few processes at a time (most need no torch import)."""
    env = {**os.environ, "XDG_CACHE_HOME": where["cache"]}  # never the user's cache

    def one(case: tuple[str, tuple[str, ...], str]) -> Outcome:
        verb, args, _ = case
        try:
            proc = subprocess.run([sys.executable, "-m", "ckptlab", *_argv(verb, args, where)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            return Outcome(None, str(exc.stdout or ""), f"timed out: {exc}")
        return Outcome(proc.returncode, proc.stdout, proc.stderr)

    with ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1)) as pool:
        return dict(enumerate(pool.map(one, CASES)))


def test_the_table_covers_every_verb() -> None:
    verbs = set(cli._args._parser().verbs)
    assert verbs == set(VERBS)
    assert {verb for verb, _, _ in CASES} == verbs | {""}


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[" ".join([v, *a]).strip() or "(none)" for v, a, _ in CASES])
def test_bad_arguments_exit_2_with_one_line(index: int, outcomes, where) -> None:
    verb, args, words = CASES[index]
    if args and args[0].startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    out = outcomes[index]
    shown = f"ckptlab {' '.join(_argv(verb, args, where))}"
    assert "Traceback" not in out.stdout + out.stderr, (shown, out.stderr)
    assert out.returncode == 2, (shown, out)
    assert out.stdout == "", shown
    lines = out.stderr.splitlines()
    assert len(lines) == 1, (shown, lines)
    assert lines[0].startswith("ckptlab: error: "), (shown, lines)
    assert words in lines[0], (shown, lines[0])


def test_a_failed_sample_leaves_nothing_behind(outcomes, where) -> None:
    assert not os.path.exists(where["out"])  # every sample case above failed before writing
    assert not any(name.startswith(".ckptlab-") for name in os.listdir(Path(where["out"]).parent))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_unwritable_directory(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for argv in (["sample", str(ro / "s.pt")], ["report", "-o", str(ro / "r.html")]):
            proc = run(*argv, env={"XDG_CACHE_HOME": str(tmp_path)})
            assert proc.returncode == 2
            (line,) = proc.stderr.splitlines()
            assert line.startswith("ckptlab: error: ") and "permission" in line
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------------------------------------
# no verb, --version, --help


def test_no_verb_lists_the_verbs_in_plain_words() -> None:
    proc = run()
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    for verb, what in VERBS.items():
        assert any(line.split() == [verb, *what.split()] for line in lines), verb
    assert lines[-1].startswith("ckptlab: error: no verb given")
    assert "the following arguments are required" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version() -> None:
    proc = run("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"ckptlab {cl.__version__}\n", "")


def test_help_of_every_verb_exits_0(capsys) -> None:
    for verb in VERBS:
        assert main([verb, "--help"]) == 0
        assert f"usage: ckptlab {verb}" in capsys.readouterr().out
    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert all(verb in shown for verb in VERBS)


def test_the_module_docstring_names_every_verb() -> None:
    for verb in VERBS:
        assert f"``{verb}" in cli.__doc__


# ---------------------------------------------------------------------------------------------
# --json: indented at a terminal, one compact line in a pipe


def _run_on_a_terminal(*args: str) -> tuple[int, str]:
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptlab", *args], stdout=terminal,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    finally:
        os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    proc.wait(TIMEOUT_S)
    return proc.returncode, b"".join(chunks).decode().replace("\r\n", "\n")


def test_json_is_indented_on_a_terminal_and_one_line_in_a_pipe(small_file) -> None:
    piped = run("offsets", str(small_file), "--json")
    assert piped.returncode == 0
    assert piped.stdout.count("\n") == 1 and ", " not in piped.stdout  # compact
    doc = json.loads(piped.stdout)
    assert set(doc) >= {"offsets", "reads", "bytes_read"}
    status, shown = _run_on_a_terminal("offsets", str(small_file), "--json")
    assert status == 0
    assert shown.startswith('{\n  "offsets": {\n    "')
    assert json.loads(shown) == doc


# ---------------------------------------------------------------------------------------------
# in-process: what the table cannot reach


def test_sample_at_the_largest_alignment_loads_back(tmp_path, capsys) -> None:
    import torch

    out = tmp_path / "max.pt"
    assert main(["sample", str(out), "--alignment", str(MAX_STORAGE_ALIGNMENT)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    layout = cl.inspect(out)
    assert layout.storage_alignment == MAX_STORAGE_ALIGNMENT
    assert layout.archive_name == "max"  # written beside, moved in place: the name is kept
    assert all(s.data_offset % MAX_STORAGE_ALIGNMENT == 0 for s in layout.storages if s.nbytes)
    back = torch.load(out, weights_only=True)["model"]
    want = cl.samples.tiny_checkpoint()["model"]
    assert all(torch.equal(back[k], want[k]) for k in want)
    assert os.listdir(tmp_path) == ["max.pt"]


def _fb_paddings(raw: bytes) -> list[int]:
    """The FB padding length of every local header that has one (16 bits each)."""
    out, i = [], 0
    while (i := raw.find(b"PK\x03\x04", i)) >= 0:
        name_nbytes, extra_nbytes = struct.unpack_from("<HH", raw, i + 26)
        extra = raw[i + 30 + name_nbytes : i + 30 + name_nbytes + extra_nbytes]
        if extra[:2] == b"FB" and len(extra) >= 4:
            out.append(struct.unpack_from("<H", extra, 2)[0])
        i += 4
    return out


def test_max_alignment_is_torchs_limit() -> None:
    """MAX_STORAGE_ALIGNMENT is where torch.load stops reading back what torch.save wrote.

    Two tensors, the first one's length swept over the bytes below the alignment, so the
    second record's padding takes every value up to alignment - 1: at the bound each file
    loads back equal, the largest padding included; at twice the bound a padding of 65532
    bytes or more wraps the 16-bit extra length and torch.load returns wrong bytes.
    """
    import torch
    from torch.utils.serialization import config

    def sweep(alignment: int) -> tuple[int, int]:
        worst = wrong = 0
        for n in range(alignment - 100, alignment):
            obj = {"a": torch.ones(n, dtype=torch.uint8),
                   "b": torch.full((1,), 7, dtype=torch.uint8)}
            buf = io.BytesIO()
            with config.patch({"save.storage_alignment": alignment}):
                torch.save(obj, buf)
            worst = max(worst, *_fb_paddings(buf.getvalue()))
            back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            wrong += not all(torch.equal(back[k], obj[k]) for k in obj)
        return worst, wrong

    assert MAX_STORAGE_ALIGNMENT & (MAX_STORAGE_ALIGNMENT - 1) == 0
    assert sweep(MAX_STORAGE_ALIGNMENT) == (MAX_STORAGE_ALIGNMENT - 1, 0)
    assert sweep(2 * MAX_STORAGE_ALIGNMENT)[1] > 0


def test_report_never_overwrites_its_checkpoint(small_file, tmp_path, capsys) -> None:
    copy = tmp_path / "c.pt"
    copy.write_bytes(small_file.read_bytes())
    link = tmp_path / "link.html"
    link.symlink_to(copy)
    assert main(["report", str(copy), "-o", str(link)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "is the checkpoint being reported on" in line
    assert copy.read_bytes() == small_file.read_bytes()


def test_a_server_that_cannot_bind_is_one_line(monkeypatch, small_file, capsys) -> None:
    """The port was free when checked and taken when the server bound it (a race)."""

    def busy(*args, **kwargs):
        raise OSError(98, "Address already in use")

    quick = types.ModuleType("ckptlab.widgets.quick")  # stands in for the server: no bind
    quick.serve = busy
    monkeypatch.setitem(sys.modules, "ckptlab.widgets.quick", quick)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", str(small_file), "--port", str(port)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "ckptlab: error: Address already in use"


def test_the_servers_own_bind_failing_is_one_line(monkeypatch, small_file, capsys) -> None:
    """The real bind (ckptlab.widgets.quick.serve), on a port taken after the check."""
    monkeypatch.setattr(cli._checks, "_check_listen", lambda address, port: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(small_file), "--port", str(port)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"ckptlab: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_an_unexpected_error_is_one_line_unless_asked(monkeypatch, small_file, capsys) -> None:
    def broken(*args, **kwargs):
        raise TypeError("something\nunforeseen")

    monkeypatch.setattr(cli, "storage_offsets", broken)
    monkeypatch.delenv("CKPTLAB_TRACEBACK", raising=False)
    assert main(["offsets", str(small_file)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ckptlab: error: unexpected TypeError: something unforeseen")
    assert "CKPTLAB_TRACEBACK=1" in line
    monkeypatch.setenv("CKPTLAB_TRACEBACK", "1")
    with pytest.raises(TypeError):
        main(["offsets", str(small_file)])


def test_a_closed_pipe_is_not_an_error(sample_file) -> None:
    proc = subprocess.run(f"'{sys.executable}' -m ckptlab inspect '{sample_file}' | head -n 1",
                          shell=True, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.stdout.strip() == str(sample_file)
    assert proc.stderr == ""
