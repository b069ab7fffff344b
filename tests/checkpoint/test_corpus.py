"""The proof corpus: checkpoints written by the real libraries, read back by ``ckptlab.open``.

Each case is a directory written by transformers (``save_pretrained``, single file and sharded),
huggingface_hub (``save_torch_state_dict``, safetensors and ``.bin`` shards), accelerate
(``Accelerator.save_state``) or a real ``transformers.Trainer`` step (``checkpoint-1/``), from
tiny random-init models built from configs (no weights are downloaded). For every case:

- every file of the directory is in ``ck.files`` and its segments tile it;
- the tensor names, dtypes, shapes and strides are the library's own load's (``safe_open`` /
  ``load_file`` for safetensors, ``torch.load(weights_only=False)`` otherwise): model files'
  keys as they are, other files' tensors as ``<file>.<keys>``;
- ``ck.read(name)`` equals that load (``torch.equal``, same type, dtype, shape, stride);
- every contiguous part's bytes, read with ``open``/``seek``/``read``, are the tensor's bytes;
- where there is a ``config.json``, ``from_pretrained``'s state dict agrees tensor for tensor;
- opening imports nothing the files name (a fresh interpreter never imports transformers or
  accelerate, and no ``__reduce__`` in a file runs).

transformers 5 writes only safetensors (``safe_serialization=False`` is gone); the ``.bin``
layouts of transformers 4 (``pytorch_model.bin``, ``pytorch_model-0000k-of-0000n.bin`` with
``pytorch_model.bin.index.json``) are written with huggingface_hub's ``save_torch_state_dict``,
which transformers 4 called for them, and the plain ``torch.save(model.state_dict())`` with
torch itself.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint.model import Checkpoint
from ckptlab.errors import ArchiveError, CorruptArchiveError

SMALL_SHARD = "4KB"  # every tiny model below needs several shards at this size
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")


# -- the libraries' writers ---------------------------------------------------------------------
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def tiny_model(arch: str) -> Any:
    """A random-init model of ``arch`` from a config (seeded; hidden 16, 2 layers, vocab 64)."""
    import transformers as tf

    _quiet()
    tf.set_seed(0)
    if arch == "gpt2":  # tied lm_head
        cfg = tf.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    elif arch == "llama":  # grouped-query attention, bfloat16
        cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                             max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                             torch_dtype="bfloat16")
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    elif arch == "bert":  # tied decoder weight and bias
        cfg = tf.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, vocab_size=64, max_position_embeddings=32)
        model = tf.BertForMaskedLM(cfg)
    elif arch == "t5":  # shared embeddings tied three ways
        cfg = tf.T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2, vocab_size=64,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration"}


def write_hf(arch: str, variant: str, out: Path) -> None:
    """``arch``'s model in a directory the way ``variant`` writes it."""
    from huggingface_hub import save_torch_state_dict

    model = tiny_model(arch)
    if variant == "safetensors":
        model.save_pretrained(out)
    elif variant == "safetensors-sharded":
        model.save_pretrained(out, max_shard_size=SMALL_SHARD)
    elif variant == "fp16":  # model.fp16.safetensors
        model.half().save_pretrained(out, variant="fp16")
    elif variant == "fp16-sharded":  # model.safetensors.index.fp16.json
        model.half().save_pretrained(out, variant="fp16", max_shard_size=SMALL_SHARD)
    elif variant in ("bin", "bin-sharded"):  # transformers 4's .bin layouts
        out.mkdir(parents=True)
        model.config.save_pretrained(out)
        save_torch_state_dict(model.state_dict(), out, safe_serialization=False,
                              max_shard_size=SMALL_SHARD if variant == "bin-sharded" else "1GB")
    elif variant == "both":  # model.safetensors and pytorch_model.bin, as many Hub repos
        model.save_pretrained(out)
        save_torch_state_dict(model.state_dict(), out, safe_serialization=False)
    elif variant == "torch-save":  # torch.save(model.state_dict()): an OrderedDict
        out.mkdir(parents=True)
        model.config.save_pretrained(out)
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    else:
        raise ValueError(variant)


