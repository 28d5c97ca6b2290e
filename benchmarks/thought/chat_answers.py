"""Greedy chat answers of a ``ctxc bake --chat`` patch beside the model's without the context and
with it (issue 35).

For each question (a user turn): the model fed the template's rendering of the conversation
with the context turns (``full``), of the question alone (``none``: what the patched model is
fed), and the patch applied in-process to the same ``none`` input (``baked``); greedy, up to
``--tokens`` tokens or the end of the turn. With ``--gold``, SQuAD's normalised F1 of each
answer's first sentence against the best gold answer, and how many answers contain a gold one.

    ctxc bake --chat --system para.txt --model "$gguf" --out baked
    python -m benchmarks.thought.chat_answers --model "$gguf" --system para.txt \\
        --questions questions.txt --bake baked [--gold gold.txt] [--json out.json]

``--gold``: one line per question, its gold answers separated by ``|``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from ctxc.models.kv_cache import cache_of, with_cache
from testbed.squad_score import contains, f1

__all__ = ["answers", "main"]


def _first_sentence(text: str) -> str:
    found = re.search(r"[.!?](\s|$)", text)
    return text[: found.end()] if found else text


def _greedy(model, ids: list[int], steps: int, ends: frozenset[int]) -> list[int]:
    got: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            tok = int(out.logits[0, -1].argmax())
            if tok in ends:
                break
            got.append(tok)
            out = model(
                input_ids=torch.tensor([[tok]]), **with_cache(model, cache_of(out)), use_cache=True
            )
    return got


def answers(model, tokenizer, turns: list[dict], questions: list[str], patch, steps: int):
    """Per question ``{"question", "full", "none", "baked"}`` (texts)."""
    from ctxc.bake.chat import chat_format

    chat = chat_format(tokenizer, turns)
    rows = []
    for q in questions:
        turn = chat.turn(q)
        row = {"question": q}
        for name, ids in (("full", chat.context_ids + turn), ("none", chat.opening + turn)):
            row[name] = tokenizer.decode(_greedy(model, ids, steps, chat.ends))
        with patch.applied(model, check=False):
            row["baked"] = tokenizer.decode(_greedy(model, chat.opening + turn, steps, chat.ends))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="The chat model (a .gguf file or folder).")
    parser.add_argument("--system", type=Path, required=True, help="The system prompt file.")
    parser.add_argument("--questions", type=Path, required=True, help="One question a line.")
    parser.add_argument("--bake", type=Path, required=True, help="The ctxc bake --chat folder.")
    parser.add_argument("--gold", type=Path, help="Gold answers, a line per question, '|'-split.")
    parser.add_argument("--tokens", type=int, default=32, help="Greedy tokens per answer.")
    parser.add_argument("--json", type=Path, help="Write the answers here.")
    args = parser.parse_args(argv)

    from ctxc.bake.data import read_queries
    from ctxc.cli.support import load
    from ctxc.patch import Patch

    model, tokenizer = load(args.model, "float32")
    turns = [{"role": "system", "content": args.system.read_text(encoding="utf-8").rstrip("\r\n")}]
    questions = read_queries(args.questions)
    rows = answers(model, tokenizer, turns, questions, Patch.load(args.bake), args.tokens)
    gold = None
    if args.gold is not None:
        gold = [line.split("|") for line in read_queries(args.gold)]
        assert len(gold) == len(rows), (len(gold), len(rows))
    for i, row in enumerate(rows):
        print(f"Q: {row['question']}")
        for name in ("full", "none", "baked"):
            print(f"  {name:5s}: {' | '.join(row[name].splitlines())}")
        if gold is not None:
            row["f1"] = {
                n: max(f1(_first_sentence(row[n]), g) for g in gold[i])
                for n in ("full", "none", "baked")
            }
            row["contains_gold"] = {
                n: bool(contains(row[n], gold[i])) for n in ("full", "none", "baked")
            }
    if gold is not None:
        for n in ("full", "none", "baked"):
            mean = 100 * sum(r["f1"][n] for r in rows) / len(rows)
            hits = sum(r["contains_gold"][n] for r in rows)
            print(f"{n:5s}: F1 (first sentence) {mean:.1f}, gold contained {hits}/{len(rows)}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
