"""The ``ckptlab`` command.

Verbs (``ckptlab VERB --help`` tells each one's arguments):

- ``inspect [PATH] [--json] [--filter PATTERN] [--sort KEY] [--records]``: the tensors of
  any checkpoint file, directory or fsspec URL (PATH defaults to the embedded sample): a
  summary and the tensor table (``--filter`` and ``--sort`` are the one tensor query of
  :mod:`ckptlab.checkpoint.query`); ``--records`` shows its bytes instead.
- ``offsets PATH [--json] [--scan]``: where each tensor's bytes start: a torch.save file's
  storage data offsets, computed without random reads; for a safetensors file, a Hugging Face,
  DCP or plain directory, every tensor part's file, offset and bytes, from headers only; for a
  legacy, TorchScript or torch.export file, the same from its checkpoint model.
- ``sample PATH [--alignment N]``: write the embedded sample checkpoint (N: a power of two,
  1 to :data:`MAX_STORAGE_ALIGNMENT`).
- ``report [PATH] [-o OUT] [--compare OTHER] [--stats] [--steps]``: a self-contained
  offline HTML report with the figures, of any checkpoint file or directory (one section per
  file of a multi-file checkpoint); ``--compare`` opens it with what changed from PATH to
  OTHER, ``--stats`` adds every tensor's statistics, ``--steps`` (a training run's
  directory) how far each module moved between its consecutive saves.
- ``readiness PATH [--json]``: is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?
  What is 4 KiB aligned and what would align the rest, in the format's own terms; exit 0
  when ready, 1 when not.
- ``serve [PATH] [--port N] [--address A] [--show] [--compare OTHER]``: the interactive
  workbench (panel), for any checkpoint file or directory on this machine; the port opens at
  once on a quick page with the tensor table (:mod:`ckptlab.widgets.quick`), which becomes
  the workbench. With ``--compare`` the page shows what changed from PATH to OTHER.

- ``diff A B [--json] [--filter PATTERN] [--atol X] [--rtol Y] [--step N]``: what changed
  between two checkpoints of any formats (:func:`ckptlab.compare.diff`); exit 0 when nothing
  differs beyond the tolerances, 1 when something does, 2 on an error.

- ``stats PATH [--json] [--filter PATTERN] [--check] [--step N]``: each tensor's statistics
  (:func:`ckptlab.compare.stats`) and the health lines (NaN/Inf, all-zero, constant tensors,
  ranges far from their layer peers'); ``--check``: exit 1 when a tensor holds NaN or Inf.

- ``scan PATH... [--json]``: is a checkpoint safe to load? (:func:`ckptlab.safety.scan`) A
  line per file holding a pickle, its verdict (``weights-only``, ``data``, ``code``,
  ``unreadable``) and the code it would run; exit 0 when every file is weights-only, 1 when
  any is not, 2 on an error.

- ``convert SRC DST [--to safetensors|torch] [--shard-size SIZE] [--alignment N] [--step N]
  [--json]``: any checkpoint rewritten without running its pickle
  (:func:`ckptlab.write.convert.convert`): safetensors (one file, or a Hugging Face sharded
  directory) or a torch.save archive at any storage alignment; written under a temporary
  name, renamed into place, then verified tensor by tensor.

A training run's directory (saves side by side) is read as the save its framework resumes
from; ``--step N`` (inspect, offsets, report, readiness, serve, diff, stats) picks another
(:mod:`ckptlab.checkpoint.runs`).

Every verb but ``sample`` and ``serve`` also takes an fsspec URL (``https://``, ``s3://``,
``hf://``; the ``remote`` extra), read with ranged requests only.

``ckptlab --version`` prints ``ckptlab <version>``; ``ckptlab`` alone lists the verbs.

Every argument is checked before any work starts: numbers against their ranges, input paths
for existence and kind (a FIFO or a device is refused up front, so nothing blocks on it),
output paths for a directory to write into, the port for being free. Every failure, argparse's
own included, prints one line on stderr, ``ckptlab: error: <what, where, what to do>``, and
exits with status 2; no traceback (``CKPTLAB_TRACEBACK=1`` shows one for an unexpected error).
``--json`` prints one JSON object: indented when stdout is a terminal, one compact line
otherwise (for scripts).
"""

from __future__ import annotations

from ckptlab._lazy import lazy_attributes
from ckptlab.cli._args import MAX_STORAGE_ALIGNMENT, VERBS
from ckptlab.cli._main import main

# names of this package imported on first use; ``storage_offsets`` is looked up here when
# ``offsets`` runs (so a test can replace it)
__getattr__, __dir__ = lazy_attributes(__name__, globals(), {
    "storage_offsets": "ckptlab.format:storage_offsets",
    "checkpoint_json": "ckptlab.cli._text:checkpoint_json",
    "select_tensors": "ckptlab.cli._text:select_tensors",
    "render_checkpoint": "ckptlab.cli._text:render_checkpoint",
    "render_layout": "ckptlab.cli._text:render_layout",
    "checkpoint_offsets": "ckptlab.cli._offsets:checkpoint_offsets",
    "url_offsets": "ckptlab.cli._offsets:url_offsets",
})

__all__ = ["MAX_STORAGE_ALIGNMENT", "VERBS", "main"]
