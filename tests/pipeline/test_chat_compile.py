"""Chat contexts compiled on tiny random models carrying real chat templates (issue 24): the
patched model fed the rendered query turn gives the plain forward on the whole conversation
(the template's own ids, with the generation prompt) at every query position; the per-token
protocol's answer matches greedy generation on the whole conversation."""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.core.errors import SolveError
from ctxc.generate.steps import generate
from testbed.chat import DOCUMENTS, QUERIES, SYSTEMS, chat_tokenizer, shared_chat_model
from tests.fixtures.helpers import diff_msg, logits, max_diff

pytestmark = pytest.mark.tiny

TEMPLATES = ("llama3", "gemma3", "qwen3")
BOUND = 2e-5


def _model(name: str):
    """The session's shared chat model of template ``name`` (built and traced once: a compile
    and a generation leave it as it was) and its tokenizer."""
    return shared_chat_model(name), chat_tokenizer(name)


def _whole_ids(tok, messages: list[dict]) -> list[int]:
    """The template's ids for the whole conversation with the generation prompt."""
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _check(name: str, messages: list[dict], query: str | None, update: str = "stable") -> dict:
    """Compile; the patched model on the query ids against the full conversation's forward."""
    model, tok = _model(name)
    result = ctxc.compile(model, tok, messages=messages, query=query, update=update)
    report = result.report
    given = [*messages, {"role": "user", "content": query}] if query is not None else messages
    rendered = report.chat["messages"]  # the conversation the template rendered
    if not report.chat["document_and_query_in_one_turn"]:
        assert rendered == given
    else:  # a template that refuses two user turns in a row (Gemma 3)
        merged = f"{given[-2]['content']}\n\n{given[-1]['content']}"
        assert rendered == [*given[:-2], {"role": "user", "content": merged}]
    whole = _whole_ids(tok, rendered)
    assert report.context_ids + report.query_ids == whole
    k = len(report.query_ids)
    full = logits(model, whole)[-k:]
    patched = logits(model, report.query_ids, result.patch)
    control = logits(model, report.query_ids)
    assert max_diff(patched, full) <= BOUND, diff_msg("patched vs full conversation", patched, full)
    assert torch.equal(patched.argmax(-1), full.argmax(-1)), "top-1 at a query position"
    # the context matters: the unpatched model fed the query turn is far off
    assert max_diff(control, full) > 100 * BOUND, diff_msg("control", control, full)
    assert report.chat is not None and report.chat["query_text"]
    return report.to_dict()


# Gemma 3's post-MLP norm: for this 14-token query turn no shared post-norm scale serves every
# position in block 0, under any rule (the solver's condition, refused with its reason; the
# split is not at fault: the same conversation's other queries compile).
_REFUSED = {("gemma3", "document", 1)}


def _marks(name: str, kind: str, i: int) -> list:
    marks = []
    if (name, kind, i) in _REFUSED:
        marks.append(pytest.mark.xfail(raises=SolveError, strict=True, reason="solver"))
    return marks


CASES = [
    pytest.param(name, kind, i, marks=_marks(name, kind, i), id=f"{name}-{kind}{i}")
    for name in TEMPLATES
    for kind in ("system", "document")
    for i in range(3)
]


@pytest.mark.parametrize(("name", "kind", "i"), CASES)
def test_system_prompt_or_document_compiles_exactly(name: str, kind: str, i: int) -> None:
    turn = {"role": "system", "content": SYSTEMS[i]}
    if kind == "document":
        turn = {"role": "user", "content": DOCUMENTS[i]}
    _check(name, [turn], QUERIES[i])


def test_a_query_turn_one_shared_scale_cannot_serve_is_exact_under_lora() -> None:
    """The refused case above: the stable rule names the lora rule, which moves o_proj and
    down_proj per query position instead of one post-norm scale (MATH.md 10)."""
    messages = [{"role": "user", "content": DOCUMENTS[1]}]
    with pytest.raises(SolveError, match="the lora rule moves o_proj and down_proj"):
        _check("gemma3", messages, QUERIES[1])
    data = _check("gemma3", messages, QUERIES[1], update="lora")
    assert len(data["query_ids"]) == 14 and data["update"] == "lora"


@pytest.mark.parametrize("name", TEMPLATES)
def test_three_turns_compiled_the_fourth_the_query(name: str) -> None:
    messages = [
        {"role": "system", "content": SYSTEMS[2]},
        {"role": "user", "content": DOCUMENTS[1]},
        {"role": "assistant", "content": "An invoice for nails and hammers."},
        {"role": "user", "content": QUERIES[1]},
    ]
    data = _check(name, messages, None)
    assert data["chat"]["roles"] == ["system", "user", "assistant", "user"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_generate_follows_the_full_conversation_greedy(name: str) -> None:
    from ctxc.core.chat import split_chat

    model, tok = _model(name)
    split = split_chat(tok, [{"role": "user", "content": DOCUMENTS[0]}], QUERIES[0])
    ids = split.context_ids + split.query_ids
    result = generate(model, ids, 16)
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16
        )[0, len(ids) :].tolist()
    assert [s.baseline_token for s in result.steps] == greedy
    assert [s.patched_token for s in result.steps] == greedy
    worst = max(s.max_abs_logit_diff for s in result.steps)
    assert worst <= BOUND, f"per-token protocol: max {worst:.3g}"


def test_messages_with_another_input_or_no_tokenizer_is_refused() -> None:
    model, tok = _model("llama3")
    turn = [{"role": "system", "content": SYSTEMS[0]}]
    with pytest.raises(ctxc.CtxcError, match="give messages or a context"):
        ctxc.compile(model, tok, context="x", messages=turn, query="q")
    with pytest.raises(ctxc.CtxcError, match="give messages or a context"):
        ctxc.compile(model, tok, context_ids=[1, 2], messages=turn, query="q")
    with pytest.raises(ctxc.CtxcError, match=r"a tokenizer .* is needed"):
        ctxc.compile(model, None, messages=turn, query="q")
