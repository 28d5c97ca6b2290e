"""No harm: what a baked paragraph's model does off its paragraph, beside what it keeps (issue 53).

A thought patch stands for its context, so the patched model fed a query alone should behave as
the original model fed the context first, on every query, not only on the context's questions.
For each SQuAD paragraph i of the vendored subset (``benchmarks/data/squad/subset.json``) and
each setting, the paragraph is baked (:func:`~ctxc.bake.driver.bake`, the setting's
``BakeOptions``), then four checks ask three models: ``full`` (the original fed paragraph i's
ids first), ``none`` (the original fed BOS) and ``baked`` (the patched model fed BOS):

- **reading**: paragraph i's own SQuAD questions in several question forms (:data:`FORMS`:
  ctxc's own, a plain ``Q:``/``A:`` pair, a chat-like ``User:``/``Assistant:`` turn), SQuAD's EM
  and F1, ``kept = (baked - none) / (full - none)``;
- **general**: short general-knowledge questions no paragraph answers
  (``benchmarks/data/general/questions.json``, written for this benchmark), each right when an
  accepted answer is in the answer line (normalised as SQuAD normalises); the patch's target is
  ``full``'s count;
- **other document**: paragraph j (the next paragraph of another article) and j's questions fed
  to the baked model of i, against the original fed the same (SQuAD F1), and beside the
  original fed paragraph i, then j (``after``: what the patch is fitted towards);
- **off-topic text**: KL(full || baked) at every position of another article's opening words
  (its first :data:`TEXT_TOKENS` tokens) fed as the query, beside KL(full || none).

Answers are 16 greedy tokens, cut at a special token, their first line that is not blank
(``benchmarks.thought.squad.answers``). A query's ids follow the context's ids (no second BOS),
as ``ctxc bake`` splits a context and a query.

``--peft`` asks every check again where a server answers: each bake written as a LoRA (``ctxc
bake --emit lora``'s writer) and loaded by plain PEFT in a fresh process on the base from the
GGUF file (:func:`_peft`); the row's ``peft`` holds its answers, each check's count equal to the
patched model's, and the summary's ``peft`` the figures with PEFT's answers (issue 54, check 1).

``--chat --model M`` (a chat model: SmolLM2-135M-Instruct) frames each check as ``ctxc bake
--chat --system para.txt`` does (:class:`Framing`): the paragraph is the system turn, each
query a user turn (the forms :data:`CHAT_FORMS`; another document and its question in one
turn; the off-topic opening as a turn), the patched model is fed the template's opening, then
the turn; answers are 32 greedy tokens.

    python -m benchmarks.thought.noharm --paragraphs 10 --out benchmarks/results/noharm.json \\
        default linear_only=true
    python -m benchmarks.thought.noharm --render benchmarks/results/noharm.json \\
        > docs/results/noharm.md
    python -m benchmarks.thought.noharm --chat --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out benchmarks/results/noharm_smollm2_chat.json default
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.thought.squad import (
    CHAT_GEN_TOKENS,
    DATA,
    GEN_TOKENS,
    _raw,
    answer_text,
    answers,
    setting_options,
)
from testbed.squad_score import normalize, score
from testbed.tables import commit, invocation

__all__ = ["FORMS", "GENERAL", "TEXT_TOKENS", "main", "right", "summary"]

ROOT = Path(__file__).resolve().parents[2]
GENERAL = ROOT / "benchmarks" / "data" / "general" / "questions.json"
# The question forms a user may ask in: ctxc's own (what self-study and cloze rows are fed), a
# plain pair, a chat-like turn without a template (the bundled model has none).
FORMS = {
    "ctxc": " Question: {q}\nAnswer:",
    "plain": "\nQ: {q}\nA:",
    "chat-like": "\nUser: {q}\nAssistant:",
}
# A chat bake's forms, each the user turn's text (ctxc's own: the question alone, as the chat
# self-study writes it).
CHAT_FORMS = {
    "ctxc": "{q}",
    "plain": "Q: {q}\nA:",
    "brief": "Answer in a few words. {q}",
}
TEXT_TOKENS = 48


@dataclass(frozen=True)
class Framing:
    """How a paragraph and each check's query are fed: plain text (the paragraph's ids after
    BOS, a query's ids after it) or chat (the paragraph as the system turn, a query a user
    turn after it; the patched model is fed the template's opening, then the turn)."""

    tok: Any
    chat: bool

    @property
    def forms(self) -> dict[str, str]:
        return CHAT_FORMS if self.chat else FORMS

    @property
    def gen(self) -> int:
        return CHAT_GEN_TOKENS if self.chat else GEN_TOKENS

    def _format(self, context: str):
        from ctxc.bake.chat import chat_format

        return chat_format(self.tok, [{"role": "system", "content": context}])

    @functools.cached_property
    def _turns(self):
        """A chat format whose ``turn`` renders a user turn (its context turns unused)."""
        return self._format("-")

    def starts(self, context: str) -> tuple[list[int], list[int]]:
        """``(full, none)``: what the original model is fed first with the context, without."""
        if self.chat:
            fmt = self._format(context)
            assert fmt.opening_exact, "the template renders a lone user turn otherwise"
            return list(fmt.context_ids), list(fmt.opening)
        from ctxc.bake.data import special_prefix

        ctx = list(self.tok(context).input_ids)
        bos = list(special_prefix(self.tok))
        assert ctx[: len(bos)] == bos, (ctx[:4], bos)
        return ctx, bos

    def bake_given(self, context: str) -> dict:
        """The keyword arguments :func:`~ctxc.bake.driver.bake` takes the context in."""
        if self.chat:
            return {"messages": [{"role": "system", "content": context}]}
        return {"context_ids": list(self.tok(context).input_ids)}

    def ask(self, text: str) -> list[int]:
        """A query's ids, fed after a start."""
        if self.chat:
            return list(self._turns.turn(text))
        return _ids(self.tok, text)

    def queries(self, questions: list[str], form: str) -> list[list[int]]:
        return [self.ask(self.forms[form].format(q=q.strip())) for q in questions]

    def other(self, context: str, other: str, questions: list[str]):
        """Paragraph j read before each of its questions: ``(original start, after-i start,
        queries)``: plain text, j's ids start (the patched model's too), its questions follow;
        chat, j and each question in one user turn after the opening (or i's system turn)."""
        full, none = self.starts(context)
        if self.chat:
            qs = [self.ask(f"{other.strip()}\n\n{q.strip()}") for q in questions]
            return none, full, qs
        octx = list(self.tok(other).input_ids)
        qs = self.queries(questions, "ctxc")
        return octx, full + octx[len(none) :], qs

    def text(self, words: str) -> list[int]:
        """Another article's opening as a query: its first :data:`TEXT_TOKENS` tokens (plain), or
        a user turn holding them (chat)."""
        ids = list(self.tok(words, add_special_tokens=False).input_ids)[:TEXT_TOKENS]
        return self.ask(self.tok.decode(ids)) if self.chat else ids


