"""How a conversation is split into context and query ids by a real chat template (issue 24):
the split is a boundary the template really produces, or a one-line refusal saying why."""

from __future__ import annotations

import json

import pytest

from ctxc.core.chat import chat_messages, check_messages, read_messages, split_chat
from ctxc.core.errors import CtxcError
from testbed.chat import CHAT_FAMILIES, DOCUMENTS, QUERIES, SYSTEMS, chat_tokenizer

pytestmark = pytest.mark.tiny

CONVERSATION = [  # three turns; the fourth, a user turn, is the query
    {"role": "system", "content": SYSTEMS[1]},
    {"role": "user", "content": DOCUMENTS[1]},
    {"role": "assistant", "content": "The invoice is for nails and hammers."},
]
# (template, context) -> where the split falls, and whether document and query share a turn
KINDS = {
    ("llama3", "system"): ("turn", False),
    ("llama3", "document"): ("turn", False),
    ("llama3", "messages"): ("turn", False),
    # Gemma 3 writes the system prompt inside the first user turn...
    ("gemma3", "system"): ("in the query's turn", False),
    # ... and refuses two user turns in a row: document and query share one
    ("gemma3", "document"): ("in the query's turn", True),
    ("gemma3", "messages"): ("turn", False),
    ("qwen3", "system"): ("turn", False),
    ("qwen3", "document"): ("turn", False),
    # Qwen 3 renders the last assistant turn with an empty <think> block when it ends the
    # conversation, and without it once a user turn follows
    ("qwen3", "messages"): ("in the query's turn", False),
}


def _context(kind: str, i: int = 0) -> list[dict]:
    if kind == "system":
        return [{"role": "system", "content": SYSTEMS[i]}]
    if kind == "document":
        return [{"role": "user", "content": DOCUMENTS[i]}]
    return CONVERSATION


def _template_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize(("name", "kind"), sorted(KINDS))
def test_split_is_the_templates_own_ids(name: str, kind: str) -> None:
    tok = chat_tokenizer(name)
    context, query = _context(kind), QUERIES[1]
    split = split_chat(tok, context, query)
    # context ids + query ids are the template's ids for the whole conversation
    assert split.context_ids + split.query_ids == _template_ids(tok, list(split.messages))
    assert (split.split, split.merged) == KINDS[(name, kind)]
    for m in context:  # every context turn is in the compiled part
        assert m["content"].strip() in split.context_text
    assert query not in split.context_text and query in split.query_text
    assert split.query_text_alone  # the text re-tokenizes to the query ids
    assert list(tok(split.query_text, add_special_tokens=False).input_ids) == split.query_ids
    if split.split == "turn":  # the context rendered alone, as the template renders it
        text = tok.apply_chat_template(context, tokenize=False)
        assert split.context_text == text


def test_the_query_turn_is_the_same_for_every_context() -> None:
    tok = chat_tokenizer("llama3")
    turns = {
        tuple(split_chat(tok, _context(kind, i), QUERIES[0]).query_ids)
        for kind in ("system", "document")
        for i in range(3)
    }
    assert len(turns) == 1


def test_no_template_is_refused() -> None:
    tok = chat_tokenizer("llama3")
    tok.chat_template = None
    with pytest.raises(CtxcError, match="has no chat template"):
        split_chat(tok, _context("system"), "hi")


# The system prompt written after the conversation: nothing before the query holds it.
_SYSTEM_LAST = (
    "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% for m in messages if m.role == 'system' %}<|im_start|>system\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
# No separator between turns: the document's last word and the query's first are one word.
_GLUED = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_template_that_cannot_be_split_is_refused_saying_why() -> None:
    tok = chat_tokenizer("qwen3")
    tok.chat_template = _SYSTEM_LAST
    with pytest.raises(CtxcError) as info:
        split_chat(tok, _context("system"), QUERIES[0])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the chat template cannot be split: it renders the context's")
    assert "system message is not in the part of the conversation that comes before" in message


def test_tokens_merging_across_the_boundary_are_refused() -> None:
    tok = chat_tokenizer("qwen3")
    tok.chat_template = _GLUED
    with pytest.raises(CtxcError, match="last tokens merge with the query's first"):
        split_chat(tok, [{"role": "user", "content": "lib"}], "rarian")


def test_a_template_error_is_one_line() -> None:
    tok = chat_tokenizer("gemma3")
    two = [{"role": "assistant", "content": "ok"}]  # Gemma 3: a conversation opens with a user
    with pytest.raises(CtxcError, match=r"^the chat template refuses this conversation: Conv"):
        split_chat(tok, two, "hi")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"role": "user", "content": "x"}, "must be a non-empty JSON list"),
        ([], "must be a non-empty JSON list"),
        (["hello"], r"\[0\] must be an object with 'role' and 'content'"),
        ([{"role": "user", "content": "x", "name": "a"}], r"\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"\[0\]: role must be one of"),
        ([{"role": "user", "content": 3}], r"\[0\]: content must be a string or a list"),
        ([{"role": "user", "content": ["x"]}], r"\[0\]: a part must be"),
        ([{"role": "user", "content": [{"type": "image", "url": "a"}]}], r"a part must be"),
        ([{"role": "user", "content": []}], r"\[0\]: the user message is empty"),
        ([{"role": "user", "content": " "}], r"\[0\]: the user message is empty"),
    ],
)
def test_bad_messages_are_named(data, message: str) -> None:
    with pytest.raises(CtxcError, match=message):
        check_messages(data)


def test_messages_file(tmp_path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[{'role': 'user'}]")
    with pytest.raises(CtxcError, match=r"is not JSON: .* \(line 1\)"):
        read_messages(path)
    path.write_text(json.dumps(CONVERSATION))
    assert read_messages(path) == CONVERSATION


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"system": " ", "query": "q"}, "the system prompt is empty"),
        ({"document": "", "query": "q"}, "the document is empty"),
        ({"query": "q"}, "needs a system prompt, a document or messages"),
        ({"system": "s"}, "needs a query"),
        ({"system": "s", "query": " "}, "the query is empty"),
        ({"messages": CONVERSATION}, "must be a user turn \\(got assistant\\)"),
        ({"messages": [{"role": "user", "content": "q"}]}, "has no turn before the query"),
        ({"messages": CONVERSATION, "system": "s", "query": "q"}, "not both"),
    ],
)
def test_bad_parts_are_refused(parts: dict, message: str) -> None:
    with pytest.raises(CtxcError, match=message):
        chat_messages(**parts)


def test_the_last_user_message_is_the_query() -> None:
    turns, query = chat_messages(messages=[*CONVERSATION, {"role": "user", "content": "Why?"}])
    assert (turns, query) == (CONVERSATION, "Why?")


def test_every_fixture_template_renders() -> None:
    for name in CHAT_FAMILIES:
        assert chat_tokenizer(name).chat_template.strip()
