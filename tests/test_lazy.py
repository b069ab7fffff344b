"""ckptlab._lazy: the one mechanism behind every name imported on first use."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from ckptlab._lazy import lazy_attributes, lazy_callable, resolve_target


def test_resolve_target():
    import json
    import os.path

    assert resolve_target("json") is json
    assert resolve_target("os.path:join") is os.path.join
    assert resolve_target("json:JSONDecodeError.__name__") == "JSONDecodeError"
    with pytest.raises(ModuleNotFoundError):
        resolve_target("no_such_module_here")
    with pytest.raises(AttributeError):
        resolve_target("json:nope")


def test_lazy_attributes_import_once_and_cache():
    module = types.ModuleType("fake")
    getattr_, dir_ = lazy_attributes("fake", module.__dict__, {
        "dumps": "json:dumps", "decoder": "json.decoder"})
    module.__getattr__ = getattr_
    assert "dumps" not in module.__dict__ and "dumps" in dir_()
    import json

    assert module.dumps is json.dumps and module.__dict__["dumps"] is json.dumps
    assert module.decoder is json.decoder
    with pytest.raises(AttributeError, match="module 'fake' has no attribute 'other'"):
        _ = module.other


def test_lazy_callable():
    join = lazy_callable("os.path:join")
    assert join("a", "b") == "a/b" and join.__name__ == "join"


def test_command_start_imports_no_format_code():
    """``python -m ckptlab --version`` must not import ckptlab.format (or numpy/torch)."""
    code = ("import sys; sys.argv[0] = '-m'; import ckptlab; "
            "print(sorted(m for m in sys.modules if m.startswith(('ckptlab.format', 'numpy', "
            "'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    code = "import ckptlab; print(ckptlab.predict_layout.__module__, ckptlab.plan.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["ckptlab.format.predict", "ckptlab.plan"]


def test_version_and_argument_errors_import_no_checkpoint_code():
    """``ckptlab --version`` and an argument error build the whole parser: it must not import
    the checkpoint model, numpy or torch (``--sort``'s keys are checked only when given)."""
    code = ("import sys; sys.argv[0] = '-m'\n"
            "from ckptlab.cli import main\n"
            "for args in (['--version'], ['inspect', '--frob']):\n"
            "    try:\n"
            "        main(args)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ckptlab.format', "
            "'ckptlab.checkpoint', 'numpy', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