def right(answer: str, accepted: list[str]) -> bool:
    """Whether an accepted answer's normalised words stand, in order and whole, in the
    normalised answer line."""
    got = f" {normalize(answer)} "
    return any(f" {normalize(a)} " in got for a in accepted if normalize(a))


def _ids(tok, text: str) -> list[int]:
    ids = list(tok(text, add_special_tokens=False).input_ids)
    assert ids, f"{text!r} tokenizes to nothing"
    return ids


def _f1(texts: list[str], golds: list[list[str]]) -> tuple[list[int], list[float]]:
    pairs = [score(t, g) for t, g in zip(texts, golds, strict=True)]
    return [e for e, _ in pairs], [round(f, 4) for _, f in pairs]


def _other(paragraphs: list[dict], i: int) -> dict:
    """The next paragraph of another article (wrapping): paragraph i's "other document"."""
    n = len(paragraphs)
    for step in range(1, n):
        j = paragraphs[(i + step) % n]
        if j["title"] != paragraphs[i]["title"]:
            return j
    raise SystemExit("the subset needs paragraphs of two articles")


def _general(frame: Framing, model, start, general: list[dict], patch=None) -> dict:
    """The general questions after ``start``, in ctxc's form and a plain one: right or not."""
    got = {}
    for form in ("ctxc", "plain"):
        qs = frame.queries([g["q"] for g in general], form)
        texts = answers(model, frame.tok, start, qs, patch=patch, gen=frame.gen)["answers"]
        ok = [right(a, g["a"]) for a, g in zip(texts, general, strict=True)]
        got[form] = {"answers": texts, "right": ok}
    return got


