"""What the benchmarks that time jobs in fresh processes share: their arguments, and running
one job in a child interpreter that prints its figures as the last line of JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def size_args(doc: str, prefix: str) -> tuple[argparse.Namespace, Path]:
    """``--size-mib``, ``--dir`` (default a new temporary directory named ``prefix``...) and
    ``--rounds``; the directory, made."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix=prefix))
    base.mkdir(parents=True, exist_ok=True)
    return args, base


def run_child(code: str, *argv: object) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter (this checkout on its path) with ``argv``; its
    last line of output, as JSON."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, argv)], check=True,
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
