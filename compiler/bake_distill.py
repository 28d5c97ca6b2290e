"""``method="distill"``: a LoRA of the patch's rank trained by context distillation.

The student is the model with a PEFT LoRA on every MLP linear the fit patches, fed the query
alone; the teacher is the same model fed the context and the query. The loss is KL(teacher ||
student) at every position of the fit data (the fit's constraints), over the teacher's top
``TOP`` tokens (the rest of the vocabulary carries under 1e-3 of the mass on the contexts
measured; storing all 262k logits per position would not fit). Seeded; AdamW. The trained
factors become a :class:`~ctxc.patch.Patch` (``dW = (alpha / r) B A``), so every backend takes
it. The model is left as it was (the LoRA layers are unloaded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxc.bake_data import FitData
from ctxc.patch import Delta, Patch, PatchMeta

__all__ = ["TOP", "distill", "teacher_top"]

TOP = 256  # teacher tokens kept per position
_DEFAULT_RANK = 64  # a LoRA needs a rank: "full" distils at this one


def teacher_top(model: torch.nn.Module, data: FitData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The teacher's top-``TOP`` log-probabilities and their token ids at each fit position.

    Returns:
        per query ``(logp [k, TOP] float32, ids [k, TOP] int64)``.
    """
    out = []
    with torch.no_grad():
        for i in range(len(data.queries)):
            k = len(data.reduced(i))
            x = torch.tensor([data.full(i)])
            logits = model(input_ids=x, logits_to_keep=k).logits[0].float()
            logp = logits.log_softmax(-1)  # [k, vocab]
            top = logp.topk(min(TOP, logp.shape[-1]), dim=-1)
            out.append((top.values, top.indices))
    return out


def _lora_targets(blocks) -> dict[str, str]:
    """Module path -> block path of every linear the fit moves (inner and outer)."""
    return {s.module: b.path for b in blocks.blocks for s in (*b.inner, b.outer)}


def distill(
    model: torch.nn.Module,
    blocks,
    data: FitData,
    options,
    meta: PatchMeta,
    start: Patch | None = None,
    on_step: Callable[[int, int, str], None] | None = None,
) -> Patch:
    """Train the LoRA and return it as a patch (the model is restored afterwards).

    Args:
        model: the unpatched model.
        blocks: its block map (which linears get a LoRA).
        data: the fit data.
        options: the :class:`~ctxc.bake.BakeOptions` (rank, steps, lr, seed).
        meta: the patch's metadata.
        start: the fit's patch to start from: its matrices initialise the LoRA (truncated to
            the rank), its vector deltas stay applied during training and join the result.
        on_step: progress callback ``(step, steps, "distill")``.

    Returns:
        the distilled :class:`Patch`.
    """
    from peft import LoraConfig, get_peft_model

    rank = options.rank or _DEFAULT_RANK
    targets = _lora_targets(blocks)
    teacher = teacher_top(model, data)
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
        _train(peft_model, data, teacher, options, on_step)
        deltas = _deltas(peft_model, targets, rank)
    finally:
        peft_model.unload()
        if fixed is not None:
            fixed.remove(model)
    deltas.update(vectors)
    ordered = {n: deltas[n] for n in _param_order(model, deltas)}
    return Patch(ordered, meta)


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


def _train(peft_model, data: FitData, teacher, options, on_step) -> None:
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=options.distill_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(options.seed)
    n, batch = len(data.queries), min(4, len(data.queries))
    steps = options.distill_steps
    for step in range(steps):
        picks = torch.randperm(n, generator=gen)[:batch].tolist()
        loss = torch.zeros(())
        count = 0
        for i in picks:
            logits = peft_model(input_ids=torch.tensor([data.reduced(i)])).logits[0].float()
            logp = logits.log_softmax(-1)  # [k, vocab]
            t_logp, t_ids = teacher[i]  # [k, TOP]
            got = logp.gather(-1, t_ids)  # [k, TOP]
            loss = loss + (t_logp.exp() * (t_logp - got)).sum()
            count += t_ids.shape[0]
        loss = loss / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step + 1, steps, "distill")


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
