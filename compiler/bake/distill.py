"""``method="distill"``: a LoRA of the patch's rank trained by context distillation.

The student is the model with a PEFT LoRA on every MLP linear the fit patches, fed the query
alone; the teacher is the same model fed the context and the query. The loss is KL(teacher ||
student) at every position of the fit data (the fit's constraints), over the teacher's top
``TOP`` tokens (the rest of the vocabulary carries under 1e-3 of the mass on the contexts
measured; storing all 262k logits per position would not fit). Seeded; AdamW. The trained
factors become a :class:`~ctxc.patch.Patch` (``dW = (alpha / r) B A``), so every backend takes
it. The model is left as it was (the LoRA layers are unloaded). Training runs for a step count
or, given a time budget (``options.distill_seconds``), until that wall time is spent; the
:class:`DistillRun` says how many steps it reached.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from ctxc.bake.data import FitData
from ctxc.core.vocabulary import DISTILL_METHOD, OFF_TOPIC_KINDS
from ctxc.patch import Delta, Patch, PatchMeta

__all__ = ["TOP", "DistillRun", "distill", "teacher_top"]

TOP = 256  # teacher tokens kept per position


@dataclass(frozen=True)
class DistillRun:
    """What :func:`distill` trained.

    Attributes:
        patch: the distilled :class:`Patch`.
        rank: the LoRA's rank.
        steps: optimiser steps taken.
        seconds: wall time of the training loop (the teacher's runs not included).
        loss: the last step's loss (mean KL per position over the teacher's top tokens).
    """

    patch: Patch
    rank: int
    steps: int
    seconds: float
    loss: float


def teacher_top(model: torch.nn.Module, data: FitData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The teacher's top-``TOP`` log-probabilities and their token ids at each fit position.

    The context runs once per chunk of queries and its KV cache is continued by each
    (:func:`~ctxc.bake.evaluate.reference`: the full input's values up to rounding), not once
    per query: 32 queries after a 390-token context took 35 s one by one.

    Returns:
        per query ``(logp [k, TOP] float32, ids [k, TOP] int64)``.
    """
    from ctxc.bake.evaluate import chunks, reference

    out = []
    for part in chunks(data):
        for logits in reference(model, part, 0).logits:  # [k, vocab] each
            logp = logits.log_softmax(-1)  # [k, vocab]
            top = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
            out.append((top.values, top.indices))
    return out


