"""Can a baked patch's post-norm scale moves ride in the projection before the norm (issue 54)?

A server applies LoRA pairs only, and the default bake's patch carries most of what it reads in
post-norm scale moves (``benchmarks/thought/patch_parts.py``). Gemma's post norms compute
``(1 + w) * u / rms(u)`` of the projection's output ``u = W h`` (o_proj before the
post-attention norm, down_proj before the post-feedforward norm). Scaling ``W``'s rows by
``f = (1 + w + dw) / (1 + w)`` gives ``(1 + w + dw) * u / rms(f * u)``: the scale move, up to
the norm's RMS, as a rank-k change of ``W`` for k coordinates. This measures what survives:
for each bake folder (``ctxc bake --context P.txt --out DIR`` of a SQuAD subset paragraph) the
paragraph's questions in ctxc's form are answered (16 greedy tokens, first line, SQuAD F1) by
the model with the whole patch, its linear deltas alone, and its linear deltas with every scale
move folded, or the ``--top`` largest coordinates of each; and by the original with the
paragraph and without it.

    python -m benchmarks.thought.scale_fold --bake DIR PARAGRAPH_ID [--bake DIR ID ...] \\
        [--top 16 64]

Measured (2026-12-07; default bakes of Normans#0, Computational_complexity_theory#1 and
Huguenot#4, 15 questions): F1 full 63.1, none 15.5; whole patch 44.3 (kept 0.60), linear deltas
alone 20.7 (0.11), every move folded 0.0 (NaN logits: some ``1 + w`` are near 0), the top 16
folded 22.3 (0.14), the top 64 folded 15.8 (0.01). The norm's RMS undoes the fold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from testbed.squad_score import score

DATA = Path(__file__).resolve().parents[1] / "data" / "squad" / "subset.json"
FORM = " Question: {q}\nAnswer:"  # ctxc's own question form
GEN = 16
# The projection whose output each post norm renormalises (Gemma 2/3 sandwich norms).
BEFORE = {
    "post_attention_layernorm": "self_attn.o_proj",
    "post_feedforward_layernorm": "mlp.down_proj",
}


def variant(patch, base: dict, fold: bool, top: int | None = None) -> dict:
    """The weight deltas of a variant: the linear deltas, and (``fold``) each norm's scale move
    folded into the rows of the projection before it (its ``top`` largest coordinates only)."""
    extra: dict = {}
    norms = {}
    for name, delta in patch.deltas.items():
        dense = delta.dense().float()  # [out, in] or [d_model]
        if dense.dim() == 1:
            norms[name] = dense
        else:
            extra[name] = extra.get(name, 0) + dense
    if not fold:
        return extra
    for name, dw in norms.items():
        w = base[name].float()  # [d_model]
        f = (1 + w + dw) / (1 + w)  # [d_model]
        if top is not None:
            keep = torch.zeros_like(f, dtype=torch.bool)
            keep[dw.abs().topk(top).indices] = True
            f = torch.where(keep, f, torch.ones_like(f))
        norm = next(k for k in BEFORE if k in name)
        proj = name.replace(norm, BEFORE[norm])
        weight = base[proj].float() + extra.get(proj, 0)  # [d_model, in]
        extra[proj] = f[:, None] * weight - base[proj].float()
    return extra


def main(argv: list[str] | None = None) -> None:
    """Print each variant's F1 per paragraph and pooled."""
    import ctxc
    from ctxc.patch import Patch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bake", nargs=2, action="append", required=True, metavar=("DIR", "ID"))
    p.add_argument("--top", type=int, nargs="*", default=[16, 64])
    args = p.parse_args(argv)
    subset = {q["id"]: q for q in json.loads(DATA.read_text())["paragraphs"]}
    model, tok = ctxc.load_model("gemma-3-270m")
    model.eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load(extra: dict) -> None:
        state = model.state_dict()
        with torch.no_grad():
            for k, v in base.items():
                state[k].copy_(v)
            for k, d in extra.items():
                state[k].add_(d.to(state[k].dtype))

    def ask(prefix: list[int], questions: list[str]) -> list[str]:
        got = []
        for q in questions:
            ids = prefix + tok(FORM.format(q=q.strip()), add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=GEN, do_sample=False)
            text = tok.decode(out[0, len(ids) :], skip_special_tokens=True).strip()
            got.append(text.split("\n")[0].strip())
        return got

    pooled: dict[str, list[float]] = {}
    for folder, pid in args.bake:
        para = subset[pid]
        qs = [q["question"] for q in para["questions"]]
        golds = [q["answers"] for q in para["questions"]]
        patch = Patch.load(Path(folder))
        load({})
        said = {
            "full": ask(list(tok(para["context"]).input_ids), qs),
            "none": ask([tok.bos_token_id], qs),
        }
        kinds = [
            ("whole", None),
            ("linear alone", variant(patch, base, False)),
            ("every move folded", variant(patch, base, True)),
        ]
        kinds += [(f"top {k} folded", variant(patch, base, True, k)) for k in args.top]
        for name, extra in kinds:
            if extra is None:
                load({})
                with patch.applied(model):
                    said[name] = ask([tok.bos_token_id], qs)
            else:
                load(extra)
                said[name] = ask([tok.bos_token_id], qs)
        load({})
        for name, got in said.items():
            f1s = [score(a, g)[1] for a, g in zip(got, golds, strict=True)]
            pooled.setdefault(name, []).extend(f1s)
            print(f"{pid} {name}: F1 {100 * sum(f1s) / len(f1s):.1f}  {got[:2]}", flush=True)
    full, none = (sum(pooled[k]) / len(pooled[k]) for k in ("full", "none"))
    print(f"pooled over {len(pooled['full'])} questions:")
    for name, f1s in pooled.items():
        mean = sum(f1s) / len(f1s)
        kept = (mean - none) / (full - none) if full != none else float("nan")
        print(f"  {name}: F1 {100 * mean:.1f}, kept {kept:.2f}")


if __name__ == "__main__":
    main()
