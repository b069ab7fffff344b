"""Training runs: a directory holding several saves of one run, opened as the save the
framework itself would resume from.

Each framework leaves its saves side by side and says, by a file or a naming rule, which one
a resumed run loads. :func:`find_run` recognises those layouts from the directory listing and
a few bytes of a pointer file (nothing is imported or run):

============  ==========================================  =====================================
framework     saves                                       resumed from
============  ==========================================  =====================================
deepspeed     ``global_step<N>/`` (any tag)               the tag in the ``latest`` file
megatron      ``iter_<7 digits>/``, ``release/``          ``latest_checkpointed_iteration.txt``
trainer       ``checkpoint-<N>/`` (transformers Trainer)  the highest N (``get_last_checkpoint``)
torchtune     ``epoch_<N>/``                              the highest N
lightning     ``*.ckpt`` files                            ``last.ckpt`` when present, else the
                                                          highest ``step=<N>``
dcp-steps     ``step-<N>/`` DCP directories (torchtitan)  the highest N with its ``.metadata``
============  ==========================================  =====================================

A save is *complete* when the file its writer writes last is there (DCP: ``.metadata``;
Megatron-Core's ``torch_dist``: ``metadata.json``; the Trainer: ``trainer_state.json``;
DeepSpeed: the model states file; torchtune: a weights file). An incomplete save (a run killed
mid-write) is listed as such and never opened as if whole.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import UnsupportedFormatError

__all__ = ["RUN_LAYOUTS", "Run", "Step", "choose_step", "find_run", "resolve_run"]

_POINTER_NBYTES = 256  # latest / latest_checkpointed_iteration.txt: a tag or a number
# the saves a run's directory holds, as errors name them
RUN_LAYOUTS = "checkpoint-N/, iter_N/, global_stepN/, step-N/, epoch_N/, *.ckpt"


@dataclass(frozen=True, slots=True)
class Step:
    """One save of a training run.

    Attributes
    ----------
    number
        The step, iteration or epoch the save is named for (None where its name has none:
        Megatron's ``release``, Lightning's ``last.ckpt``, a DeepSpeed tag without digits).
    name
        Its file or directory name inside the run directory.
    nbytes
        Bytes of its files.
    mtime
        Modification time of its newest file (seconds since the epoch).
    complete
        Whether the file its writer writes last is there.
    """

    number: int | None
    name: str
    nbytes: int
    mtime: float
    complete: bool

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "name": self.name, "nbytes": self.nbytes,
                "mtime": self.mtime, "complete": self.complete}


@dataclass(frozen=True, slots=True)
class Run:
    """A directory of saves: which framework wrote it, every save in order, the one the
    framework resumes from (``resume``, None where it names none that exists) and why, and
    the one opened (``opened``: its name, set by :func:`choose_step`)."""

    path: str
    framework: str
    steps: tuple[Step, ...]
    resume: Step | None
    rule: str
    opened: str | None = None

    @property
    def opened_path(self) -> str | None:
        return None if self.opened is None else os.path.join(self.path, self.opened)

    def step(self, number: int) -> Step:
        """The save named for ``number``."""
        for s in self.steps:
            if s.number == number:
                return s
        have = ", ".join(str(s.number) for s in self.steps if s.number is not None)
        raise UnsupportedFormatError(f"no save for step {number} in this {self.framework} run "
                                     f"(steps: {have or 'none numbered'})", path=self.path)

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "rule": self.rule,
                "resume": None if self.resume is None else self.resume.name,
                "opened": self.opened, "steps": [s.to_dict() for s in self.steps]}


def _sizes(path: str) -> tuple[int, float]:
    """Bytes and newest modification time of the files under ``path`` (symlinks not
    followed)."""
    if not os.path.isdir(path):
        info = os.stat(path)
        return info.st_size, info.st_mtime
    nbytes, mtime = 0, os.stat(path).st_mtime
    for base, _, files in os.walk(path):
        for f in files:
            info = os.lstat(os.path.join(base, f))
            nbytes += info.st_size
            mtime = max(mtime, info.st_mtime)
    return nbytes, mtime


def _has(path: str, *names: str, pattern: str | None = None) -> bool:
    """Whether directory ``path`` holds one of ``names`` (or a file matching ``pattern``,
    one level down too)."""
    if any(os.path.exists(os.path.join(path, n)) for n in names):
        return True
    if pattern is None:
        return False
    regex = re.compile(pattern)
    for base, dirs, files in os.walk(path):
        if any(regex.fullmatch(f) for f in files):
            return True
        if base != path:
            dirs.clear()
    return False


def _pointer(path: str) -> str | None:
    """The text of a small pointer file (a tag, a number), or None."""
    try:
        with open(path, "rb") as f:
            return f.read(_POINTER_NBYTES).decode("utf-8", "replace").strip()
    except OSError:
        return None


def _step(root: str, name: str, number: int | None, complete: bool) -> Step:
    nbytes, mtime = _sizes(os.path.join(root, name))
    return Step(number, name, nbytes, mtime, complete)


def _in_order(steps: list[Step]) -> list[Step]:
    """Saves by number (unnumbered ones last), then name."""
    return sorted(steps, key=lambda s: (s.number is None, s.number or 0, s.name))


def _numbered(root: str, names: list[str], pattern: str, complete: Any) -> list[Step]:
    """The save directories whose names match ``pattern`` (its group: the number)."""
    regex = re.compile(pattern)
    out = []
    for n in names:
        m = regex.fullmatch(n)
        if m is None or not os.path.isdir(os.path.join(root, n)):
            continue
        number = int(m.group(1)) if m.groups() and m.group(1) else None
        out.append(_step(root, n, number, complete(os.path.join(root, n))))
    return _in_order(out)


def _deepspeed(root: str, names: list[str]) -> Run | None:
    if "latest" not in names or not os.path.isfile(os.path.join(root, "latest")):
        return None
    tag = _pointer(os.path.join(root, "latest"))

    def complete(p: str) -> bool:
        return _has(p, pattern=r".*model_states\.pt")

    steps = [s for s in _numbered(root, names, r"(?:global_step)?(\d+)?.*", complete)
             if _has(os.path.join(root, s.name), pattern=r".*_states\.pt")]
    resume = next((s for s in steps if s.name == tag), None)
    return Run(root, "deepspeed", tuple(steps), resume, f"DeepSpeed's latest file names {tag!r}")


def _megatron(root: str, names: list[str]) -> Run | None:
    tracker = "latest_checkpointed_iteration.txt"
    if tracker not in names:
        return None
    text = _pointer(os.path.join(root, tracker)) or ""

    def complete(p: str) -> bool:  # torch_dist: metadata.json last; legacy: mp_rank_* files
        return _has(p, "metadata.json", pattern=r"model_optim_rng\.pt")

    steps = _numbered(root, names, r"iter_(\d{7})", complete)
    steps += _numbered(root, names, r"release()", complete)
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else ""
    resume = next((s for s in steps if s.name == name), None)
    return Run(root, "megatron", tuple(steps), resume, f"{tracker} says {text!r}")


def _highest(root: str, names: list[str], framework: str, pattern: str, complete: Any,
             rule: str, only_complete: bool = False) -> Run | None:
    steps = _numbered(root, names, pattern, complete)
    if not steps:
        return None
    candidates = [s for s in steps if s.complete or not only_complete]
    resume = max(candidates, key=lambda s: s.number or 0) if candidates else None
    return Run(root, framework, tuple(steps), resume, rule)


def _lightning(root: str, names: list[str]) -> Run | None:
    files = [n for n in names if n.endswith(".ckpt") and os.path.isfile(os.path.join(root, n))]
    if len(files) < 2 and "last.ckpt" not in files:
        return None
    steps = []
    for n in files:
        m = re.search(r"step=(\d+)", n)
        steps.append(_step(root, n, int(m.group(1)) if m else None, True))
    steps = _in_order(steps)
    last = next((s for s in steps if s.name == "last.ckpt"), None)
    numbered = [s for s in steps if s.number is not None]
    resume = last or (max(numbered, key=lambda s: s.number or 0) if numbered else None)
    rule = "last.ckpt" if last else "the highest step=N"
    return Run(root, "lightning", tuple(steps), resume, rule)


def find_run(root: str) -> Run | None:
    """The training run a local directory holds (see the module docstring), or None when it
    is not one."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for finder in (_deepspeed, _megatron):
        run = finder(root, names)
        if run is not None:
            return run
    for framework, pattern, complete, rule, only in (
            ("trainer", r"checkpoint-(\d+)",
             lambda p: _has(p, "trainer_state.json"), "the highest checkpoint-N "
             "(transformers' get_last_checkpoint)", False),
            ("torchtune", r"epoch_(\d+)",
             lambda p: _has(p, pattern=r".*\.(safetensors|bin|pt)"), "the highest epoch_N",
             False),
            ("dcp-steps", r"step-(\d+)", lambda p: _has(p, ".metadata"),
             "the highest step-N with its .metadata (torchtitan)", True)):
        run = _highest(root, names, framework, pattern, complete, rule, only)
        if run is not None:
            return run
    return _lightning(root, names)