def scope_decisions(frame: Framing, para: dict, other: dict, general: list[dict]) -> dict:
    """Which of paragraph i's checks its bake's scope (``ctxc.bake.scope``, the default
    threshold) serves with the patch: a list of booleans per check, in the checks' order.

    The gate reads what the user sends, as ``ctxc route --query`` does: a query's text in its
    form (plain), or the user turn's text (chat); paragraph j and its question for the other
    document; the other article's opening (its first :data:`TEXT_TOKENS` tokens) off topic.
    It depends on the texts alone, not on the setting.
    """
    from ctxc.bake.scope import Scope

    gate = Scope.of(para["context"])
    forms = frame.forms
    asked = [q["question"].strip() for q in para["questions"]]
    got: dict = {"threshold": gate.threshold, "reading": {}, "general": {}}
    for form in forms:
        got["reading"][form] = [gate.admits(forms[form].format(q=q)) for q in asked]
    for form in ("ctxc", "plain"):
        got["general"][form] = [gate.admits(forms[form].format(q=g["q"].strip())) for g in general]
    oq = [q["question"].strip() for q in other["questions"]]
    if frame.chat:
        got["other_document"] = [gate.admits(f"{other['context'].strip()}\n\n{q}") for q in oq]
    else:
        ask = forms["ctxc"]
        got["other_document"] = [gate.admits(other["context"] + ask.format(q=q)) for q in oq]
    ids = list(frame.tok(other["context"], add_special_tokens=False).input_ids)[:TEXT_TOKENS]
    got["off_topic"] = gate.admits(frame.tok.decode(ids))
    return got


def _refs(frame: Framing, model, para: dict, other: dict, general: list[dict]) -> dict:
    """The setting-independent answers of paragraph i: full and none in every check."""
    full, none = frame.starts(para["context"])
    golds = [q["answers"] for q in para["questions"]]
    questions = [q["question"] for q in para["questions"]]
    ref: dict = {"title": para["title"], "other": other["id"], "reading": {}, "general": {}}
    for form in frame.forms:
        qs = frame.queries(questions, form)
        for name, start in (("full", full), ("none", none)):
            got = answers(model, frame.tok, start, qs, gen=frame.gen)["answers"]
            em, f1 = _f1(got, golds)
            ref["reading"][f"{form}/{name}"] = {"answers": got, "em": em, "f1": f1}
    for name, start in (("full", full), ("none", none)):
        for form, got in _general(frame, model, start, general).items():
            ref["general"][f"{form}/{name}"] = got
    ogolds = [q["answers"] for q in other["questions"]]
    alone, after, oq = frame.other(
        para["context"], other["context"], [q["question"] for q in other["questions"]]
    )
    # The original reading j alone; then reading i, then j: what the patch is fitted towards.
    for key, start in (("other_document", alone), ("other_document_after", after)):
        got = answers(model, frame.tok, start, oq, gen=frame.gen)["answers"]
        em, f1 = _f1(got, ogolds)
        ref[key] = {"answers": got, "em": em, "f1": f1}
    ref["scope"] = scope_decisions(frame, para, other, general)
    return ref


def _baked(
    frame: Framing,
    model,
    para: dict,
    other: dict,
    general: list[dict],
    setting: str,
    peft_base: Path | None = None,
):
    """Bake paragraph i with ``setting`` and ask the patched model every check; with
    ``peft_base`` (a GGUF file), plain PEFT too (:func:`_peft`)."""
    from ctxc.bake.data import FitData
    from ctxc.bake.driver import bake
    from ctxc.bake.evaluate import evaluate_many

    tok = frame.tok
    full, none = frame.starts(para["context"])
    clock, cpu = time.perf_counter(), time.process_time()
    result = bake(model, tok, options=setting_options(setting), **frame.bake_given(para["context"]))
    row: dict = {
        "bake_seconds": round(time.perf_counter() - clock, 2),
        "bake_cpu_seconds": round(time.process_time() - cpu, 2),
        "fit_kinds": result.report["fit_kinds"],
        "reading": {},
        "commit": commit(),
        "threads": torch.get_num_threads(),
    }
    patch = result.patch
    assert list(result.data.context_ids) == full, "the bake split the context otherwise"
    # A general question the bake's own rows wrote verbatim (off-topic questions may): counted.
    fitted = [tok.decode(q) for q in result.data.queries]
    row["general_in_fit"] = sum(any(g["q"] in text for text in fitted) for g in general)
    golds = [q["answers"] for q in para["questions"]]
    asked: dict[str, list[list[int]]] = {}  # check -> each query's whole input (--peft)
    for form in frame.forms:
        qs = frame.queries([q["question"] for q in para["questions"]], form)
        got = answers(model, tok, none, qs, patch=patch, gen=frame.gen)["answers"]
        em, f1 = _f1(got, golds)
        row["reading"][form] = {"answers": got, "em": em, "f1": f1}
        asked[f"reading/{form}"] = [none + q for q in qs]
    row["general"] = _general(frame, model, none, general, patch)
    for form in row["general"]:
        qs = frame.queries([g["q"] for g in general], form)
        asked[f"general/{form}"] = [none + q for q in qs]
    alone, _, oq = frame.other(
        para["context"], other["context"], [q["question"] for q in other["questions"]]
    )
    got = answers(model, tok, alone, oq, patch=patch, gen=frame.gen)["answers"]
    em, f1 = _f1(got, [q["answers"] for q in other["questions"]])
    row["other_document"] = {"answers": got, "em": em, "f1": f1}
    asked["other_document"] = [alone + q for q in oq]
    if peft_base is not None:
        golds_of = {"reading": golds, "other_document": [q["answers"] for q in other["questions"]]}
        row["peft"] = _peft(frame, model, patch, peft_base, asked, row, golds_of, general)
    data = FitData(full, none, [frame.text(other["context"])], ["text"])
    p, c = evaluate_many(model, [patch, None], data, 0)
    row["off_topic"] = {
        "baked_kl": p.kl,
        "none_kl": c.kl,
        "baked_top1": p.top1,
        "none_top1": c.top1,
    }
    return row