def mixed_state_dict(view: bool) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict (tied weights) plus bfloat16, float16, int64 and bool tensors, and
    with ``view`` a transposed view of another tensor (its safetensors writer refuses those)."""
    sd = dict(tiny_model("gpt2").state_dict())
    g = torch.Generator().manual_seed(1)
    sd["extra.bf16"] = torch.randn(5, 3, generator=g).bfloat16()
    sd["extra.f16"] = torch.randn(7, generator=g).half()
    sd["extra.steps"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    sd["extra.mask"] = torch.rand(4, generator=g) > 0.5
    if view:
        sd["extra.wte_t"] = sd["transformer.wte.weight"].t()
    return sd


def write_hub(variant: str, out: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True)
    save_torch_state_dict(mixed_state_dict(view=variant == "bin"), out, max_shard_size=SMALL_SHARD,
                          safe_serialization=variant == "safetensors")


class _Counter:
    """A custom object registered with ``Accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = torch.arange(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "note": "custom"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def write_accelerate(variant: str, out: Path) -> None:
    """``Accelerator().save_state`` on CPU: model, AdamW after one step, a scheduler, RNG
    states and a registered custom object."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    _quiet()
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(_Counter())
    loss = model(torch.randn(3, 4)).sum()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    accelerator.save_state(str(out), safe_serialization=variant == "safetensors")


def write_trainer(out: Path) -> Path:
    """One real ``transformers.Trainer`` step on CPU with ``save_steps=1``: ``checkpoint-1/``."""
    import transformers as tf

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(8) * (i + 1)) % 64
            return {"input_ids": ids, "labels": ids}

    model = tiny_model("gpt2").train()
    args = tf.TrainingArguments(output_dir=str(out), max_steps=1, save_steps=1,
                                per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                logging_steps=1)
    tf.Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return out / "checkpoint-1"


# -- the cases ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    write: Callable[[Path], Path | None]  # writes the directory (returns it if elsewhere)
    model_class: str | None = None  # transformers class for from_pretrained
    bug: str | None = None  # why ckptlab cannot open it yet (an xfail, strict)
    variant: str | None = None  # save_pretrained's variant


CASES: dict[str, Case] = {}
for _arch in MODEL_CLASSES:
    for _variant in ("safetensors", "safetensors-sharded", "bin", "bin-sharded"):
        CASES[f"{_arch}-{_variant}"] = Case(
            lambda out, a=_arch, v=_variant: write_hf(a, v, out), MODEL_CLASSES[_arch])
for _variant in ("fp16", "fp16-sharded"):
    CASES[f"gpt2-{_variant}"] = Case(lambda out, v=_variant: write_hf("gpt2", v, out),
                                     "GPT2LMHeadModel", variant="fp16")
CASES["gpt2-both"] = Case(lambda out: write_hf("gpt2", "both", out), "GPT2LMHeadModel")
CASES["gpt2-torch-save"] = Case(lambda out: write_hf("gpt2", "torch-save", out),
                                "GPT2LMHeadModel")
CASES["hub-safetensors-sharded"] = Case(lambda out: write_hub("safetensors", out))
CASES["hub-bin-sharded"] = Case(lambda out: write_hub("bin", out))
CASES["accelerate"] = Case(lambda out: write_accelerate("safetensors", out))
CASES["accelerate-bin"] = Case(lambda out: write_accelerate("bin", out))
CASES["trainer"] = Case(write_trainer, "GPT2LMHeadModel")


def case_params(select: Callable[[str, Case], bool] = lambda n, c: True) -> list[Any]:
    out = []
    for name, case in CASES.items():
        if not select(name, case):
            continue
        marks = [pytest.mark.xfail(strict=True, raises=CorruptArchiveError, reason=case.bug)] \
            if case.bug else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


class Corpus:
    """Each case's directory, written on first use (once per module)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: dict[str, Path] = {}

    def dir(self, name: str) -> Path:
        if name not in self.dirs:
            out = self.root / name
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.dirs[name] = CASES[name].write(out) or out
        return self.dirs[name]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    with pytest.MonkeyPatch.context() as mp:  # nothing reaches the network
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        yield Corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def opened() -> dict[str, Checkpoint]:
    return {}


def open_case(corpus: Corpus, opened: dict[str, Checkpoint], name: str) -> Checkpoint:
    if name not in opened:
        opened[name] = cl.open(corpus.dir(name))
    return opened[name]


# -- the libraries' own loads -------------------------------------------------------------------
def model_files(root: Path) -> set[str]:
    """The files whose keys are the tensors' names as they are (no file prefix): the shards
    of the index, else the single weights file (plain names before variants)."""
    index = hf_index(root)
    if index is not None:
        return set(json.loads(index.read_text())["weight_map"].values())
    for name in (*HF_SINGLE, "model.fp16.safetensors"):
        if (root / name).exists():
            return {name}
    return set()


def hf_index(root: Path) -> Path | None:
    for name in (*HF_INDEXES, "model.safetensors.index.fp16.json"):
        if (root / name).exists():
            return root / name
    return None


def library_load(path: Path) -> Any:
    """What the library that wrote ``path`` gives back for it (None: not a checkpoint)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        loaded = load_file(path)
        with safe_open(path, "pt") as f:
            assert sorted(f.keys()) == sorted(loaded)
        return loaded
    if path.suffix in CHECKPOINT_SUFFIXES and path.read_bytes()[:2] == b"PK":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, weights_only=False)
    return None


def flatten(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, tensor) for each tensor in dicts, lists and tuples, in their order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, (*path, i))


def expected_tensors(root: Path) -> dict[str, tuple[str, tuple[Any, ...], torch.Tensor]]:
    """name -> (file, path, tensor) as the libraries load the directory."""
    models = model_files(root)
    out = {}
    for name in sorted(os.listdir(root)):
        loaded = library_load(root / name)
        if loaded is None:
            continue
        prefix = () if name in models else (name,)
        for keys, tensor in flatten(loaded):
            path = (*prefix, *keys)
            out[".".join(str(k) for k in path)] = (name, path, tensor)
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert type(got) is type(want), (what, type(got), type(want))
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.stride() == want.stride(), (what, got.stride(), want.stride())
    assert got.requires_grad == want.requires_grad, what
    assert torch.equal(got, want), what


# -- the checks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", case_params())
def test_every_file_is_listed_and_tiled(corpus: Corpus, opened, name: str) -> None:
    ck = open_case(corpus, opened, name)
    root = corpus.dir(name)
    on_disk = sorted(n for n in os.listdir(root) if (root / n).is_file())
    assert sorted(f.path for f in ck.files) == on_disk
    for f in ck.files:
        assert f.nbytes == (root / f.path).stat().st_size, f.path
        segments = sorted(f.segments, key=lambda s: s.offset)
        end = 0
        for s in segments:
            assert s.offset == end and s.nbytes > 0, (f.path, s, end)
            end = s.offset + s.nbytes
        assert end == f.nbytes, (f.path, end, f.nbytes)
        if library_load(root / f.path) is not None:
            assert f.format in ("safetensors", "torch-zip"), (f.path, f.format)
        elif f.path.endswith(".json"):
            assert f.format == "json"
    json.dumps(ck.to_dict())  # the CLI's --json never meets a value it cannot write


@pytest.mark.parametrize("name", case_params())
def test_tensors_are_the_library_load(corpus: Corpus, opened, name: str) -> None:
    ck = open_case(corpus, opened, name)
    want = expected_tensors(corpus.dir(name))
    assert sorted(ck.tensors) == sorted(want), sorted(set(ck.tensors) ^ set(want))
    for tname, (file, path, tensor) in want.items():
        entry = ck.tensors[tname]
        assert entry.file == file and entry.path == path, (tname, entry.file, entry.path)
        assert entry.dtype == str(tensor.dtype).removeprefix("torch."), tname
        assert entry.shape == tuple(tensor.shape), tname
        assert entry.stride == tensor.stride(), tname
        assert entry.kind == "dense", tname
        same_tensor(ck.read(tname), tensor, tname)


@pytest.mark.parametrize("name", case_params())
def test_parts_are_the_tensor_bytes(corpus: Corpus, opened, name: str) -> None:
    ck = open_case(corpus, opened, name)
    root = corpus.dir(name)
    want = expected_tensors(root)
    for tname, entry in ck.tensors.items():
        assert [p.role for p in entry.parts] == ["data"], tname
        part = entry.parts[0]
        assert 0 <= part.offset <= part.offset + part.nbytes <= ck.file(part.file).nbytes
        if not part.contiguous:
            continue
        with open(root / part.file, "rb") as fh:
            fh.seek(part.offset)
            raw = fh.read(part.nbytes)
        assert raw == raw_bytes(want[tname][2]), tname


@pytest.mark.parametrize("name", case_params(lambda n, c: c.model_class is not None))
def test_from_pretrained_agrees(corpus: Corpus, opened, name: str) -> None:
    import transformers

    ck = open_case(corpus, opened, name)
    root = corpus.dir(name)
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, case.model_class).from_pretrained(
            root, variant=case.variant)
    sd = model.state_dict()
    models = model_files(root)
    stored = {n for n, t in ck.tensors.items() if t.file in models}
    assert stored <= set(sd), sorted(stored - set(sd))
    for key, tensor in sd.items():
        if key in stored:
            same_tensor(ck.read(key), tensor, key)
        else:  # not in the files: a tied weight, the same storage as one that is
            ptr = tensor.untyped_storage().data_ptr()
            assert any(sd[k].untyped_storage().data_ptr() == ptr for k in stored), key


@pytest.mark.parametrize("name", case_params(lambda n, c: "sharded" in n))
def test_index_names_each_tensor_file(corpus: Corpus, opened, name: str) -> None:
    index = hf_index(corpus.dir(name))
    assert index is not None
    weight_map = json.loads(index.read_text())["weight_map"]
    ck = open_case(corpus, opened, name)
    assert len(set(weight_map.values())) >= 2
    assert ck.format == "hf"
    stored = {n: t.file for n, t in ck.tensors.items() if t.file in set(weight_map.values())}
    assert stored == weight_map


def test_each_file_alone_has_its_keys(corpus: Corpus) -> None:
    """Opening one file gives its own keys (no prefix), for every file the libraries wrote."""
    seen = 0
    for name, case in CASES.items():
        if case.bug:
            continue
        root = corpus.dir(name)
        for fname in sorted(os.listdir(root)):
            loaded = library_load(root / fname)
            if loaded is None:
                continue
            ck = cl.open(root / fname)
            want = {".".join(map(str, p)): t for p, t in flatten(loaded)}
            assert sorted(ck.tensors) == sorted(want), (name, fname)
            for tname, tensor in want.items():
                same_tensor(ck.read(tname), tensor, f"{name}/{fname}:{tname}")
            seen += 1
    assert seen > 40


def test_trainer_checkpoint(corpus: Corpus, opened) -> None:
    """``checkpoint-1/`` of a real Trainer: optimizer and RNG tensors by name, the numpy RNG
    state and TrainingArguments as inert values, trainer_state.json as itself."""
    ck = open_case(corpus, opened, "trainer")
    root = corpus.dir("trainer")
    assert ck.format == "hf"
    rng = torch.load(root / "rng_state.pth", weights_only=False)
    same_tensor(ck.read("rng_state.pth.cpu"), rng["cpu"], "rng_state.pth.cpu")
    assert ck.tensors["rng_state.pth.cpu"].dtype == "uint8"
    optimizer = torch.load(root / "optimizer.pt", weights_only=False)
    assert {n for n in ck.tensors if n.startswith("optimizer.pt.state.")} == {
        f"optimizer.pt.state.{i}.{k}" for i, s in optimizer["state"].items() for k in s}
    objects = ck.objects
    assert objects["trainer_state.json"] == json.loads((root / "trainer_state.json").read_text())
    assert objects["optimizer.pt.param_groups"][0]["lr"] == optimizer["param_groups"][0]["lr"]
    numpy_state = json.dumps(objects["rng_state.pth.numpy"])
    assert "MT19937" in numpy_state  # the bit generator's name; the array stays inert
    args = objects["training_args.bin"]
    assert args["type"] == "transformers.training_args.TrainingArguments"
    assert '"max_steps": 1' in json.dumps(args)


def test_accelerate_state(corpus: Corpus, opened) -> None:
    ck = open_case(corpus, opened, "accelerate")
    formats = {f.path: f.format for f in ck.files}
    assert formats == {"custom_checkpoint_0.pkl": "torch-zip", "model.safetensors": "safetensors",
                       "optimizer.bin": "torch-zip", "random_states_0.pkl": "torch-zip",
                       "scheduler.bin": "torch-zip"}
    assert "random_states_0.pkl.torch_manual_seed" in ck.tensors
    assert ck.objects["custom_checkpoint_0.pkl.note"] == "custom"
    assert json.dumps(ck.objects["random_states_0.pkl.numpy_random_seed"])


class _Copy:
    """Unpickling this copies ``source`` to ``marker``: proof that a pickle ran."""

    def __init__(self, source: str, marker: str) -> None:
        self.source, self.marker = source, marker

    def __reduce__(self) -> Any:
        import shutil

        return (shutil.copyfile, (self.source, self.marker))


def test_foreign_files_are_listed_never_run(corpus: Corpus, tmp_path: Path) -> None:
    """A plain pickle beside a checkpoint is listed as "other" with a note; a torch.save file
    whose pickle calls a function is described, and neither runs."""
    import shutil

    root = tmp_path / "state"
    shutil.copytree(corpus.dir("accelerate"), root)
    marker = tmp_path / "ran"
    copy = _Copy(str(root / "scheduler.bin"), str(marker))
    (root / "sampler.pkl").write_bytes(pickle.dumps({"copy": copy}, protocol=4))
    torch.save({"w": torch.ones(2), "copy": copy}, root / "custom_checkpoint_1.pkl")
    (root / "README.txt").write_text("notes")
    ck = cl.open(root)
    formats = {f.path: f.format for f in ck.files}
    assert formats["README.txt"] == "other"
    assert any(n.startswith("README.txt") for n in ck.notes), ck.notes
    if formats["sampler.pkl"] == "other":
        assert any(n.startswith("sampler.pkl") for n in ck.notes), ck.notes
    else:  # read as a pickle: its values are inert
        assert "shutil.copyfile" in json.dumps(ck.to_dict()["objects"])
    assert torch.equal(ck.read("custom_checkpoint_1.pkl.w"), torch.ones(2))
    assert "shutil.copyfile" in json.dumps(ck.objects["custom_checkpoint_1.pkl.copy"])
    assert not marker.exists()


def test_a_damaged_side_file_is_noted_and_the_rest_opens(corpus: Corpus, tmp_path: Path
                                                         ) -> None:
    """An interrupted save of optimizer.bin (cut in half) does not hide the model: the file is
    listed as "other" with the reason; alone in a directory, its own error is raised."""
    import shutil

    root = tmp_path / "state"
    shutil.copytree(corpus.dir("accelerate"), root)
    whole = (root / "optimizer.bin").read_bytes()
    (root / "optimizer.bin").write_bytes(whole[: len(whole) // 2])
    ck = cl.open(root)
    assert ck.file("optimizer.bin").format == "other"
    assert any(n.startswith("optimizer.bin") for n in ck.notes), ck.notes
    assert not any(n.startswith("optimizer.bin.") for n in ck.tensors)
    assert set(ck.tensors) >= set(cl.open(corpus.dir("accelerate") / "model.safetensors").tensors)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(root / "optimizer.bin", alone)
    with pytest.raises(ArchiveError, match=r"optimizer\.bin"):
        cl.open(alone)


def test_opening_imports_nothing_the_files_name(corpus: Corpus) -> None:
    """In a fresh interpreter, opening and reading every case imports neither transformers nor
    accelerate (their classes are named by training_args.bin, the schedulers, ...)."""
    dirs = [str(corpus.dir(n)) for n, c in CASES.items() if not c.bug]
    code = (
        "import sys, ckptlab\n"
        "for d in sys.argv[1:]:\n"
        "    ck = ckptlab.open(d)\n"
        "    [ck.read(n) for n in ck.tensors]\n"
        "    ck.objects\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'accelerate', 'huggingface_hub', 'tests'))\n"
        "print(bad)\n")
    run = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True,
                         timeout=120, cwd=str(corpus.root))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
