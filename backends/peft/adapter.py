"""PEFT backend: the patch as a LoRA adapter for ``peft.PeftModel.from_pretrained(base, DIR)``.

A rank-r delta ``dW = u v^T`` of a linear layer is exactly a LoRA pair: ``lora_B = u`` [out, r],
``lora_A = v^T`` [r, in], with ``lora_alpha = r`` so the scaling ``alpha / r`` is 1. The target
modules are the exact module names; where ranks differ, ``rank_pattern``/``alpha_pattern`` say
so. A delta LoRA cannot hold (a norm scale, a bias, a parameter that is not a linear layer's
weight) goes through the format's own means: its module is listed in ``modules_to_save``, which
stores the module with its patched values (``Delta.materialize``, bit for bit the baked ones).

Unmerged, LoRA computes ``W x + u (v^T x)`` where the baked model computes ``(W + u v^T) x``: the
same in exact arithmetic, not in floating point. Blocks whose patch ends in a post-norm scale
change were solved against the baked computation, and their gain amplifies that rounding (tiny
on random models, far larger on trained ones); ``merge_and_unload()`` writes ``W + B A`` into the
weights, which is the baked weight again. The figures give both.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxc.backends.base import require_installed
from ctxc.backends.peft.card import write_card
from ctxc.backends.peft.facts import EXTRA, NAME, REQUIRES
from ctxc.backends.peft.figures import Against, PeftFigures
from ctxc.backends.peft.thresholds import PEFT_RTOL
from ctxc.backends.peft.write import fill_adapter, flags_kept, shared_copy
from ctxc.backends.reference import check_ids, reference_logits, torch_logits
from ctxc.core.checks import enforce, fidelity_limit
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import fidelity
from ctxc.models.identity import BaseIdentity, base_identity
from ctxc.models.offload import input_device
from ctxc.patch import Delta, Patch
from ctxc.runs.patched_forward import patched_logits

__all__ = ["ADAPTER_DIR", "DEFAULT_RTOL", "AdapterPlan", "PeftFigures", "emit_peft", "plan_adapter"]

ADAPTER_DIR = "adapter"

DEFAULT_RTOL = PEFT_RTOL  # the bound and why: backends/peft/thresholds.py


@dataclass(frozen=True)
class AdapterPlan:
    """How a patch maps onto a LoRA adapter.

    Attributes:
        lora: module name -> its weight's delta, for every LoRA target module.
        banks: parameter name -> delta, for stacked expert banks [E, ., .] that LoRA targets as
            parameters (``target_parameters``).
        modules_to_save: module names stored whole, with their patched parameters.
        fan_in_fan_out: the LoRA target modules store ``W.T`` (GPT-2 ``Conv1D``).
        r: the most common rank (LoRA's ``r``; ``lora_alpha`` equals it).
        rank_pattern: module name -> rank, for target modules of another rank.
    """

    lora: dict[str, Delta]
    banks: dict[str, Delta]
    modules_to_save: tuple[str, ...]
    fan_in_fan_out: bool
    r: int
    rank_pattern: dict[str, int]


def require_peft() -> None:
    """Raise a one-line CtxcError when PEFT is not installed."""
    require_installed(NAME, REQUIRES, EXTRA)


def plan_adapter(model: torch.nn.Module, patch: Patch) -> AdapterPlan:
    """Split ``patch`` into LoRA targets and modules stored whole.

    A module goes whole into ``modules_to_save`` unless all its deltas are LoRA's: one weight
    delta of a linear layer (``target_modules``), or expert-bank deltas of the rank ``r``
    (``target_parameters``).

    Args:
        model: the model the patch applies to (module types decide what LoRA can hold).
        patch: the patch.

    Returns:
        the :class:`AdapterPlan`.
    """
    by_module: dict[str, dict[str, Delta]] = {}
    for name, delta in patch.deltas.items():
        module, _, attr = name.rpartition(".")
        by_module.setdefault(module, {})[attr] = delta
    lora: dict[str, Delta] = {}
    banks: dict[str, dict[str, Delta]] = {}
    whole: list[str] = []
    for module, deltas in by_module.items():
        target = model.get_submodule(module)
        if len(deltas) == 1 and _lora_able(target, deltas.get("weight")):
            lora[module] = deltas["weight"]
        elif all(_bank_able(target, attr, d) for attr, d in deltas.items()):
            banks[module] = deltas
        else:
            whole.append(module)
    # One fan_in_fan_out for the whole config: the minority layout is stored whole.
    layouts = Counter(d.layout for d in lora.values())
    layout = layouts.most_common(1)[0][0] if layouts else "out_in"
    whole += [m for m, d in lora.items() if d.layout != layout]
    lora = {m: d for m, d in lora.items() if d.layout == layout}
    ranks = Counter(
        [d.rank for d in lora.values()] + [d.rank for ds in banks.values() for d in ds.values()]
    )
    r = ranks.most_common(1)[0][0] if ranks else 1
    # PEFT's parameter targets take neither a rank pattern nor fan_in_fan_out.
    keep = {
        m: ds
        for m, ds in banks.items()
        if layout == "out_in" and all(d.rank == r for d in ds.values())
    }
    whole += [m for m in banks if m not in keep]
    return AdapterPlan(
        lora=lora,
        banks={f"{m}.{attr}": d for m, ds in keep.items() for attr, d in ds.items()},
        modules_to_save=tuple(whole),
        fan_in_fan_out=layout == "in_out",
        r=r,
        rank_pattern={m: d.rank for m, d in lora.items() if d.rank != r},
    )


def _lora_able(target: torch.nn.Module, delta: Delta | None) -> bool:
    if delta is None or delta.u is None or delta.vector is not None or delta.experts:
        return False
    if delta.layout == "in_out":
        return type(target).__name__ == "Conv1D"  # transformers' GPT-2 Conv1D: W stored [in, out]
    return isinstance(target, torch.nn.Linear)


def _bank_able(target: torch.nn.Module, attr: str, delta: Delta) -> bool:
    param = getattr(target, attr, None)
    if not delta.experts or delta.u is None or not isinstance(param, torch.nn.Parameter):
        return False
    # PEFT reads the bank's orientation from the experts module's ``is_transposed``.
    transposed = bool(getattr(target, "is_transposed", False))
    return param.dim() == 3 and transposed == (delta.layout == "in_out")


def _lora_config(plan: AdapterPlan, base: BaseIdentity):
    from peft import LoraConfig

    if not plan.lora and not plan.banks:
        more = " ..." if len(plan.modules_to_save) > 3 else ""
        shown = ", ".join(plan.modules_to_save[:3]) + more
        raise CtxcError(
            "PEFT cannot hold this patch: a LoRA adapter needs at least one linear or expert-bank "
            f"delta, and this one only changes {shown} (use --emit torch or onnx)"
        )
    # The pattern keys are regular expressions matched against the end of a module's name.
    return LoraConfig(
        r=plan.r,
        lora_alpha=plan.r,
        target_modules=sorted(plan.lora),  # [] with only parameter targets, as PEFT asks
        target_parameters=sorted(plan.banks) or None,
        rank_pattern={re.escape(m): k for m, k in plan.rank_pattern.items()},
        alpha_pattern={re.escape(m): k for m, k in plan.rank_pattern.items()},
        modules_to_save=list(plan.modules_to_save) or None,
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=plan.fan_in_fan_out,
        task_type="CAUSAL_LM",
        inference_mode=True,
        base_model_name_or_path=base.load_path,
        revision=base.revision if base.kind == "hub" else None,
    )


def _write(
    model: torch.nn.Module, patch: Patch, plan: AdapterPlan, path: Path, base: BaseIdentity
) -> None:
    """Build the adapter with PEFT itself on a copy of ``model`` (its format, not a guess).

    PEFT writes ``target_modules`` from a set, in hash order: sorted, the file is the same in
    every run.
    """
    from peft import get_peft_model

    with flags_kept(model):
        peft_model = get_peft_model(shared_copy(model), _lora_config(plan, base))
        fill_adapter(peft_model.base_model.model, model, patch, plan)
        peft_model.save_pretrained(str(path))
    config = json.loads((path / "adapter_config.json").read_text())
    # PEFT writes the loaded folder's path (the private cache of a converted GGUF): what plain
    # from_pretrained loads offline instead (a folder, a GGUF file's folder, a cached repository
    # id; ctxc's alias means nothing to PEFT).
    config["base_model_name_or_path"] = base.load_path
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def emit_peft(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    rtol: float = DEFAULT_RTOL,
    dirname: str = ADAPTER_DIR,
    baked: torch.Tensor | None = None,
    bake_report: dict | None = None,
) -> tuple[Path, PeftFigures]:
    """Write ``out/adapter/``: ``adapter_config.json`` and ``adapter_model.safetensors``.

    The adapter is loaded back with ``PeftModel.from_pretrained`` on a copy of ``model`` and fed
    the query, as loaded and merged; ``model`` itself is not modified (its tensors are shared,
    not written; its ``requires_grad`` flags are put back).

    Args:
        model: the model the patch was computed on.
        patch: the patch.
        out: the output folder (created); the adapter goes to ``out/adapter``.
        full: the full-context logits at the query positions [k, vocab], if already computed.
        rtol: the bound on the merged adapter's difference from the torch patched model,
            relative to the largest logit.
        dirname: the adapter folder's name in ``out`` (``lora`` for the serving adapter).
        baked: ``model`` with the patch's weights fed the query [k, vocab], if already computed
            (``ctxc.compile``'s verification, ``CompileResult.patched_logits``).
        bake_report: a baked patch's report (its ``options`` and ``figures``), for the card:
            a bake's adapter is fitted, not exact, and its card gives the bake's figures.

    Returns:
        the adapter folder and its :class:`PeftFigures`.

    Raises:
        CtxcError: PEFT is missing, or the merged adapter does not reproduce the patched model.
    """
    require_peft()
    clock = time.perf_counter()
    path = out / dirname
    path.mkdir(parents=True, exist_ok=True)
    plan = plan_adapter(model, patch)
    query = check_ids(patch)[:1]
    if full is None:
        full = reference_logits(model, patch)
    base = base_identity(
        str(getattr(model, "ctxc_name", "") or patch.meta.model),
        str(getattr(model, "name_or_path", "")),
    )
    _write(model, patch, plan, path, base)

    # The adapter is loaded into a copy that shares the model's tensors and owns the patched
    # ones at their addresses modulo 64 (backends/peft/write.py): every kernel runs as on the
    # model, so the torch patched model's logits are the compile's own (``baked``, when given)
    # and the merged adapter must reproduce them.
    if baked is None:
        baked = patched_logits(model, patch, query[0].to(input_device(model)))
    baked = baked.float().cpu()
    as_loaded, merged = _loaded_logits(model, patch, path, query)
    tol = rtol * max(1.0, float(baked.abs().max()))
    merged_vs_patched = float((merged - baked).abs().max())
    enforce(
        f"{dirname}/",
        "merged vs the torch patched model: max |diff|",
        merged_vs_patched,
        tol,
        f"mean {float((merged - baked).abs().mean()):.3g}",
    )
    figures = PeftFigures(
        dir=dirname,
        lora_modules=len(plan.lora),
        lora_parameters=len(plan.banks),
        r=plan.r,
        rank_pattern=plan.rank_pattern,
        modules_to_save=plan.modules_to_save,
        lora=fidelity(as_loaded, full),
        merged=fidelity(merged, full),
        full_context_bound=fidelity_limit(patch.meta, full),
        as_loaded_vs_patched=Against(float((as_loaded - baked).abs().max()), None),
        merged_vs_patched=Against(merged_vs_patched, tol),
        note=_note(patch, plan),
        seconds=round(time.perf_counter() - clock, 3),
        saved_whole=dict(
            Counter(type(model.get_submodule(m)).__name__ for m in plan.modules_to_save)
        ),
        base=base,
    )
    write_card(path, patch, figures, base, bake_report)
    return path, figures


def _loaded_logits(model: torch.nn.Module, patch: Patch, path: Path, query: list) -> tuple:
    """The adapter at ``path`` loaded by PEFT on a shared copy of ``model``, fed ``query``:
    (logits as loaded, logits after ``merge_and_unload()``), each [k, vocab] on the CPU."""
    from peft import PeftModel

    with flags_kept(model):
        base = shared_copy(model, patch.deltas).eval()
        loaded = PeftModel.from_pretrained(base, str(path)).eval()
        (as_loaded,) = torch_logits(loaded, query)
        (merged,) = torch_logits(loaded.merge_and_unload(), query)
    return as_loaded, merged


def _note(patch: Patch, plan: AdapterPlan) -> str:
    parts = []
    if plan.modules_to_save:
        parts.append(
            f"{len(plan.modules_to_save)} module(s) whose deltas LoRA cannot hold (norm scales, "
            "biases, parameters of other modules) are stored whole in modules_to_save, with "
            "their patched values exactly"
        )
    if plan.banks:
        parts.append(
            f"{len(plan.banks)} expert bank(s) are LoRA target_parameters, which PEFT applies as "
            "W + dW, the baked weights"
        )
    if plan.lora:
        scaled = any(d.vector is not None for d in patch.deltas.values())
        why = (
            "; the post-norm scale changes were solved against the baked computation and "
            "amplify that rounding difference"
            if scaled
            else ""
        )
        parts.append(
            "as loaded, a LoRA target module computes W x + B (A x) where the baked model "
            f"computes (W + B A) x: equal up to rounding{why}; merge_and_unload() writes the "
            "baked weights"
        )
    return "; ".join(parts) + "."