def _peft(
    frame: Framing,
    model,
    patch,
    base: Path,
    asked: dict[str, list[list[int]]],
    row: dict,
    golds: dict[str, list[list[str]]],
    general: list[dict],
) -> dict:
    """Every check's queries answered by plain PEFT in a fresh process, as a server loads the
    bake (issue 54): the patch written as ``ctxc bake --emit lora`` writes it (ctxc's LoRA
    backend, its checks included), ``PeftModel.from_pretrained`` on the base Transformers loads
    from the GGUF file ``base`` (``benchmarks/fidelity/served_runtimes.py``: no ctxc import),
    greedy, one query at a time, its answers cut as the patched model's are.

    Args:
        asked: check (``reading/FORM``, ``general/FORM``, ``other_document``) -> each query's
            whole input ids (the start and the query).
        row: the patched model's row (its answers, compared).
        golds: ``reading`` and ``other_document`` -> each question's accepted answers.
        general: the general questions.

    Returns:
        ``reading``, ``general`` and ``other_document`` as the row holds them, PEFT's, each
        with ``equal`` (answers equal to the patched model's); ``seconds``; ``ctxc_imported``;
        or ``error`` (the LoRA refused, or the child's last line).
    """
    import tempfile

    from benchmarks.fidelity.served_answers import run_child
    from ctxc.backends.peft.lora_adapter import emit_lora
    from ctxc.core.errors import CtxcError

    clock = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ctxc-noharm-") as tmp:
        try:
            path, _ = emit_lora(model, patch, Path(tmp))
        except CtxcError as exc:  # a patch LoRA cannot serve (a norm scale's move)
            return {"error": str(exc)}
        requests = [
            {"key": f"{check}/{i}", "on": "p", "ids": ids, "generate": True}
            for check, queries in asked.items()
            for i, ids in enumerate(queries)
        ]
        spec = {
            "runtime": "peft",
            "base": str(base),
            "attach": {"p": str(path)},
            "requests": requests,
            "gen": frame.gen,
            "stop": sorted(frame.tok.all_special_ids),
        }
        ran = run_child(spec, torch.get_num_threads())
    if "error" in ran:
        return {"error": ran["error"]}
    out: dict = {"reading": {}, "general": {}, "ctxc_imported": ran["ctxc_imported"]}
    for check, queries in asked.items():
        texts = [
            answer_text(_raw(frame.tok, ran["requests"][f"{check}/{i}"]["tokens"]))
            for i in range(len(queries))
        ]
        kind, _, form = check.partition("/")
        ours = row[kind][form] if form else row[kind]
        got: dict = {"answers": texts}
        if kind == "general":
            got["right"] = [right(a, g["a"]) for a, g in zip(texts, general, strict=True)]
        else:
            got["em"], got["f1"] = _f1(texts, golds[kind])
        got["equal"] = sum(a == b for a, b in zip(texts, ours["answers"], strict=True))
        if form:
            out[kind][form] = got
        else:
            out[kind] = got
    out["seconds"] = round(time.perf_counter() - clock, 2)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _forms(doc: dict) -> list[str]:
    """The reading forms of a results file (plain: :data:`FORMS`; chat: :data:`CHAT_FORMS`)."""
    return list(CHAT_FORMS if doc.get("chat") else FORMS)


