"""Helpers of the ``ctxc`` commands: input checks, model loading with progress, emitters.

Nothing here imports torch or Transformers at module level: ``ctxc --help`` must stay fast.
"""

from __future__ import annotations

from pathlib import Path

from ctxc.cli.progress import err, out, quiet_libraries, stage
from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import pause_point
from ctxc.core.textfile import read_text

__all__ = [
    "emit_checked",
    "err",
    "load",
    "out",
    "parse_emit",
    "read_context",
    "reload_fidelity",
    "written",
]


def read_context(path: Path) -> str:
    """The UTF-8 text of ``path`` (``ctxc.core.textfile.read_text``: one line naming the file
    for a missing, unreadable, empty or binary one)."""
    return read_text(path, "context file")


def parse_emit(emit: str, flag: str = "--emit") -> list[str]:
    """The backend names of a comma list; a CtxcError for an unknown one or a missing extra."""
    from ctxc.backends import parse_backends

    return parse_backends(emit, flag)


def load(model: str | None, dtype: str, placement=None):
    """Load the model, saying so on stderr; a one-time GGUF conversion is announced as such.

    The model is enabled for the export cache (``compiler/store/export_cache.py``).

    Args:
        placement: a :class:`~ctxc.models.devices.Placement` (checked already), or None: the CPU.

    Returns:
        ``(model, tokenizer)``.
    """
    pause_point("loading")
    stage(f"loading {model or 'the bundled model'}, {dtype}")
    quiet_libraries()  # imports torch: seconds, said above
    from ctxc.models.load import load_model

    where = {}
    if placement is not None:
        where = {
            "device": placement.device,
            "device_map": placement.device_map,
            "max_memory": placement.max_memory,
        }
    # Conversion steps take minutes: each stays as a line, on a terminal too.
    net, tokenizer = load_model(model, dtype, on_stage=lambda line: stage(line, keep=True), **where)
    from ctxc.store.export_cache import enable

    enable(net)  # every command is a new process: reuse the export on disk (issue 11)
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    if source and Path(source).is_dir():
        # Loaded from this folder and never changed by the command line: an emitted model
        # copies its tokenizer files (backends/torch/model.py: save_tokenizer).
        tokenizer.ctxc_files = Path(source)
    return net, tokenizer


def emit_checked(
    net, patch, tmp: Path, kinds: list[str], patchable: bool = False, full=None, **extra
):
    """Write the artefacts of ``kinds`` other than ``torch`` into ``tmp``; their figures by kind.

    Each emitter checks its artefact against the torch patched model, and its fidelity to the
    full context is held to the patch's solver figure (``ctxc.core.checks.gate``); each writes into
    a folder of its own, moved into ``tmp`` only once it passed. ``full``: the full-context
    logits at the query positions when the caller has them (``ctxc compile`` does). ``extra``:
    the keyword arguments some emitters take (``tokenizer``, ``gguf_type``: ``Backend.takes``).

    Raises:
        ArtefactError: an artefact failed (nothing of it is left in ``tmp``); its ``passed``
            holds the figures of those written before it.
    """
    from ctxc.backends import backend
    from ctxc.core.checks import gate, staged

    checked = [backend(k) for k in kinds if k != "torch"]
    if not checked:
        return {}
    if full is None:  # ctxc export: one full pass, shared by every emitter
        from ctxc.backends.torch.verify import reference_logits

        full = reference_logits(net, patch)
    figures: dict = {}
    for b in checked:
        stage(b.status)
        with staged(tmp, b.name, b.writes, figures) as sub:
            given = {k: extra[k] for k in b.takes if extra.get(k) is not None}
            _, found = b.load(patchable)(net, patch, sub, full=full, **given)
            gate(b.name, b.writes, found, patch.meta, full, extra.get("gguf_type"))
        figures[b.name] = found
    return figures


def written(kinds: list[str]) -> list[str]:
    """What a ``ctxc compile`` with ``kinds`` writes, for its closing line."""
    from ctxc.backends import backend

    return ["patch.safetensors", "report.json", *(backend(k).writes for k in kinds)]


def reload_fidelity(folder: Path, patch, dtype: str, full, like=None):
    """The written model folder, reloaded by plain Transformers and fed the query alone.

    Args:
        folder: the emitted ``model/``.
        patch: its query ids are fed.
        dtype: the model dtype name.
        full: the full-context logits at the query positions [k, vocab].
        like: the model it came from: the folder is reloaded placed as it was.

    Returns:
        the :class:`~ctxc.core.metrics.Fidelity` of the reloaded model against ``full``.

    Raises:
        CtxcError: the reloaded model gives non-finite logits.
    """
    from ctxc.backends.torch.verify import reloaded_logits
    from ctxc.core.metrics import fidelity

    logits = reloaded_logits(folder, patch.meta.query_ids, dtype, like)
    if not bool(logits.isfinite().all()):
        raise CtxcError("the written model gives non-finite logits: nothing was written")
    return fidelity(logits.to(full.device), full)