def choose_step(run: Run, number: int | None = None) -> Run:
    """``run`` with the save to open chosen (``opened``): step ``number``, else the one the
    framework resumes from; refused when it is incomplete (never opened as if whole)."""
    chosen = run.step(number) if number is not None else run.resume
    if chosen is None:
        raise UnsupportedFormatError(
            f"a {run.framework} run whose resume rule ({run.rule}) names no save here; "
            f"steps: {', '.join(s.name for s in run.steps) or 'none'}; open one with step=N",
            path=run.path)
    if not chosen.complete:
        done = [s.name for s in run.steps if s.complete]
        raise UnsupportedFormatError(
            f"{chosen.name} is an incomplete save (the file its writer writes last is "
            f"missing: a run killed mid-write?); complete saves: {', '.join(done) or 'none'}",
            path=os.path.join(run.path, chosen.name))
    return dataclasses.replace(run, opened=chosen.name)


def resolve_run(source: Any, step: int | None = None) -> tuple[Any, Run | None]:
    """What to open for ``source``: where it is a local training run's directory, the path of
    the save (``step``, else the one the framework resumes from; :func:`choose_step`) and the
    run; without ``step``, a directory that holds a model of its own beside its saves (the
    Trainer's output directory after ``save_model``) is that model, its run attached with
    ``opened`` None; else ``source`` itself and None (the caller says what ``step`` on it
    means)."""
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return source, None
    run = find_run(os.fspath(source))
    if run is None:
        return source, None
    if step is None and run.framework != "lightning" and _own_model(os.fspath(source)):
        return source, run  # a model beside its saves (Trainer.save_model): that model
    run = choose_step(run, step)
    return run.opened_path, run


def _own_model(root: str) -> bool:
    """Whether a run's directory holds checkpoint files of its own, beside its save
    directories (the final model ``Trainer.save_model`` writes into its output directory)."""
    from ckptlab.checkpoint.open import CHECKPOINT_SUFFIXES

    return any(e.is_file() and (e.name.endswith(CHECKPOINT_SUFFIXES) or e.name == ".metadata")
               for e in os.scandir(root))