def summary(doc: dict, setting: str) -> dict:
    """Pooled figures of ``setting`` over its paragraphs (every question counts once)."""
    rows = doc["settings"][setting]["paragraphs"]
    refs = [doc["paragraphs"][p] for p in rows]
    got: dict = {"paragraphs": len(rows)}
    for form in _forms(doc):
        for fig in ("f1", "em"):
            full = [x for r in refs for x in r["reading"][f"{form}/full"][fig]]
            none = [x for r in refs for x in r["reading"][f"{form}/none"][fig]]
            baked = [x for b in rows.values() for x in b["reading"][form][fig]]
            f, n, b = (100 * _mean(v) for v in (full, none, baked))
            got[f"reading/{form}/{fig}"] = {
                "full": f,
                "none": n,
                "baked": b,
                "kept": (b - n) / (f - n) if f != n else None,
            }
    for form in ("ctxc", "plain"):
        full = sum(sum(r["general"][f"{form}/full"]["right"]) for r in refs)
        none = sum(sum(r["general"][f"{form}/none"]["right"]) for r in refs)
        baked = sum(sum(b["general"][form]["right"]) for b in rows.values())
        asked = sum(len(r["general"][f"{form}/full"]["right"]) for r in refs)
        got[f"general/{form}"] = {
            "asked": asked,
            "full": full,
            "none": none,
            "baked": baked,
            "ratio": baked / full if full else None,
        }
    orig = [x for r in refs for x in r["other_document"]["f1"]]
    after = [x for r in refs for x in r.get("other_document_after", {}).get("f1", [])]
    baked_o = [x for b in rows.values() for x in b["other_document"]["f1"]]
    got["other_document"] = {
        "questions": len(orig),
        "original_f1": 100 * _mean(orig),
        "after_f1": 100 * _mean(after) if len(after) == len(orig) else None,
        "baked_f1": 100 * _mean(baked_o),
        "ratio": _mean(baked_o) / _mean(orig) if _mean(orig) else None,
    }
    got["off_topic"] = {
        "baked_kl": _mean([b["off_topic"]["baked_kl"] for b in rows.values()]),
        "none_kl": _mean([b["off_topic"]["none_kl"] for b in rows.values()]),
    }
    got["bake_cpu_seconds"] = _mean([b["bake_cpu_seconds"] for b in rows.values()])
    if all("scope" in r for r in refs):
        got["scoped"] = _scoped(doc, rows, refs)
    if any("peft" in b for b in rows.values()):
        got["peft"] = _peft_summary(doc, setting)
    return got


def _peft_summary(doc: dict, setting: str) -> dict:
    """``setting``'s figures with plain PEFT's answers (``--peft``) in place of the patched
    model's, over the paragraphs measured so (the off-topic KL stays the patched model's: PEFT
    gives no logits here), and how many answers of each check equal the patched model's;
    ``errors``: paragraphs PEFT did not answer."""
    rows = {p: b for p, b in doc["settings"][setting]["paragraphs"].items() if "peft" in b}
    served = {p: b for p, b in rows.items() if "error" not in b["peft"]}
    checks = ("reading", "general", "other_document")
    parts = [x for b in served.values() for x in _peft_parts(b["peft"])]
    equal, asked = sum(x["equal"] for x in parts), sum(len(x["answers"]) for x in parts)
    view = {
        p: {**{k: v for k, v in b.items() if k != "peft"}, **{k: b["peft"][k] for k in checks}}
        for p, b in served.items()
    }
    on = {**doc["settings"][setting], "paragraphs": view}
    figures = summary({**doc, "settings": {**doc["settings"], setting: on}}, setting)
    return {
        "paragraphs": len(served),
        "errors": {p: b["peft"]["error"] for p, b in rows.items() if "error" in b["peft"]},
        "answers": asked,
        "equal": equal,
        "figures": figures,
    }


def _pick(on: list[bool], baked: list, none: list) -> list:
    """The baked model's item where the scope admits the query, the unpatched one's elsewhere."""
    return [b if a else n for a, b, n in zip(on, baked, none, strict=True)]


