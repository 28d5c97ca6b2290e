"""``bake(..., messages=...)`` (issue 35) on tiny random models carrying the real Llama 3,
Gemma 3 and Qwen 3 chat templates: the fit data are chat-rendered, the token split is exact
(full input = context ids + query ids, the template's own ids for the conversation; the patched
input = the template's ids for the user turn alone), and an opening's unmatched positions are
neither fitted nor compared."""

from __future__ import annotations

import pytest
import torch

import ctxc.bake.chat as chat_module
from ctxc.bake.chat import CHAT_SEEDS, chat_format, chat_self_study
from ctxc.bake.data import record_fit_targets
from ctxc.bake.driver import BakeOptions, bake, bake_data, query_rows
from ctxc.bake.evaluate import evaluate_against, position_figures, reference
from ctxc.bake.selfstudy import SEED_PROMPTS
from ctxc.bake.targets import cached_fit_targets
from ctxc.core.chat import template_ids
from ctxc.store.traced import traced_blocks
from testbed.chat import DOCUMENTS, QUERIES, SYSTEMS, chat_model, chat_tokenizer, shared_chat_model
from tests.fixtures.extras import needs_extra

pytestmark = pytest.mark.tiny

# template -> its context turns: a system prompt and a document (Llama 3: at the turn), a
# system prompt (Gemma 3: inside the query's turn), a document (Qwen 3: no opening at all).
_TURNS = {
    "llama3": [
        {"role": "system", "content": SYSTEMS[0]},
        {"role": "user", "content": DOCUMENTS[0]},
    ],
    "gemma3": [{"role": "system", "content": SYSTEMS[1]}],
    "qwen3": [{"role": "user", "content": DOCUMENTS[1]}],
}
# Without on-policy rows (tests/bake/test_onpolicy.py): the data are the teacher's alone.
_OPTIONS = BakeOptions(
    samples=2, sample_tokens=4, questions=0, cloze=0, answer_tokens=5, rank=4, on_policy=False
)


def _model(name: str) -> torch.nn.Module:
    """The session's shared ``chat_model(name)`` (built once, and so traced once, the trace
    being cached on the model): the bakes, evaluations and generations here leave a model as it
    was, as tests/bake/test_bake.py's shared models do; the distill test, which trains, builds
    its own."""
    return shared_chat_model(name)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3"])
def test_chat_fit_data_are_the_template_s_ids_split_exactly(name: str) -> None:
    """Every fit query's full input is the template's ids for the whole conversation (the
    answer after them); its patched input is the template's ids for the user turn alone, the
    same answer after them; the answer is the full-context model's greedy one, cut after the
    end of its turn."""
    model, tok = _model(name), chat_tokenizer(name)
    turns = _TURNS[name]
    result = bake(model, tok, None, list(QUERIES), options=_OPTIONS, messages=turns)
    data, chat = result.data, result.chat
    assert chat is not None and data.opening and chat.opening_exact
    assert data.kinds == ["file"] * 3 + ["sample"] * 2
    assert data.prefix == chat.opening and data.head == min(len(chat.opening), 1)
    for i, q in enumerate(QUERIES):
        whole = template_ids(tok, [*turns, *_user(q)])
        alone = template_ids(tok, _user(q))
        full, reduced = data.full(i), data.reduced(i)
        assert full[: len(whole)] == whole, (tok.decode(full), tok.decode(whole))
        assert reduced[: len(alone)] == alone, (tok.decode(reduced), tok.decode(alone))
        answer = full[len(whole) :]
        assert answer == reduced[len(alone) :] and 1 <= len(answer) <= 5
        assert not any(t in chat.ends for t in answer[:-1]), answer
        got = torch.tensor([full[: len(whole)]])
        with torch.no_grad():  # greedy, one token at a time, up to the end of the turn
            for t in answer:
                assert int(model(input_ids=got).logits[0, -1].argmax()) == t
                got = torch.cat([got, torch.tensor([[t]])], 1)
    assert data.full(0)[: len(data.context_ids)] == chat.context_ids
    report = result.report["chat"]
    assert report["opening_ids"] == chat.opening and report["roles"] == [t["role"] for t in turns]


def test_the_opening_s_positions_are_neither_fitted_nor_compared() -> None:
    """Llama 3's opening is its BOS alone; Gemma 3's is ``<bos><start_of_turn>user\\n``: only
    its last position is matched to the context's last. The cached targets equal the graph's
    at the matched positions (the unmatched rows copy the first matched one); the evaluation
    compares exactly the matched positions: the patched model fed opening + query against the
    full model's last positions."""
    model, tok = _model("gemma3"), chat_tokenizer("gemma3")
    chat = chat_format(tok, _TURNS["gemma3"])
    assert len(chat.opening) == 4, tok.decode(chat.opening)
    data = bake_data(model, tok, chat.context_ids, list(QUERIES), 0, 1, 0, chat=chat)
    assert [data.matched(i) for i in range(3)] == [1 + len(q) for q in data.queries]
    traced, blocks = traced_blocks(model)
    graph = record_fit_targets(traced, blocks, data)
    cached = cached_fit_targets(model, traced, blocks, data)
    n = sum(len(data.reduced(i)) for i in range(3))
    for path, tg in graph.items():
        assert tg.z.shape[0] == n and cached[path].z.shape[0] == n
        torch.testing.assert_close(cached[path].y, tg.y, rtol=1e-4, atol=1e-4)
    first = graph[blocks.blocks[0].path].y
    assert torch.equal(first[0], first[3])  # the unmatched rows: copies of the matched one
    k = len(data.reduced(0))  # fitted rows: the query's; with fit_prefix, the matched one too
    assert query_rows(data)[:k].tolist() == [False] * 4 + [True] * (k - 4)
    assert query_rows(data, fit_prefix=True)[:k].tolist() == [False] * 3 + [True] * (k - 3)
    patch = bake(model, tok, options=_OPTIONS, data=data).patch
    ref = reference(model, data, gen_tokens=0)
    got = evaluate_against(model, patch, ref)
    direct = []
    with torch.no_grad():
        for i in range(3):
            m = data.matched(i)
            full = model(input_ids=torch.tensor([data.full(i)])).logits[0, -m:]
            with patch.applied(model):
                patched = model(input_ids=torch.tensor([data.reduced(i)])).logits[0, -m:]
            direct.append(position_figures(patched, full)[0])
    assert got.positions == sum(data.matched(i) for i in range(3))
    assert abs(got.kl - float(torch.cat(direct).mean())) < 1e-5, (got.kl, direct)


