"""Package-level contracts: public API, core never imports UI libraries, deterministic sample."""

from __future__ import annotations

import subprocess
import sys

import ckptlab as cl

UI_MODULES = ("ipywidgets", "panel", "plotly", "IPython", "anywidget", "bokeh")
CORE = ("ckptlab", "ckptlab.format", "ckptlab.errors", "ckptlab.samples", "ckptlab.cli",
        "ckptlab.gds", "ckptlab.gds.handle", "ckptlab.gds.tutorial", "ckptlab.gds.readiness",
        "ckptlab.gds._backends", "ckptlab.plan", "ckptlab.plan.ranks", "ckptlab.dcp",
        "ckptlab.dcp.metadata", "ckptlab.dcp.layout", "ckptlab.dcp.items", "ckptlab.dcp.columns",
        "ckptlab.source", "ckptlab.source._tree",
        "ckptlab.plan.items", "ckptlab.plan.planning", "ckptlab.plan.cache",
        "ckptlab.plan.simulate", "ckptlab.write", "ckptlab.write.buckets",
        "ckptlab.write.timeline", "ckptlab._io", "ckptlab._io.durable", "ckptlab.gds.api",
        "ckptlab._progress", "ckptlab._lazy", "ckptlab._torch_compat",
        "ckptlab.checkpoint._cache", "ckptlab.checkpoint.query", "ckptlab.source._remote")
# core modules that need torch at import time: still no UI library
CORE_WITH_TORCH = ("ckptlab.plan.planner", "ckptlab.plan.torch_plans", "ckptlab.write.writer",
                   "ckptlab.write._io", "ckptlab.write._blob", "ckptlab.write._staging",
                   "ckptlab.write._placement", "ckptlab.write._worker", "ckptlab.write._commit",
                   "ckptlab.write._files", "ckptlab.write._state")


def test_core_never_imports_ui_libraries():
    code = (
        "import sys\n"
        f"for m in {CORE!r}: __import__(m)\n"
        "import ckptlab.format.predict, ckptlab.format.offsets, ckptlab.format.safetensors\n"
        f"bad = [m for m in {UI_MODULES!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"  # inspecting does not even need torch imported


def test_core_with_torch_never_imports_ui_libraries():
    code = (
        "import sys\n"
        f"for m in {CORE_WITH_TORCH!r}: __import__(m)\n"
        f"bad = [m for m in {UI_MODULES!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_public_api_is_all():
    for name in cl.__all__:
        assert hasattr(cl, name), name
    assert {"inspect", "storage_offsets", "predict_layout", "samples"} <= set(cl.__all__)


def test_errors_derive_from_stdlib_types():
    from ckptlab import errors

    assert issubclass(errors.TruncatedArchiveError, ValueError)
    assert issubclass(errors.WriterError, RuntimeError)
    e = errors.CorruptArchiveError("bad thing", path="f.pt", record="f/data/0", offset=12,
                                   expected=1, actual=2)
    assert str(e) == "f.pt, record 'f/data/0', offset 12: bad thing (expected 1, got 2)"


def test_sample_is_deterministic():
    import torch

    a, b = cl.samples.tiny_checkpoint(), cl.samples.tiny_checkpoint()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for idx, state in a["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["optimizer"]["state"][idx][k])
    model = a["model"]
    assert model["lm_head.weight"].untyped_storage().data_ptr() == \
        model["transformer.wte.weight"].untyped_storage().data_ptr()
    assert model["transformer.wpe.weight"].dtype == torch.bfloat16
    assert model["transformer.position_ids"].dtype == torch.int64
