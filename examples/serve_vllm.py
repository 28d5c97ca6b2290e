"""Serve baked documents with vLLM: one base model, one LoRA adapter per document or chunk,
picked per request (issue 54).

On a GPU machine with vLLM installed (``pip install vllm``), after baking servable adapters::

    ctxc bake --route --context article.txt --method distill --rank 64 --emit lora --out article
    ctxc bake --context memo.txt --method distill --rank 64 --emit lora --out memo
    python examples/serve_vllm.py --base google/gemma-3-270m --bake article --bake memo \\
        --question "When were the Normans in Normandy?" --question "memo::Who signed the memo?"

Each ``lora/`` folder is a PEFT adapter vLLM loads by path (``LoRARequest(name, id, path)``); for a
routed bake, ``ctxc route`` (``Router.pick``, BM25 over the chunks) names the chunk that answers
each question (over several routed bakes, the best-scoring chunk of all); a question ``NAME::TEXT``
names its adapter (a bake folder's name, or ``folder/chunk``). A question outside every bake's
scope (``ctxc.bake.scope``: too little of its word information is in the document; ``ctxc
route`` prints ``none``) is sent with no adapter: the base model answers it, and no document's
patch harms it (issue 53). The engine starts with
``enable_lora=True``, ``max_lora_rank`` the adapters' rank rounded up to one vLLM takes (8 ...
512), ``max_loras`` how many adapters one batch may mix, and answers greedily in ctxc's question
form (``Question: ...\\nAnswer:``, the form the bake was fitted on) without the document.
``--base`` is the model the adapters were baked on, as vLLM loads it (a hub id or a folder: the
adapter card names the bake's base and its revision or SHA-256). vLLM applies LoRA pairs only: a
bake that moves norm scales (Gemma's default fit) has no ``lora/`` (``ctxc bake`` refuses ``--emit
lora`` for it); ``--method distill`` trains LoRA pairs alone, and on Gemma 3 270M reads its
paragraphs about as the default fit does (docs/bake.md, "A distilled LoRA").

Checked here without a GPU (``tests/bake/test_bake_serve.py``): the requests this script builds
for a bake, the engine's arguments, and every adapter it names against vLLM's adapter rules
(``backends/peft/lora_rules.py``), with a stand-in for the ``vllm`` module.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ctxc.backends.peft.facts import MAX_LORA_RANKS
from ctxc.bake import CHUNKS_DIR, SCOPE_FILE, Router, Scope, is_routed

QUESTION_FORM = "Question: {question}\nAnswer:"  # ctxc's own (ctxc.bake.selfstudy)
ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Request:
    """One question and the adapter that answers it."""

    prompt: str  # the question in ctxc's form
    adapter: str | None  # the adapter's name (the bake folder's, and its chunk's for a routed
    # bake), or None: outside every bake's scope, the base model answers
    path: Path | None  # its lora/ folder
    lora_id: int | None  # vLLM's integer id of the adapter (from 1, one per adapter)


def adapters(bake: Path) -> dict[str, Path]:
    """A bake folder's adapters: name -> ``lora/`` folder (each chunk's for a routed bake)."""
    if is_routed(bake):
        router = Router.load(bake)
        return {f"{bake.name}/{c}": bake / CHUNKS_DIR / c / "lora" for c in router.ids}
    return {bake.name: bake / "lora"}


def pick(bakes: list[Path], question: str) -> tuple[str | None, str]:
    """The adapter that answers ``question`` and the question: ``NAME::TEXT`` names it (a bake
    folder's name, or ``folder/chunk``); else the routed bakes' chunk with the best BM25 score
    (``Router.scores``; the first on a tie) among the bakes whose scope admits the question
    (``Router.route``); else the one bake given, if its ``scope.json`` admits it; None: no
    adapter."""
    name, sep, text = question.partition("::")
    if sep:
        return name.strip(), text
    routed = [b for b in bakes if is_routed(b)]
    if not routed:
        if len(bakes) != 1:
            raise SystemExit(f"name the bake that answers {question!r}: --question NAME::TEXT")
        scope = bakes[0] / SCOPE_FILE
        admitted = not scope.is_file() or Scope.load(bakes[0]).admits(question)
        return (bakes[0].name if admitted else None), question
    best, got = float("-inf"), None
    for bake in routed:
        router = Router.load(bake)
        if router.route(question) is None:
            continue
        for chunk, score in zip(router.ids, router.scores(question), strict=True):
            if score > best:
                best, got = score, f"{bake.name}/{chunk}"
    return got, question


def requests(bakes: list[Path], questions: list[str]) -> list[Request]:
    """Each question with its adapter (vLLM's ids numbered in the bakes' order)."""
    named = {n: p for b in bakes for n, p in adapters(b).items()}
    ids = {n: i + 1 for i, n in enumerate(named)}
    out = []
    for q in questions:
        name, text = pick(bakes, q)
        prompt = QUESTION_FORM.format(question=text.strip())
        if name is None:
            out.append(Request(prompt, None, None, None))
            continue
        if name not in named:
            raise SystemExit(f"no adapter {name!r} (the bakes hold {', '.join(named)})")
        out.append(Request(prompt, name, named[name], ids[name]))
    return out


def lora_rank(paths: list[Path]) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds every adapter's rank."""
    rank = max(json.loads((p / "adapter_config.json").read_text())["r"] for p in paths)
    fits = [r for r in sorted(MAX_LORA_RANKS) if r >= rank]
    if not fits:
        raise SystemExit(f"rank {rank} is above vLLM's largest max_lora_rank")
    return fits[0]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base model as vLLM loads it")
    parser.add_argument("--bake", type=Path, action="append", required=True)
    parser.add_argument("--question", action="append", required=True)
    parser.add_argument("--max-loras", type=int, default=4, help="adapters one batch may mix")
    args = parser.parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    asked = requests(args.bake, args.question)
    llm = LLM(
        model=args.base,
        enable_lora=True,
        max_lora_rank=lora_rank([r.path for r in asked if r.path is not None]),
        max_loras=args.max_loras,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    answers = []
    for r in asked:
        lora = None if r.path is None else LoRARequest(r.adapter, r.lora_id, str(r.path))
        (out,) = llm.generate([r.prompt], greedy, lora_request=lora)
        answer = out.outputs[0].text.split("\n")[0].strip()
        answers.append(answer)
        print(f"[{r.adapter or 'base model'}] {r.prompt.splitlines()[0]} -> {answer}")
    return answers


if __name__ == "__main__":
    main()
