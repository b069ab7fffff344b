"""The embedded default checkpoint: a small, deterministic GPT-style training state.

Everything here is built from a seeded generator, so two calls give equal tensors (the file's
``.data/serialization_id`` is the only byte that differs between two saves).
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ckptlab.errors import InvalidArgumentError

__all__ = ["sample_path", "tiny_checkpoint", "tiny_gpt", "write_sample"]

SAMPLE_VERSION = 1  # bump when the sample's content changes


def tiny_gpt(*, n_layer: int = 2, d_model: int = 64, vocab: int = 256,
             context: int = 32, seed: int = 0) -> OrderedDict[str, Any]:
    """A GPT-2-shaped model state dict.

    It has what real checkpoints have: an embedding and an LM head that share one storage
    (tied weights), a bfloat16 tensor (the position embedding), an int64 buffer
    (``position_ids``) and a bool buffer (the causal mask).

    Parameters
    ----------
    n_layer, d_model, vocab, context
        Model shape.
    seed
        Seed of the generator that fills the weights.

    Returns
    -------
    OrderedDict
        Parameter and buffer names to CPU tensors, in module order.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    sd: OrderedDict[str, Any] = OrderedDict()
    sd["transformer.wte.weight"] = randn(vocab, d_model)
    sd["transformer.wpe.weight"] = randn(context, d_model).to(torch.bfloat16)
    sd["transformer.position_ids"] = torch.arange(context, dtype=torch.int64)
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        sd[p + "ln_1.weight"] = torch.ones(d_model)
        sd[p + "ln_1.bias"] = torch.zeros(d_model)
        sd[p + "attn.c_attn.weight"] = randn(3 * d_model, d_model)
        sd[p + "attn.c_attn.bias"] = torch.zeros(3 * d_model)
        sd[p + "attn.c_proj.weight"] = randn(d_model, d_model)
        sd[p + "attn.c_proj.bias"] = torch.zeros(d_model)
        sd[p + "attn.bias"] = torch.ones(context, context, dtype=torch.bool).tril()
        sd[p + "ln_2.weight"] = torch.ones(d_model)
        sd[p + "ln_2.bias"] = torch.zeros(d_model)
        sd[p + "mlp.c_fc.weight"] = randn(4 * d_model, d_model)
        sd[p + "mlp.c_fc.bias"] = torch.zeros(4 * d_model)
        sd[p + "mlp.c_proj.weight"] = randn(d_model, 4 * d_model)
        sd[p + "mlp.c_proj.bias"] = torch.zeros(d_model)
    sd["transformer.ln_f.weight"] = torch.ones(d_model)
    sd["transformer.ln_f.bias"] = torch.zeros(d_model)
    # tied weights: a second tensor object over the embedding's storage, as state_dict() gives
    sd["lm_head.weight"] = sd["transformer.wte.weight"].detach()
    return sd


def tiny_checkpoint(*, seed: int = 0, **shape: int) -> dict[str, Any]:
    """A training checkpoint: model, AdamW optimizer state after a step, step and config.

    The optimizer state is the real ``torch.optim.AdamW.state_dict()`` (nested dicts keyed by
    parameter index, ``param_groups`` with tuples) after one step on deterministic gradients.
    """
    import torch

    model = tiny_gpt(seed=seed, **shape)
    params = [torch.nn.Parameter(t.detach().clone().float())
              for k, t in model.items() if t.is_floating_point() and k != "lm_head.weight"]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt.step()
    return {
        "model": model,
        "optimizer": opt.state_dict(),
        "step": 1,
        "config": {"arch": "tiny-gpt", "seed": seed, **shape},
    }


def write_sample(path: str | os.PathLike[str], *, alignment: int | None = None,
                 **save_config: Any) -> Path:
    """Write :func:`tiny_checkpoint` with torch.save.

    Parameters
    ----------
    path
        Destination file.
    alignment
        The storage alignment torch.save pads each storage's data to (torch's
        ``config.save.storage_alignment``; the ``alignment`` of :func:`ckptlab.predict_layout`
        and ``ckptlab sample --alignment``). Default: torch's, 64.
    **save_config
        Other ``torch.utils.serialization.config.save`` options, e.g. ``compute_crc32=False``.
        ``storage_alignment=`` is torch's name for ``alignment`` and is accepted too.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    InvalidArgumentError
        ``alignment`` and ``storage_alignment`` both given, with different values.
    """
    import torch
    from torch.utils.serialization import config

    if alignment is not None:
        given = save_config.setdefault("storage_alignment", alignment)
        if given != alignment:
            raise InvalidArgumentError(
                f"write_sample({str(path)!r}): alignment and storage_alignment name one idea "
                f"(expected one of them, or equal values; got alignment={alignment}, "
                f"storage_alignment={given})")
    path = Path(path)
    with config.patch({f"save.{k}": v for k, v in save_config.items()}):
        torch.save(tiny_checkpoint(), path)
    return path


def sample_path() -> Path:
    """The default sample file, written once into the user's cache directory."""
    base = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptlab"
            / f"sample-v{SAMPLE_VERSION}")
    target = base / "sample.pt"  # archive name "sample", as in the docs
    if not target.exists():
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base) as tmp:  # same name inside: same archive name
            os.replace(write_sample(Path(tmp) / target.name), target)
    return target