def own_teacher(
    model: torch.nn.Module,
    data: FitData,
    teacher: list[tuple[torch.Tensor, torch.Tensor]],
    kinds,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``teacher`` with the queries of ``kinds`` taught by the unpatched model fed what the
    student is fed (prefix + query, no context): the LoRA held to change nothing there
    (``BakeOptions.off_topic_targets`` ``none``, as :func:`~ctxc.bake.targets.own_targets` holds
    the fit), a KL to the base model on off-topic text.

    Returns:
        the same list, those queries' entries replaced (``teacher`` itself when none is).
    """
    picked = [i for i, k in enumerate(data.kinds) if k in kinds]
    if not picked:
        return teacher
    own = teacher_top(model, data.alone(picked))
    out = list(teacher)
    for i, (logp, ids) in zip(picked, own, strict=True):
        k = teacher[i][1].shape[0]  # the student's matched positions: the last k
        out[i] = (logp[logp.shape[0] - k :], ids[ids.shape[0] - k :])
    return out


def _lora_targets(blocks, attention: bool = False) -> dict[str, str]:
    """Module path -> block path of every linear the fit moves (inner and outer; the attention
    output projections too with ``attention``)."""
    found = {s.module: b.path for b in blocks.blocks for s in (*b.inner, b.outer)}
    if attention:
        found |= {b.attention.site.module: b.path for b in blocks.blocks if b.attention}
    return found


def distill(
    model: torch.nn.Module,
    blocks,
    data: FitData,
    options,
    meta: PatchMeta,
    start: Patch | None = None,
    on_step: Callable[[int, int, str], None] | None = None,
    teacher: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DistillRun:
    """Train the LoRA and return it as a patch (the model is restored afterwards).

    Args:
        model: the unpatched model.
        blocks: its block map (which linears get a LoRA).
        data: the fit data.
        options: the :class:`~ctxc.bake.driver.BakeOptions` (rank, steps or seconds, lr, seed); rank
            None: full rank (each matrix's smallest side, the largest of them).
        meta: the patch's metadata.
        start: the fit's patch to start from: its matrices initialise the LoRA (truncated to
            the rank), its vector deltas stay applied during training and join the result.
        on_step: progress callback ``(step, steps, "distill")`` (steps 0 under a time budget).
        teacher: :func:`teacher_top` of ``data``, when already computed.

    Returns:
        the :class:`DistillRun`.
    """
    from peft import LoraConfig, get_peft_model

    targets = _lora_targets(blocks, options.moves_attention)
    rank = options.rank or max(min(model.get_parameter(f"{m}.weight").shape) for m in targets)
    teacher = teacher if teacher is not None else teacher_top(model, data)
    if options.off_topic_targets == "none":
        teacher = own_teacher(model, data, teacher, OFF_TOPIC_KINDS)
    vectors = {n: d for n, d in (start.deltas if start else {}).items() if d.vector is not None}
    fixed = Patch(vectors, meta) if vectors else None
    torch.manual_seed(options.seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), lora_dropout=0.0)
    if fixed is not None:
        fixed.apply(model, check=False)
    peft_model = get_peft_model(model, config)
    try:
        if start is not None:
            _init_from(peft_model, start, targets, rank)
        steps, seconds, loss = _train(peft_model, data, teacher, options, on_step)
        deltas = _deltas(peft_model, targets, rank)
    finally:
        peft_model.unload()
        if fixed is not None:
            fixed.remove(model)
    deltas.update(vectors)
    ordered = {n: deltas[n] for n in _param_order(model, deltas)}
    return DistillRun(Patch(ordered, meta), rank, steps, seconds, loss)


def _param_order(model: torch.nn.Module, deltas: dict) -> list[str]:
    return [n for n, _ in model.named_parameters() if n in deltas]


def _lora_layers(peft_model, targets: dict[str, str]):
    for name, module in peft_model.base_model.model.named_modules():
        if name in targets and hasattr(module, "lora_A"):
            yield name, module


def _init_from(peft_model, start: Patch, targets: dict[str, str], rank: int) -> None:
    """LoRA factors from the fit's deltas: the top-``rank`` SVD split evenly (scaling 1)."""
    with torch.no_grad():
        for name, module in _lora_layers(peft_model, targets):
            delta = start.deltas.get(f"{name}.weight")
            if delta is None or delta.u is None:
                continue
            dw = delta.dense() if delta.layout == "out_in" else delta.dense().T  # [out, in]
            u, s, vh = torch.linalg.svd(dw, full_matrices=False)
            r = min(rank, s.numel())
            root = s[:r].sqrt()
            module.lora_B["default"].weight.zero_()
            module.lora_A["default"].weight.zero_()
            module.lora_B["default"].weight[:, :r] = u[:, :r] * root  # [out, r]
            module.lora_A["default"].weight[:r] = root[:, None] * vh[:r]  # [r, in]


def _train(peft_model, data: FitData, teacher, options, on_step) -> tuple[int, float, float]:
    """The training loop; (steps taken, seconds, last loss)."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(options.seed)
    n, batch = len(data.queries), min(4, len(data.queries))
    weight = options.off_topic_weight  # an off-topic row's positions, as the fit weighs them
    head = _precision(peft_model, options.distill_precision)
    budget = options.distill_seconds
    steps = 0 if budget is not None else options.distill_steps
    clock, step, last = time.perf_counter(), 0, float("nan")
    # A time budget checks the clock before each step: at least one step, then until spent.
    while (step < steps) if budget is None else (step == 0 or time.perf_counter() - clock < budget):
        picks = torch.randperm(n, generator=gen)[:batch].tolist()
        loss = torch.zeros(())
        count = 0
        for i in picks:
            with head:
                logits = peft_model(input_ids=torch.tensor([data.reduced(i)])).logits[0].float()
            t_logp, t_ids = teacher[i]  # [k, TOP]: the matched positions, the last k
            logp = logits[logits.shape[0] - t_ids.shape[0] :].log_softmax(-1)  # [k, vocab]
            got = logp.gather(-1, t_ids)  # [k, TOP]
            w = weight if data.kinds[i] in OFF_TOPIC_KINDS else 1.0
            loss = loss + w * (t_logp.exp() * (t_logp - got)).sum()
            count += w * t_ids.shape[0]
        loss = loss / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        step, last = step + 1, float(loss.detach())
        if on_step is not None:
            on_step(step, steps, DISTILL_METHOD)
    return step, time.perf_counter() - clock, last


class _NarrowHead(contextlib.AbstractContextManager):
    """Within the block, the model's output head multiplies in bfloat16 (a copy of its weight
    made once, half its size): the largest product of each training step, Gemma 3's 262,144 x
    640 head at every position, forward and backward. Gradients reach the hidden states in
    bfloat16 precision; the loss is taken in float32."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.head = head
        self.weight = head.weight.detach().to(torch.bfloat16)  # [vocab, d]
        self.bias = None if head.bias is None else head.bias.detach().to(torch.bfloat16)

    def __enter__(self) -> _NarrowHead:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias)

        self.head.forward = forward  # type: ignore[method-assign,assignment]  # the instance's
        return self

    def __exit__(self, *exc) -> None:
        del self.head.forward


def _precision(model: torch.nn.Module, name: str) -> contextlib.AbstractContextManager:
    """The training forward's precision (``BakeOptions.distill_precision``): the head in
    bfloat16 where it is a plain ``nn.Linear`` (not one accelerate moves in and out per call),
    else the model's own."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    plain = isinstance(head, torch.nn.Linear) and not hasattr(head, "_hf_hook")
    if name == "bfloat16" and plain:
        return _NarrowHead(cast(torch.nn.Linear, head))
    return contextlib.nullcontext()


def _deltas(peft_model, targets: dict[str, str], rank: int) -> dict[str, Delta]:
    out = {}
    for name, module in _lora_layers(peft_model, targets):
        a = module.lora_A["default"].weight.detach().float()  # [r, in]
        b = module.lora_B["default"].weight.detach().float()  # [out, r]
        scale = float(module.scaling["default"])
        out[f"{name}.weight"] = Delta(
            f"{name}.weight", targets[name], u=(b * scale).contiguous(), v=a.T.contiguous()
        )
    return out
