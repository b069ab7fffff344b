"""The verbs that compare, measure, scan and convert, and report's extras."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ckptlab.cli._checks import _input_path, _is_url
from ckptlab.cli._offsets import _open, _print_json
from ckptlab.cli._text import _table, _text
from ckptlab.errors import CkptlabError, InvalidArgumentError


def _convert(args: argparse.Namespace) -> int:
    """``ckptlab convert SRC DST``: the summary (or the JSON) of what was written."""
    from ckptlab.write.convert import convert

    result = convert(args.path, args.output, to=args.to, shard_size=args.shard_size,
                     alignment=args.alignment, step=args.step)
    if args.json:
        _print_json(result.to_dict())
    else:
        print("\n".join(_text(line) for line in result.summary().splitlines()))
    return 0


def _scan(args: argparse.Namespace) -> int:
    """``ckptlab scan PATH...``: a line per file (the code calls spelled out) or the JSON;
    0 when every file is weights-only, 1 when any is not."""
    from ckptlab.safety import SafetyReport, scan

    reports = [scan(path) for path in args.paths]
    every = SafetyReport(" ".join(args.paths), [f for r in reports for f in r.files],
                         [s for r in reports for s in r.skipped])
    if args.json:
        _print_json(every.to_dict())
    else:
        print("\n".join(_text(line) for r in reports for line in r.summary().splitlines()))
    return every.exit_status


def _stats(args: argparse.Namespace) -> int:
    """``ckptlab stats PATH``: a row per tensor and the health lines, or the JSON; with
    ``--check`` 1 when a tensor holds a NaN or an Inf."""
    from ckptlab.checkpoint.query import TensorQuery
    from ckptlab.compare import health, stats

    ck, _ = _open(args.path)
    found = stats(ck, TensorQuery(args.filter).matches if args.filter else None)
    bad = [n for n, s in found.items() if s.nan or s.inf]
    if args.json:
        _print_json({"path": ck.path, "tensors": {n: s.to_dict() for n, s in found.items()},
                     "health": health(found)})
    else:
        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:.4g}"

        rows = [[_text(n), s.dtype, f"{s.numel:,}", num(s.min), num(s.max), num(s.mean),
                 num(s.std), f"{s.nan:,}", f"{s.inf:,}", f"{s.zeros:,}"]
                if s.error is None else [_text(n), s.dtype, "-", _text(s.error), "", "", "",
                                         "", "", ""]
                for n, s in found.items()]
        print(f"{ck.path}: {len(found):,} tensor{'s' * (len(found) != 1)}")
        print(_table(rows, ("name", "dtype", "numel", "min", "max", "mean", "std", "nan",
                            "inf", "zeros"), {2, 3, 4, 5, 6, 7, 8, 9}) if rows else "  (none)")
        lines = health(found)
        print("health: " + ("; ".join(lines) if lines else "nothing looks wrong"))
    if args.check and bad:
        if not args.json:
            print(f"check failed: NaN or Inf in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


REPORT_HISTOGRAMS = 4  # the most changed tensors a compare report draws histograms of


def _report_extra(args: argparse.Namespace, ck: Any, run: Any) -> dict[str, Any]:
    """``report --compare OTHER``, ``--stats`` and ``--steps``: the diff, the histograms of
    the most changed tensors (both sides and the changes), the statistics and a run's
    consecutive diffs, for :func:`report_html`."""
    from ckptlab._progress import task
    from ckptlab.compare import diff, stats, step_diffs
    from ckptlab.compare._stats import side_by_side

    extra: dict[str, Any] = {}
    if args.steps:
        if run is None:
            from ckptlab.checkpoint.runs import RUN_LAYOUTS

            raise InvalidArgumentError(f"{args.path}: --steps is for a training run's "
                                       f"directory (saves side by side: {RUN_LAYOUTS})")
        with task("comparing the run's saves"):
            extra["steps"] = step_diffs(run)
    if args.compare is not None:
        other = args.compare if _is_url(args.compare) else _input_path(
            args.compare, "report", directory=True)
        ck_b, _ = _open(other)
        with task("comparing"):
            d = diff(ck, ck_b)
        hists = {}
        for name, t in d.largest(REPORT_HISTOGRAMS):
            if t.error is None and t.shape[0] == t.shape[1]:
                try:
                    hists[name] = side_by_side(d, ck, ck_b, name)
                except CkptlabError:  # (the table says why it differs)
                    continue
        extra.update(diff=d, histograms=hists)
    if args.stats:
        with task("measuring tensors"):
            extra["stats"] = stats(ck)
    return extra


def _diff(args: argparse.Namespace) -> int:
    """``ckptlab diff A B``: the summary or the JSON; 0 when nothing differs beyond the
    tolerances, 1 when something does (as ``cmp``)."""
    from ckptlab.checkpoint.query import TensorQuery
    from ckptlab.checkpoint.runs import RUN_LAYOUTS, resolve_run
    from ckptlab.compare import diff

    sides = []
    for path in (args.path, args.other):
        path, run = resolve_run(path, args.step) if not _is_url(path) else (path, None)
        ck, _ = _open(path)
        ck.run = run
        sides.append(ck)
    if args.step is not None and all(ck.run is None for ck in sides):
        raise InvalidArgumentError(
            f"{args.path}, {args.other}: --step is for a training run's directory (saves side "
            f"by side: {RUN_LAYOUTS}); neither is one")
    query = TensorQuery(args.filter or "")
    result = diff(sides[0], sides[1], names=query.matches if args.filter else None,
                  atol=args.atol, rtol=args.rtol)
    if args.json:
        _print_json(result.to_dict())
    else:
        print("\n".join(_text(line) for line in result.summary().splitlines()))
    return 1 if result.differs else 0
