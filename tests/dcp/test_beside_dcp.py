"""Files beside a DCP directory's own (``.metadata`` and the data files it names) are part of
the checkpoint: Megatron-Core's ``torch_dist`` layout keeps ``metadata.json`` (its format
record) and ``common.pt`` (the state every rank shares: a torch.save file) there. Built with
torch's ``dcp.save`` and ``torch.save`` in that layout (megatron-core is not installed here)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

import ckptlab as cl


def test_megatron_common_state_and_metadata_json(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "iter_0000007"
    state = {"decoder.layers.0.mlp.weight": torch.randn(4, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root)
    record = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
              "common_backend": "torch", "common_backend_version": 1}
    (root / "metadata.json").write_text(json.dumps(record))
    torch.save({"iteration": 7, "rng": torch.arange(3)}, root / "common.pt")
    ck = cl.open(root)
    assert ck.format == "dcp"
    assert torch.equal(ck.read("decoder.layers.0.mlp.weight"),
                       state["decoder.layers.0.mlp.weight"])
    assert ck.objects["metadata.json"] == record
    assert ck.objects["common.pt.iteration"] == 7
    assert torch.equal(ck.read("common.pt.rng"), torch.arange(3))
    paths = {f.path for f in ck.files}
    assert {".metadata", "metadata.json", "common.pt"} <= paths


def test_a_plain_dcp_directory_is_unchanged(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "d")
    ck = cl.open(tmp_path / "d")
    assert type(ck).__name__ == "DcpCheckpoint"  # the fast open, nothing added


def test_beside_files_on_the_general_path(tmp_path: Path) -> None:
    """The same directory read by the converter (its Metadata carries Megatron's added
    attribute, which the columns leave to it): the files beside are not data files there
    either, and common.pt's tensors are read."""
    import pickle

    import torch.distributed.checkpoint as dcp

    root = tmp_path / "iter_0000009"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=root)
    meta = pickle.loads((root / ".metadata").read_bytes())  # the test's own file
    meta.all_local_plans = []
    (root / ".metadata").write_bytes(pickle.dumps(meta))
    (root / "metadata.json").write_text("{}")
    torch.save({"rng": torch.arange(3)}, root / "common.pt")
    ck = cl.open(root)
    assert type(ck).__name__ != "DcpCheckpoint"  # (the general path)
    formats = {f.path: f.format for f in ck.files}
    assert formats["__0_0.distcp"] == "distcp" and formats["common.pt"] != "distcp"
    assert formats["metadata.json"] != "distcp"
    assert torch.equal(ck.read("common.pt.rng"), torch.arange(3))
    assert [name for name, _ in cl.inspect(root).files] == ["__0_0.distcp"]