def test_chat_self_study_asks_in_turns_and_answers(monkeypatch) -> None:
    """A reply from a wh-word after a seed prompt's user turn is the question; the fit query is
    its user turn and the greedy answer. The replies are faked (a random model writes no
    ``?``): each row's reply decodes to ``" is it?"``, the answers to four fixed ids."""
    model, tok = _model("llama3"), chat_tokenizer("llama3")
    chat = chat_format(tok, _TURNS["llama3"])
    reply = list(tok(" is it?", add_special_tokens=False).input_ids)
    seen: list[list[list[int]]] = []

    def fake(model, context_ids, rows, steps, generator=None, start=None, until=None):
        assert context_ids == chat.context_ids
        seen.append(rows)
        return [reply if until is not None else [5, 6, 7, 8] for _ in rows]

    monkeypatch.setattr(chat_module, "continue_rows", fake)
    queries, questions = chat_self_study(model, chat, 3, answer_tokens=4, start=object())
    assert questions == [f"{w} is it?" for w in SEED_PROMPTS[:3]]
    for row, c in zip(seen[0], range(3), strict=True):
        wh = list(tok(SEED_PROMPTS[c], add_special_tokens=False).input_ids)
        assert row == chat.turn(CHAT_SEEDS[c]) + wh
    for q, text in zip(queries, questions, strict=True):
        assert q == [*chat.turn(text), 5, 6, 7, 8]


@needs_extra("peft")
def test_distill_learns_on_the_matched_positions() -> None:
    """``--method distill`` on chat data: the teacher's rows are the matched positions (the
    opening's last and the query's), and the student's logits are cut to them."""
    from ctxc.bake.distill import teacher_top

    model, tok = chat_model("gemma3"), chat_tokenizer("gemma3")
    opts = BakeOptions(
        method="distill", distill_steps=2, rank=2, samples=0, questions=0, answer_tokens=3
    )
    result = bake(model, tok, None, list(QUERIES[:2]), options=opts, messages=_TURNS["gemma3"])
    data = result.data
    teacher = teacher_top(model, data)
    assert [t[1].shape[0] for t in teacher] == [data.matched(i) for i in range(2)]
    assert result.report["distill"]["steps"] == 2 and result.patch.deltas


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3"])
def test_chat_cloze_queries_are_user_turns_answered_by_the_span(name: str) -> None:
    """A chat bake's extractive queries: the question as the user's turn after the context
    turns (the template's ids for the conversation, split exactly), the answer the span's ids
    and one end of turn; with ``fit_rows`` ``answers`` only the span's positions are fitted."""
    from ctxc.bake.cloze import chat_cloze_queries

    model, tok = _model(name), chat_tokenizer(name)
    role = "system" if name == "gemma3" else "user"  # Gemma 3's system prompt: inside the turn
    turns = [*_TURNS[name][:-1], {"role": role, "content": DOCUMENTS[0]}]  # names and numbers
    options = BakeOptions(
        samples=0, questions=0, cloze=3, rank=4, fit_rows="answers", on_policy=False
    )
    # The default teacher reads each cloze turn (question, span, end of turn) before itself.
    result = bake(model, tok, None, None, options=options, messages=turns)
    data, chat = result.data, result.chat
    assert chat is not None
    ids, starts, found = chat_cloze_queries(chat, 3)
    assert data.kinds == ["cloze"] * len(found) and 0 < len(found) <= 3, data.kinds
    for i, c in enumerate(found):
        whole = template_ids(tok, [*turns, *_user(c.question)])
        assert data.shown_before(i) == data.queries[i], i
        full, alone = data.full(i), template_ids(tok, _user(c.question))
        full = full[: len(chat.context_ids)] + full[len(chat.context_ids) + len(ids[i]) :]
        span = tok(c.answer, add_special_tokens=False).input_ids
        assert c.answer in " ".join(t["content"] for t in turns), c
        assert full[: len(whole)] == whole, (tok.decode(full), tok.decode(whole))
        assert data.reduced(i)[: len(alone)] == alone, tok.decode(data.reduced(i))
        assert full[len(whole) : -1] == span and full[-1] in chat.ends, tok.decode(full)
        assert data.queries[i] == ids[i] and starts[i] == len(whole) - len(chat.context_ids)
    rows = query_rows(data, answers=True)
    assert 0 < int(rows.sum()) < data.positions, (int(rows.sum()), data.positions)
    # In several wordings (issue 53): question i's turn in wording i, the answer as before.
    from ctxc.core.vocabulary import CLOZE_TURN_PHRASINGS

    worded, w_starts, _ = chat_cloze_queries(chat, 3, phrasings=3)
    for i, c in enumerate(found):
        turn = chat.turn(CLOZE_TURN_PHRASINGS[i].format(question=c.question))
        assert worded[i][: w_starts[i]] == turn, tok.decode(worded[i])
        assert worded[i][w_starts[i] :] == ids[i][starts[i] :], tok.decode(worded[i])
