"""Composite models open as one checkpoint named by the framework's own components: a
diffusers pipeline (safetensors, ``.bin`` and ``variant="fp16"``) and a sentence-transformers
model with a ``Dense`` module beside the root's transformer, each written by the library's
own ``save_pretrained`` / ``save`` and compared, tensor by tensor and bit for bit, with what
the library's own loader gives.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.cli import main

diffusers = pytest.importorskip("diffusers")
sentence_transformers = pytest.importorskip("sentence_transformers")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pipelines")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    pipe = diffusers.DDPMPipeline(unet=unet,
                                  scheduler=diffusers.DDPMScheduler(num_train_timesteps=10))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, kwargs in (("safetensors", {}), ("bin", {"safe_serialization": False}),
                             ("fp16", {"variant": "fp16"})):
            out[name] = base / name
            pipe.save_pretrained(out[name], **kwargs)
    return out


@pytest.mark.parametrize("kind", ["safetensors", "bin", "fp16"])
def test_diffusers_pipeline(pipelines: dict[str, Path], kind: str) -> None:
    root = pipelines[kind]
    ck = cl.open(root)
    variant = "fp16" if kind == "fp16" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        truth = diffusers.UNet2DModel.from_pretrained(root / "unet", variant=variant
                                                      ).state_dict()
    assert sorted(ck.tensors) == sorted(f"unet.{k}" for k in truth)
    for name, t in truth.items():
        assert _same(ck.read(f"unet.{name}"), t), name
    paths = [f.path for f in ck.files]
    assert "model_index.json" in paths and "scheduler/scheduler_config.json" in paths
    assert any(p.startswith("unet/diffusion_pytorch_model") for p in paths)
    assert ck.objects["model_index.json"]["_class_name"] == "DDPMPipeline"
    assert ck.objects["scheduler.scheduler_config.json"]["num_train_timesteps"] == 10
    for f in ck.files:  # every file with its layout
        assert f.nbytes == (root / f.path).stat().st_size


@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    base = tmp_path_factory.mktemp("st")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=16)).save_pretrained(
        base / "bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(25)]
    (base / "bert" / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(str(base / "bert" / "vocab.txt")).save_pretrained(base / "bert")
    word = Transformer(str(base / "bert"))
    dense = Dense(in_features=8, out_features=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SentenceTransformer(modules=[word, Pooling(8), dense]).save(str(base / "st"))
    return base / "st"


def test_sentence_transformers_model(sentence_model: Path) -> None:
    from sentence_transformers import SentenceTransformer

    ck = cl.open(sentence_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(sentence_model), device="cpu")
    root_truth = model[0].auto_model.state_dict()
    dense_truth = model[2].state_dict()
    want = set(root_truth) | {f"2_Dense.{k}" for k in dense_truth}
    assert set(ck.tensors) == want  # the root's module unprefixed, the Dense module's by path
    for name, t in root_truth.items():
        assert _same(ck.read(name), t), name
    for name, t in dense_truth.items():
        assert _same(ck.read(f"2_Dense.{name}"), t), name
    assert json.loads((sentence_model / "modules.json").read_text()) == ck.objects[
        "modules.json"]
    assert "1_Pooling.config.json" in ck.objects
    assert "2_Dense/model.safetensors" in [f.path for f in ck.files]


def test_inspect_names_the_components(pipelines: dict[str, Path], capsys: Any) -> None:
    assert main(["inspect", str(pipelines["safetensors"])]) == 0
    out = capsys.readouterr().out
    assert "unet.conv_in.weight" in out and "unet/diffusion_pytorch_model.safetensors" in out
    assert main(["inspect", str(pipelines["safetensors"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "hf" and any(t["name"] == "unet.conv_in.weight"
                                         for t in doc["tensors"])


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_peft_adapter(tmp_path: Path, safe: bool) -> None:
    """A LoRA adapter saved by PEFT's own ``save_pretrained`` (``adapter_model.safetensors``
    or ``.bin`` beside ``adapter_config.json``) opens under PEFT's names, each tensor what
    PEFT's ``load_peft_weights`` gives, the config a value."""
    if not os.environ.get("CI"):
        pytest.importorskip("peft")
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40,
                                     n_positions=16)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=2, target_modules=["c_attn"]))
    for p in model.parameters():  # LoRA's B starts at zero: give it values to compare
        if p.requires_grad:
            p.data.normal_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "adapter", safe_serialization=safe)
    truth = peft.utils.load_peft_weights(str(tmp_path / "adapter"), device="cpu")
    ck = cl.open(tmp_path / "adapter")
    assert set(ck.tensors) == set(truth) and len(truth) == 2
    for name, tensor in truth.items():
        assert _same(ck.read(name), tensor), name
    assert ck.objects["adapter_config.json"]["r"] == 2
