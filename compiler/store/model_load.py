"""A model loaded for the stores: the export cache and the frozen shards of ``model/``.

Every command that loads a model, and every worker of a batch run, loads it here, so a second
process reuses the export on disk (``export_cache.py``) and an emitted ``model/`` links the
unpatched weights (``frozen_shards.py``). No torch import at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["load_with_stores"]


def load_with_stores(
    model: str | None,
    dtype: str,
    placement=None,
    on_stage: Callable[[str], None] | None = None,
):
    """Load ``model`` and enable it for the export cache and the frozen shards.

    Args:
        model: an alias, a model folder or a ``.gguf`` file; None: the bundled model.
        dtype: the model dtype (``float32``...).
        placement: a :class:`~ctxc.models.devices.Placement` (checked already), or None: the CPU.
        on_stage: told each step of a one-time GGUF conversion (minutes), or None.

    Returns:
        ``(model, tokenizer)``; a tokenizer loaded from a folder carries it as ``ctxc_files``
        (an emitted model copies its tokenizer files: ``backends/torch/model.py``).
    """
    from ctxc.models.load import load_model
    from ctxc.store import export_cache, frozen_shards, model_writing

    where = {}
    if placement is not None:
        where = {
            "device": placement.device,
            "device_map": placement.device_map,
            "max_memory": placement.max_memory,
        }
    net, tokenizer = load_model(model, dtype, on_stage=on_stage, **where)
    export_cache.enable(net)  # every command is a new process: reuse the export on disk (issue 11)
    frozen_shards.enable(net)  # its weights are as loaded: model/ links the unpatched ones
    model_writing.enable(net)  # what it writes from its prefix alone: the same at every bake
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    if source and Path(source).is_dir():
        # Loaded from this folder and never changed by the command line: an emitted model
        # copies its tokenizer files (backends/torch/model.py: save_tokenizer).
        tokenizer.ctxc_files = Path(source)
    return net, tokenizer
