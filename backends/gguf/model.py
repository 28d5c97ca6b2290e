"""GGUF backend: the patched model as one llama.cpp GGUF file (``--emit gguf``).

The patch is baked (``Patch.applied``), every tensor goes under llama.cpp's name and layout
(:mod:`gguf_names`), the metadata is the source GGUF's or the inverse of Transformers' GGUF
config map (:mod:`gguf_metadata`), written with the ``gguf`` package. Matrices are stored as
F32, F16 or BF16 (``--gguf-type``); vectors (norms) stay F32, as llama.cpp's converter keeps
them. The check loads the file back with Transformers' GGUF loader
(``from_pretrained(dir, gguf_file=...)``): every tensor must equal the patched one rounded to
the file's type, and with F32 the logits at the query must match the torch patched model's
within :data:`GGUF_ATOL`. When llama.cpp loads (``ctxc[llamacpp]``), the file is also run there
against llama.cpp's own full-context run on the unpatched GGUF (:mod:`gguf_llama_cpp`).
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ctxc.backends.gguf.llama_cpp.check import run_in_llama_cpp
from ctxc.backends.gguf.llama_cpp.run import LlamaCppFigures
from ctxc.backends.gguf.names import gguf_arch
from ctxc.backends.gguf.thresholds import GGUF_ATOL
from ctxc.backends.gguf.write import write_gguf
from ctxc.backends.reference import check_ids, reference_logits, torch_logits
from ctxc.core.checks import enforce
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.core.vocabulary import GGUF_F32, GGUF_TYPES, check_choice
from ctxc.patch import Patch

__all__ = [
    "GGUF_ATOL",
    "GGUF_FILE",
    "GGUF_TYPES",
    "GgufFigures",
    "emit_gguf",
]

GGUF_FILE = "model.gguf"


@dataclass(frozen=True)
class GgufFigures:
    """What the GGUF file holds and how Transformers' GGUF loader reproduces it.

    Attributes:
        file: the file, relative to the output folder.
        arch: ``general.architecture``.
        gguf_type: the matrices' type (vectors are F32).
        tensors: tensors written.
        metadata: ``source GGUF <name>`` (keys and tokenizer copied) or ``config``.
        max_tensor_diff: largest difference of a reloaded parameter from the patched one
            rounded to ``gguf_type``.
        reloaded: the file reloaded by Transformers, fed the query, against the full context.
        reloaded_vs_patched: ``max |logits|`` difference from the torch patched model.
        tolerance: the bound ``reloaded_vs_patched`` met (F32), or None (F16, BF16: the
            rounding of the weights is the format's, and reported).
        seconds: wall time of writing and checking.
        llama_cpp: the file run in llama.cpp against llama.cpp's full-context run on the
            unpatched GGUF of the same type (the bound it met is in it), or None.
        llama_cpp_skipped: why llama.cpp did not run (not installed, ...), or None.
    """

    file: str
    arch: str
    gguf_type: str
    tensors: int
    metadata: str
    max_tensor_diff: float
    reloaded: Fidelity
    reloaded_vs_patched: float
    tolerance: float | None
    seconds: float
    llama_cpp: LlamaCppFigures | None = None
    llama_cpp_skipped: str | None = None

    def to_dict(self) -> dict:
        """The JSON form written under ``"gguf"`` in ``report.json``."""
        return asdict(self)

    def fidelities(self) -> dict[str, Fidelity]:
        """The file reloaded by Transformers, held to the patch's figure by the gate."""
        return {"reloaded": self.reloaded}

    def summary(self) -> str:
        """One line for a terminal."""
        r = self.reloaded
        runtime = (
            f"; {self.llama_cpp.summary()}"
            if self.llama_cpp is not None
            else f"; not run in llama.cpp: {self.llama_cpp_skipped}"
        )
        return (
            f"gguf: {self.file} ({self.arch}, {self.gguf_type}, {self.tensors} tensors); "
            f"reloaded by Transformers vs full context max {r.max_abs_logit_diff:.3g}, top-1 "
            f"{top1_word(r.top1_match)}; vs patched {self.reloaded_vs_patched:.3g}"
            f"{runtime}"
        )


def _rounded(w: torch.Tensor, gguf_type: str) -> torch.Tensor:
    if w.ndim < 2 or gguf_type == GGUF_F32:
        return w.float().clone()  # a copy: the patch is removed from the live weights after
    return w.to(torch.float16 if gguf_type == "F16" else torch.bfloat16).float()


def _reloaded(
    out: Path, want: dict[str, torch.Tensor], query: list[torch.Tensor]
) -> tuple[float, torch.Tensor]:
    """``out/model.gguf`` reloaded by Transformers' GGUF loader.

    Returns:
        (largest difference of a reloaded parameter from ``want``, its logits at ``query``).
    """
    from transformers import AutoModelForCausalLM

    # Transformers' GGUF loader draws a tqdm bar on stderr whatever the progress-bar setting:
    # a failed check must stay one line there.
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = AutoModelForCausalLM.from_pretrained(
                str(out), gguf_file=GGUF_FILE, dtype=torch.float32
            ).eval()
    except RuntimeError as exc:  # "ignore_mismatched_sizes": shapes the GGUF config cannot say
        if "mismatched" not in str(exc):
            raise
        raise CtxcError(
            "Transformers' GGUF loader rebuilds this model with other parameter shapes (its "
            "GGUF config mapping does not carry every setting of this config, e.g. a head_dim "
            "other than the architecture's default); use --emit torch, onnx or peft"
        ) from None
    got = loaded.state_dict()
    tensor_diff = max(float((got[k].float() - v).abs().max()) for k, v in want.items())
    (reloaded,) = torch_logits(loaded, query)
    return tensor_diff, reloaded


def emit_gguf(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    tokenizer=None,
    gguf_type: str = GGUF_F32,
) -> tuple[Path, GgufFigures]:
    """Write ``out/model.gguf``: the patched model, and check it through Transformers' loader.

    ``model`` is patched for the writing and the reference run only (``Patch.applied``: its
    weights are restored exactly).

    Args:
        model: the model the patch was computed on.
        patch: the patch.
        out: the output folder (created).
        full: the full-context logits at the query positions [k, vocab], if already computed.
        tokenizer: the model's tokenizer (stored unless the model came from a GGUF file).
        gguf_type: ``F32``, ``F16`` or ``BF16`` for the matrices.

    Returns:
        the file and its :class:`GgufFigures`.

    Raises:
        CtxcError: an architecture or tokenizer the writer does not know, a reloaded file
            that does not reproduce the patched model, or (llama.cpp installed) a file further
            from llama.cpp's full-context run than its bound.
    """
    check_choice("gguf_type", gguf_type, GGUF_TYPES, "GGUF type")
    clock = time.perf_counter()
    gguf_arch(model)  # an unknown architecture fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    path = out / GGUF_FILE
    query = check_ids(patch)[:1]
    if full is None:
        full = reference_logits(model, patch)
    with patch.applied(model, check=False):
        count, metadata = write_gguf(model, tokenizer, path, gguf_type)
        (patched,) = torch_logits(model, query)
        want = {k: _rounded(v, gguf_type) for k, v in model.state_dict().items()}
    tensor_diff, reloaded = _reloaded(out, want, query)
    del want
    vs_patched = float((reloaded - patched).abs().max())
    tol = GGUF_ATOL if gguf_type == GGUF_F32 else None
    enforce(
        GGUF_FILE,
        "reloaded by Transformers vs the torch patched model: max |diff|",
        vs_patched,
        float("inf") if tol is None else tol,  # F16/BF16: rounded weights, no tolerance
        f"mean {float((reloaded - patched).abs().mean()):.3g}",
    )
    reloaded_fid = fidelity(reloaded, full)
    runs = run_in_llama_cpp(
        model,
        patch,
        what=GGUF_FILE,
        full=full,
        tokenizer=tokenizer,
        gguf_type=gguf_type,
        patched=path,
        own=reloaded_fid.max_abs_logit_diff,
        transformers_patched=patched,
    )
    figures = GgufFigures(
        file=GGUF_FILE,
        arch=gguf_arch(model).arch,
        gguf_type=gguf_type,
        tensors=count,
        metadata=metadata,
        max_tensor_diff=tensor_diff,
        reloaded=reloaded_fid,
        reloaded_vs_patched=vs_patched,
        tolerance=tol,
        seconds=round(time.perf_counter() - clock, 3),
        llama_cpp=runs.same_type,
        llama_cpp_skipped=runs.skipped,
    )
    return path, figures