def _scoped(doc: dict, rows: dict, refs: list[dict]) -> dict:
    """The figures served with the bake's scope: the patched model on the queries its scope
    admits, the unpatched one (the references' ``none``, the original alone) on the others;
    and how many of each check's queries the scope admitted."""
    pairs = list(zip(refs, rows.values(), strict=True))
    got: dict = {}
    for form in _forms(doc):
        for fig in ("f1", "em"):
            full = [x for r, _ in pairs for x in r["reading"][f"{form}/full"][fig]]
            none = [x for r, _ in pairs for x in r["reading"][f"{form}/none"][fig]]
            mixed = [
                x
                for r, b in pairs
                for x in _pick(
                    r["scope"]["reading"][form],
                    b["reading"][form][fig],
                    r["reading"][f"{form}/none"][fig],
                )
            ]
            f, n, m = (100 * _mean(v) for v in (full, none, mixed))
            got[f"reading/{form}/{fig}"] = {
                "baked": m,
                "kept": (m - n) / (f - n) if f != n else None,
            }
        on = [x for r, _ in pairs for x in r["scope"]["reading"][form]]
        got[f"reading/{form}/in_scope"] = [sum(on), len(on)]
    for form in ("ctxc", "plain"):
        full = sum(sum(r["general"][f"{form}/full"]["right"]) for r, _ in pairs)
        mixed = sum(
            sum(
                _pick(
                    r["scope"]["general"][form],
                    b["general"][form]["right"],
                    r["general"][f"{form}/none"]["right"],
                )
            )
            for r, b in pairs
        )
        on = [x for r, _ in pairs for x in r["scope"]["general"][form]]
        got[f"general/{form}"] = {
            "baked": mixed,
            "ratio": mixed / full if full else None,
            "in_scope": [sum(on), len(on)],
        }
    orig = [x for r, _ in pairs for x in r["other_document"]["f1"]]
    mixed_o = [
        x
        for r, b in pairs
        for x in _pick(
            r["scope"]["other_document"], b["other_document"]["f1"], r["other_document"]["f1"]
        )
    ]
    on = [x for r, _ in pairs for x in r["scope"]["other_document"]]
    got["other_document"] = {
        "baked_f1": 100 * _mean(mixed_o),
        "ratio": _mean(mixed_o) / _mean(orig) if _mean(orig) else None,
        "in_scope": [sum(on), len(on)],
    }
    kls = [b["off_topic"]["baked_kl" if r["scope"]["off_topic"] else "none_kl"] for r, b in pairs]
    on = [r["scope"]["off_topic"] for r, _ in pairs]
    got["off_topic"] = {"baked_kl": _mean(kls), "in_scope": [sum(on), len(on)]}
    return got


