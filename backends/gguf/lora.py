"""llama.cpp LoRA GGUF backend (``--emit gguf-lora``): the serving adapter as ``lora.gguf``.

The layout of llama.cpp's ``convert_lora_to_gguf.py``: ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, and per patched weight ``<name>.lora_a``
(PEFT's ``lora_A``, [r, in]) and ``<name>.lora_b`` (``lora_B``, [out, r]) under the base
tensor's llama.cpp name (``blk.3.ffn_down.weight.lora_a``). llama.cpp scales each pair by
``alpha / r`` (``llama-adapter.cpp``), so with ``alpha = r`` the adapter adds ``u v^T``. The
check reads the file back with ``gguf.GGUFReader``, rebuilds every ``dW = (alpha/r) B A``, and
runs the model with ``W + dW`` against the torch patched model. When llama.cpp loads
(``ctxc[llamacpp]``), the adapter is also run there on the unpatched GGUF of its type (checked)
and on the GGUF the model came from (the bundled Q4_K_M file: reported), each against llama.cpp's
own full-context run on the same base (:mod:`gguf_llama_cpp`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ctxc.backends.gguf.llama_cpp.check import run_in_llama_cpp
from ctxc.backends.gguf.llama_cpp.run import LlamaCppFigures
from ctxc.backends.gguf.model import GGUF_ATOL
from ctxc.backends.gguf.names import gguf_arch, gguf_name
from ctxc.backends.gguf.write import tensor_array
from ctxc.backends.lora_pairs import servable_deltas
from ctxc.backends.reference import check_ids, reference_logits, torch_logits
from ctxc.core.checks import enforce
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.core.vocabulary import GGUF_F32, GGUF_TYPES, check_choice
from ctxc.patch import Patch

__all__ = ["GGUF_LORA_FILE", "GgufLoraFigures", "emit_gguf_lora", "write_gguf_lora"]

GGUF_LORA_FILE = "lora.gguf"


@dataclass(frozen=True)
class GgufLoraFigures:
    """What ``lora.gguf`` holds and how well its deltas reproduce the patch.

    Attributes:
        file: the file, relative to the output folder.
        arch: ``general.architecture`` (the base model's).
        gguf_type: the tensors' type.
        pairs: ``lora_a``/``lora_b`` pairs.
        alpha: ``adapter.lora.alpha``.
        max_delta_diff: largest ``|dW_file - dW_patch|`` over the patched weights.
        applied: the model with ``W + dW_file``, fed the query, against the full context.
        applied_vs_patched: ``max |logits|`` difference from the torch patched model.
        tolerance: the bound it met (F32), or None (F16, BF16: reported).
        seconds: wall time of writing and checking.
        llama_cpp: the adapter in llama.cpp on the unpatched GGUF of its type, against
            llama.cpp's full-context run on it (the bound it met is in it), or None.
        llama_cpp_source: the same on the GGUF file the model came from (the bundled Q4_K_M:
            what llama.cpp users run; reported, not checked), or None.
        llama_cpp_skipped: why llama.cpp did not run (not installed, ...), or None.
    """

    file: str
    arch: str
    gguf_type: str
    pairs: int
    alpha: float
    max_delta_diff: float
    applied: Fidelity
    applied_vs_patched: float
    tolerance: float | None
    seconds: float
    llama_cpp: LlamaCppFigures | None = None
    llama_cpp_source: LlamaCppFigures | None = None
    llama_cpp_skipped: str | None = None

    def to_dict(self) -> dict:
        """The JSON form written under ``"gguf-lora"`` in ``report.json``."""
        return asdict(self)

    def fidelities(self) -> dict[str, Fidelity]:
        """The deltas as llama.cpp applies them, held to the patch's figure by the gate."""
        return {"applied": self.applied}

    def summary(self) -> str:
        """One line for a terminal."""
        a = self.applied
        runtime = "".join(
            f"; {f.summary()}" for f in (self.llama_cpp, self.llama_cpp_source) if f is not None
        )
        if self.llama_cpp_skipped is not None:
            runtime = f"; not run in llama.cpp: {self.llama_cpp_skipped}"
        return (
            f"gguf-lora: {self.file} ({self.pairs} lora_a/lora_b pairs, {self.gguf_type}); "
            f"applied vs full context max {a.max_abs_logit_diff:.3g}, top-1 "
            f"{top1_word(a.top1_match)}; vs patched {self.applied_vs_patched:.3g}"
            f"{runtime}"
        )


def write_gguf_lora(
    model, patch: Patch, path: Path, gguf_type: str = GGUF_F32
) -> tuple[dict[str, str], float]:
    """Write the patch's linear deltas as llama.cpp's LoRA GGUF ``path`` (no check).

    Args:
        model: the model the patch was computed on (only read).
        patch: a patch of linear deltas of one rank.
        path: the file to write.
        gguf_type: ``F32``, ``F16`` or ``BF16``.

    Returns:
        ``(llama.cpp tensor name -> module path, alpha)``.

    Raises:
        CtxcError: a patch LoRA cannot serve, or a weight with no llama.cpp LoRA layout.
    """
    import gguf

    arch = gguf_arch(model)
    deltas = servable_deltas(model, patch, "--emit gguf-lora")
    alpha = float(next(iter(deltas.values())).rank)  # one rank: scale alpha / r = 1
    writer = gguf.GGUFWriter(str(path), arch.arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    names: dict[str, str] = {}
    for module, delta in deltas.items():
        name = gguf_name(arch, model.config.num_hidden_layers, f"{module}.weight")
        if name is None or (arch.permute_qk and (".attn_q." in name or ".attn_k." in name)):
            raise CtxcError(f"--emit gguf-lora: no llama.cpp LoRA layout for {module}.weight")
        assert delta.u is not None and delta.v is not None
        for suffix, w in (("lora_a", delta.v.T), ("lora_b", delta.u)):  # [r, in], [out, r]
            data, raw = tensor_array(w.float().contiguous().numpy(), gguf_type)
            writer.add_tensor(f"{name}.{suffix}", data, raw_dtype=raw)
        names[name] = module
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names, alpha


def _read(path: Path, names: dict[str, str], alpha: float) -> dict[str, torch.Tensor]:
    """module -> ``dW`` [out, in] float32, rebuilt from the file as llama.cpp applies it."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    got = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        got[t.name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    out = {}
    for name, module in names.items():
        a, b = got[f"{name}.lora_a"], got[f"{name}.lora_b"]  # [r, in], [out, r]
        out[module] = (alpha / a.shape[0]) * (b @ a)  # [out, in]
    return out


def _applied_logits(
    model: torch.nn.Module, dense: dict[str, torch.Tensor], query: list[torch.Tensor]
) -> torch.Tensor:
    """``model`` with ``W + dW`` for each module of ``dense``, fed ``query``: [k, vocab].

    Side effects: the weights are changed for the run and restored exactly.
    """
    kept = {m: model.get_parameter(f"{m}.weight").detach().clone() for m in dense}
    try:
        with torch.no_grad():
            for m, dw in dense.items():
                w = model.get_parameter(f"{m}.weight")
                w.copy_((w.float() + dw).to(w.dtype))
        (applied,) = torch_logits(model, query)
    finally:
        with torch.no_grad():
            for m, original in kept.items():
                model.get_parameter(f"{m}.weight").copy_(original)
    return applied


def emit_gguf_lora(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    gguf_type: str = GGUF_F32,
    tokenizer=None,
) -> tuple[Path, GgufLoraFigures]:
    """Write ``out/lora.gguf`` and check the deltas it holds.

    ``model``'s weights are changed for the check's run only and restored exactly.

    Args:
        model: the model the patch was computed on.
        patch: a patch of linear deltas of one rank (``--update lora``).
        out: the output folder (created).
        full: the full-context logits at the query positions [k, vocab], if computed.
        gguf_type: ``F32``, ``F16`` or ``BF16``.
        tokenizer: the model's tokenizer: llama.cpp's check writes the unpatched GGUF with it
            (without one, and no source GGUF, that check is skipped).

    Returns:
        the file and its :class:`GgufLoraFigures`.

    Raises:
        CtxcError: a patch LoRA cannot serve, an unknown architecture, (F32) a file whose
            deltas do not reproduce the patched model, or (llama.cpp installed) an adapter
            further from llama.cpp's full-context run than its bound.
    """
    check_choice("gguf_type", gguf_type, GGUF_TYPES, "GGUF type")
    clock = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    path = out / GGUF_LORA_FILE
    names, alpha = write_gguf_lora(model, patch, path, gguf_type)
    query = check_ids(patch)[:1]
    if full is None:
        full = reference_logits(model, patch)
    with patch.applied(model, check=False):
        (patched,) = torch_logits(model, query)
    diff, applied, vs, tol = _check_file(model, patch, path, names, alpha, patched, gguf_type)
    applied_fid = fidelity(applied, full)
    runs = run_in_llama_cpp(
        model,
        patch,
        what=GGUF_LORA_FILE,
        full=full,
        tokenizer=tokenizer,
        gguf_type=gguf_type,
        lora=path,
        own=applied_fid.max_abs_logit_diff,
        transformers_patched=patched,
    )
    figures = GgufLoraFigures(
        file=GGUF_LORA_FILE,
        arch=gguf_arch(model).arch,
        gguf_type=gguf_type,
        pairs=len(names),
        alpha=alpha,
        max_delta_diff=diff,
        applied=applied_fid,
        applied_vs_patched=vs,
        tolerance=tol,
        seconds=round(time.perf_counter() - clock, 3),
        llama_cpp=runs.same_type,
        llama_cpp_source=runs.source,
        llama_cpp_skipped=runs.skipped,
    )
    return path, figures


def _check_file(model, patch: Patch, path: Path, names, alpha, patched, gguf_type: str):
    """Read the file's deltas back, apply them, compare with the torch patched model.

    Returns:
        (largest delta difference, the applied logits [1, vocab], their max |diff| from
        ``patched``, the bound or None for rounded types).

    Raises:
        CheckFailed: (F32) the applied deltas do not reproduce the patched model.
    """
    query = check_ids(patch)[:1]
    dense = _read(path, names, alpha)
    diff = max(
        float((dw - patch.deltas[f"{m}.weight"].dense()).abs().max()) for m, dw in dense.items()
    )
    applied = _applied_logits(model, dense, query)
    vs = float((applied - patched).abs().max())
    tol = GGUF_ATOL if gguf_type == GGUF_F32 else None
    enforce(
        GGUF_LORA_FILE,
        "its deltas applied vs the torch patched model: max |diff|",
        vs,
        float("inf") if tol is None else tol,  # F16/BF16: rounded factors, no tolerance
        f"mean {float((applied - patched).abs().mean()):.3g}",
    )
    return diff, applied, vs, tol