def render(doc: dict, source: str) -> str:
    """The results page (Markdown)."""
    rows = [r for v in doc["settings"].values() for r in v["paragraphs"].values()]
    commits = sorted({f"`{r['commit']}`" for r in rows})
    commands = [c for v in doc["settings"].values() for c in v.get("commands", [])]
    commands = list(dict.fromkeys(commands))
    lines = [
        "# No harm: a baked paragraph off its paragraph (issue 53)",
        "",
        f"`{source}`, measured by `python -m benchmarks.thought.noharm` "
        f"({doc.get('model', 'bundled Gemma 3 270M')}, float32, {doc.get('threads', '?')} threads"
        f"{', chat: the paragraph as the system turn' if doc.get('chat') else ''}); the checks "
        "and the "
        "question forms are in the module's docstring. Kept = (baked - none) / (full - none); "
        "general: questions right; other document: SQuAD F1 of the baked model of paragraph i "
        "reading paragraph j against the original reading j; off-topic: KL from the model fed "
        "the paragraph first, mean over positions of another article's opening.",
        "",
        f"Measured at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)} by:",
        "",
        *(f"    {c}" for c in commands),
        "",
        f"| setting | paragraphs | reading F1 kept: {' / '.join(_forms(doc))} | EM kept (ctxc) | "
        "general right: baked / full / none (ratio to full) | other document F1: baked / "
        "original (ratio) / after i | off-topic KL: baked / none | bake CPU s |",
        "|---|---:|---|---:|---|---|---|---:|",
    ]

    def k(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    for setting, have in doc["settings"].items():
        if not have["paragraphs"]:
            continue
        s = summary(doc, setting)
        g, o, t = s["general/ctxc"], s["other_document"], s["off_topic"]
        kept = " / ".join(k(s[f"reading/{f}/f1"]["kept"]) for f in _forms(doc))
        lines.append(
            f"| `{setting}` | {s['paragraphs']} | {kept} | {k(s['reading/ctxc/em']['kept'])} | "
            f"{g['baked']} / {g['full']} / {g['none']} of {g['asked']} ({k(g['ratio'])}) | "
            f"{o['baked_f1']:.1f} / {o['original_f1']:.1f} ({k(o['ratio'])}) / "
            f"{'-' if o['after_f1'] is None else format(o['after_f1'], '.1f')} | "
            f"{t['baked_kl']:.3f} / {t['none_kl']:.3f} | {s['bake_cpu_seconds']:.0f} |"
        )
    scoped = [(n, summary(doc, n)) for n, v in doc["settings"].items() if v["paragraphs"]]
    scoped = [(n, s) for n, s in scoped if "scoped" in s]
    if scoped:
        lines += [
            "",
            "Served with its scope (`ctxc.bake.scope`, threshold "
            f"{next(iter(doc['paragraphs'].values()))['scope']['threshold']}; `ctxc route`): "
            "the baked model answers the queries its paragraph's scope admits and the original "
            "alone the others (the same runs as above, item by item). In scope: queries "
            "admitted of those asked.",
            "",
            f"| setting | paragraphs | reading F1 kept: {' / '.join(_forms(doc))} | EM kept "
            "(ctxc) | general right (ratio to full) | other document F1 (ratio) | off-topic KL "
            "(none) | in scope: own (ctxc) / general / other / off-topic |",
            "|---|---:|---|---:|---|---|---|---|",
        ]
        for setting, s in scoped:
            c = s["scoped"]
            kept = " / ".join(k(c[f"reading/{f}/f1"]["kept"]) for f in _forms(doc))
            g, o, t = c["general/ctxc"], c["other_document"], c["off_topic"]

            def frac(x) -> str:
                return f"{x[0]}/{x[1]}"

            lines.append(
                f"| `{setting}` | {s['paragraphs']} | {kept} | {k(c['reading/ctxc/em']['kept'])} "
                f"| {g['baked']} of {s['general/ctxc']['full']} ({k(g['ratio'])}) | "
                f"{o['baked_f1']:.1f} of {s['other_document']['original_f1']:.1f} "
                f"({k(o['ratio'])}) | {t['baked_kl']:.3f} ({s['off_topic']['none_kl']:.3f}) | "
                f"{frac(c['reading/ctxc/in_scope'])} / {frac(g['in_scope'])} / "
                f"{frac(o['in_scope'])} / {frac(t['in_scope'])} |"
            )
    served = [(n, summary(doc, n)) for n, h in doc["settings"].items() if h["paragraphs"]]
    served = [(n, s["peft"]) for n, s in served if "peft" in s]
    if served:
        lines += [
            "",
            "**Served by plain PEFT** (`--peft`): each bake written as `ctxc bake --emit lora` "
            "writes it and loaded by `PeftModel.from_pretrained` on the base Transformers loads "
            "from the GGUF file, in a fresh process without ctxc, every check's questions asked "
            "again (greedy, one at a time); the figures with PEFT's answers (served with the "
            "scope: PEFT where the scope admits the query, the unpatched model elsewhere):",
            "",
            f"| setting | paragraphs | answers equal to the patched model's | reading F1 kept: "
            f"{' / '.join(_forms(doc))} | general (ratio) | other document (ratio) | with the "
            "scope: general, other document |",
            "|---|---:|---:|---|---|---|---|",
        ]
        for setting, p in served:
            f = p["figures"]
            kept = " / ".join(k(f[f"reading/{x}/f1"]["kept"]) for x in _forms(doc))
            g, o, c = f["general/ctxc"], f["other_document"], f.get("scoped")
            scoped = (
                "-"
                if c is None
                else (f"{k(c['general/ctxc']['ratio'])}, {k(c['other_document']['ratio'])}")
            )
            errors = f" ({len(p['errors'])} not served)" if p["errors"] else ""
            lines.append(
                f"| `{setting}` | {p['paragraphs']}{errors} | {p['equal']} of {p['answers']} | "
                f"{kept} | {g['baked']} of {g['full']} ({k(g['ratio'])}) | "
                f"{o['baked_f1']:.1f} of {o['original_f1']:.1f} ({k(o['ratio'])}) | {scoped} |"
            )
    lines += ["", "Reading F1 (full / none / baked) by form:", ""]
    for setting, have in doc["settings"].items():
        if not have["paragraphs"]:
            continue
        s = summary(doc, setting)
        parts = [
            f"{f} {s[f'reading/{f}/f1']['full']:.1f} / {s[f'reading/{f}/f1']['none']:.1f} / "
            f"{s[f'reading/{f}/f1']['baked']:.1f}"
            for f in _forms(doc)
        ]
        lines.append(f"- `{setting}`: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)


def _run(args) -> None:
    from ctxc.cli.support import load
    from ctxc.store.traced import traced_blocks

    commit()  # read once, now: the rows are stamped with the code this process imported

    general = json.loads(GENERAL.read_text())["questions"]
    subset = json.loads(DATA.read_text())["paragraphs"]
    chosen = subset[args.skip : args.paragraphs]
    out = Path(args.out)
    header = {"model": Path(args.model).name if args.model else "bundled Gemma 3 270M"}
    header["chat"] = args.chat
    doc = json.loads(out.read_text()) if out.exists() else {"paragraphs": {}, "settings": {}}
    if any(doc.setdefault(k, v) != v for k, v in header.items()):
        raise SystemExit(f"{out} was measured with another model or framing: use another --out")
    for s in args.settings or ["default"]:
        opts = asdict(setting_options(s))
        have = doc["settings"].setdefault(s, {"options": opts, "paragraphs": {}, "commands": []})
        if have["options"] != opts:
            raise SystemExit(f"setting {s!r} in {out} had other options: use another --out")
        if invocation("benchmarks.thought.noharm") not in have["commands"]:
            have["commands"].append(invocation("benchmarks.thought.noharm"))
    if args.threads:
        torch.set_num_threads(args.threads)
    peft_base = _peft_base(args.model) if args.peft else None
    model, tok = load(args.model, "float32")
    frame = Framing(tok, args.chat)
    traced_blocks(model)
    doc["threads"] = torch.get_num_threads()
    for n, para in enumerate(chosen, 1):
        pid = para["id"]
        other = _other(subset, subset.index(para))
        if pid not in doc["paragraphs"]:
            doc["paragraphs"][pid] = _refs(frame, model, para, other, general)
            _write(out, doc)
        for s in args.settings or ["default"]:
            if pid in doc["settings"][s]["paragraphs"]:
                continue
            row = _baked(frame, model, para, other, general, s, peft_base)
            doc["settings"][s]["paragraphs"][pid] = row
            _write(out, doc)
            f = summary(doc, s)
            if "peft" in row:
                print(f"  PEFT: {_peft_line(row['peft'])}", flush=True)
            print(
                f"[{n}/{len(chosen)}] {pid} {s}: kept F1 ctxc "
                f"{f['reading/ctxc/f1']['kept'] or 0:.2f}, general {f['general/ctxc']['baked']}"
                f"/{f['general/ctxc']['full']}, other F1 {f['other_document']['baked_f1']:.1f}"
                f"/{f['other_document']['original_f1']:.1f}, off-topic KL "
                f"{f['off_topic']['baked_kl']:.3f}/{f['off_topic']['none_kl']:.3f}",
                flush=True,
            )


def _peft_base(model: str | None) -> Path:
    """The GGUF file ``--peft``'s child loads the base from (Transformers' GGUF loader)."""
    if model is None:
        from ctxc.models.load import bundled_gguf

        return bundled_gguf()
    if not model.endswith(".gguf"):
        raise SystemExit(f"--peft loads the base from a GGUF file; got {model}")
    return Path(model).resolve()


def _peft_parts(got: dict) -> list[dict]:
    """One bake's PEFT checks (each with ``answers`` and ``equal``): every form of each."""
    return [got["other_document"], *got["reading"].values(), *got["general"].values()]


def _peft_line(got: dict) -> str:
    """One bake's PEFT answers, as a progress line."""
    if "error" in got:
        return f"not served: {got['error']}"
    parts = _peft_parts(got)
    same = sum(x["equal"] for x in parts)
    return f"{same} of {sum(len(x['answers']) for x in parts)} answers equal ({got['seconds']} s)"


def _rescope(args) -> None:
    """Recompute the scope decisions of every paragraph of ``--out`` (no model loads)."""
    from ctxc.models.load import load_tokenizer

    out = Path(args.out)
    doc = json.loads(out.read_text())
    subset = {p["id"]: p for p in json.loads(DATA.read_text())["paragraphs"]}
    general = json.loads(GENERAL.read_text())["questions"]
    frame = Framing(load_tokenizer(args.model), bool(doc.get("chat")))
    for pid, ref in doc["paragraphs"].items():
        ref["scope"] = scope_decisions(frame, subset[pid], subset[ref["other"]], general)
    _write(out, doc)
    print(f"{len(doc['paragraphs'])} paragraphs' scope decisions written to {out}")


def main(argv: list[str] | None = None) -> None:
    """Measure (settings, ``--out``) or render (``--render JSON``: Markdown on stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paragraphs", type=int, default=10, help="the subset's first N (of 40)")
    p.add_argument("--skip", type=int, default=0, help="leave the first N paragraphs out")
    p.add_argument("--out", default="benchmarks/results/noharm.json")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--model", help="a model path or GGUF (default: the bundled Gemma 3 270M)")
    p.add_argument("--chat", action="store_true", help="the paragraph as the system turn")
    p.add_argument(
        "--peft",
        action="store_true",
        help="every bake also written as a LoRA and asked through plain PEFT in a fresh process "
        "(a LoRA-servable setting; the model a GGUF file)",
    )
    p.add_argument("--render", metavar="JSON", help="print the Markdown page of a results file")
    p.add_argument(
        "--rescope",
        action="store_true",
        help="fill in every paragraph's scope decisions in --out (the tokenizer alone loads)",
    )
    p.add_argument("settings", nargs="*", help="'default' or name=value,... (BakeOptions)")
    args = p.parse_args(argv)
    if args.rescope:
        _rescope(args)
    elif args.render:
        print(render(json.loads(Path(args.render).read_text()), args.render), end="")
    else:
        _run(args)


if __name__ == "__main__":
    main()
