"""``ctxc compile --chat`` and ``ctxc generate --chat`` on tiny models with real chat templates
(issue 24): report.json's rendered query turn fed to the emitted model gives the full
conversation's logits; bad input is one line, exit 2, no folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testbed.chat import DOCUMENTS, QUERIES, SYSTEMS, chat_model_dir, chat_tokenizer
from tests.fixtures.helpers import diff_msg, max_diff, run_cli

pytestmark = pytest.mark.tiny

BOUND = 2e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny chat models: name -> folder (``notemplate``: Llama 3's without its template)."""
    root = tmp_path_factory.mktemp("chat-models")
    out = {n: chat_model_dir(root / n, n) for n in ("llama3", "gemma3", "qwen3")}
    out["notemplate"] = chat_model_dir(root / "notemplate", "llama3", with_template=False)
    return out


def _files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "system.txt").write_text(SYSTEMS[1] + "\n")
    (tmp_path / "doc.txt").write_text(DOCUMENTS[0] + "\n")
    conversation = [
        {"role": "user", "content": DOCUMENTS[1]},
        {"role": "assistant", "content": "An invoice."},
        {"role": "user", "content": DOCUMENTS[2]},
        {"role": "assistant", "content": "A program."},
        {"role": "user", "content": QUERIES[2]},
    ]
    (tmp_path / "conv.json").write_text(json.dumps(conversation))
    return {"system": "system.txt", "doc": "doc.txt", "conv": "conv.json"}


def _emitted_matches_full(folder: Path, model_dir: Path, report: dict) -> None:
    """model/ (plain Transformers) fed the report's query ids against the original model fed
    the template's ids for the whole conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder / "model"))  # the tokenizer travels along
    chat = report["chat"]
    assert list(tok(chat["query_text"], add_special_tokens=False).input_ids) == report["query_ids"]
    whole = tok.apply_chat_template(chat["messages"], tokenize=True, add_generation_prompt=True)
    whole = list(whole["input_ids"] if not isinstance(whole, list) else whole)
    assert whole == report["context_ids"] + report["query_ids"]
    k = len(report["query_ids"])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        full = base(input_ids=torch.tensor([whole])).logits[0, -k:]
        patched_model = AutoModelForCausalLM.from_pretrained(str(folder / "model")).eval()
        patched = patched_model(input_ids=torch.tensor([report["query_ids"]])).logits[0]
        control = base(input_ids=torch.tensor([report["query_ids"]])).logits[0]
    assert max_diff(patched, full) <= BOUND, diff_msg("model/ on the query turn", patched, full)
    assert torch.equal(patched.argmax(-1), full.argmax(-1))
    assert max_diff(control, full) > 100 * BOUND, diff_msg("control", control, full)


@pytest.mark.parametrize(
    ("name", "context"),
    [
        ("llama3", ["--system", "system", "--document", "doc"]),
        ("gemma3", ["--system", "system"]),
        ("qwen3", ["--messages", "conv"]),
    ],
)
def test_compile_chat_report_holds_the_query_turn(models, tmp_path, name, context) -> None:
    files = _files(tmp_path)
    args = [files.get(a, a) for a in context]
    query = [] if "--messages" in context else ["--query", QUERIES[0]]
    run = run_cli(
        "compile", "--chat", *args, *query, "--model", str(models[name]), "--out", "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["max_abs_logit_diff"] <= BOUND and report["top1_match"]
    assert "chat: feed the patched model the query turn" in run.stdout
    _emitted_matches_full(tmp_path / "out", models[name], report)


_SYSTEM_LAST = (
    "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% for m in messages if m.role == 'system' %}<|im_start|>system\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def unsplittable(tmp_path_factory) -> Path:
    """A tiny Qwen 3 whose template writes the system prompt after the conversation."""
    folder = chat_model_dir(tmp_path_factory.mktemp("system-last"), "qwen3")
    tok = chat_tokenizer("qwen3")
    tok.chat_template = _SYSTEM_LAST
    tok.save_pretrained(str(folder))
    return folder


BAD = {
    "no template": (
        ["--chat", "--system", "system", "--query", "q"],
        "notemplate",
        "ctxc: error: the model's tokenizer has no chat template",
    ),
    "not a list": (
        ["--chat", "--messages", "obj.json"],
        "llama3",
        "ctxc: error: messages file obj.json must be a non-empty JSON list of {role, content}",
    ),
    "not role/content": (
        ["--chat", "--messages", "items.json"],
        "llama3",
        "ctxc: error: messages file items.json[1]: role must be one of system, user, assistant",
    ),
    "empty system prompt": (
        ["--chat", "--system", "empty.txt", "--query", "q"],
        "llama3",
        "ctxc: error: system prompt file is empty: empty.txt",
    ),
    "cannot be split": (
        ["--chat", "--system", "system", "--query", "q"],
        "unsplittable",
        "ctxc: error: the chat template cannot be split: it renders the context's turns",
    ),
    "without --chat": (
        ["--system", "system", "--query", "q"],
        "llama3",
        "ctxc: error: --system applies with --chat",
    ),
    "no query": (
        ["--chat", "--system", "system"],
        "llama3",
        "ctxc: error: a chat context needs a --query (the next user message)",
    ),
    "with --context": (
        ["--chat", "--context", "doc", "--query", "q"],
        "llama3",
        "ctxc: error: --chat takes --system, --document or --messages, not --context",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_chat_input_is_one_line_exit_2_no_folder(
    models, unsplittable, tmp_path, case: str
) -> None:
    args, model, start = BAD[case]
    files = _files(tmp_path)
    (tmp_path / "obj.json").write_text(json.dumps({"role": "user", "content": "x"}))
    (tmp_path / "items.json").write_text(
        json.dumps([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}])
    )
    (tmp_path / "empty.txt").write_text("\n")
    folder = unsplittable if model == "unsplittable" else models[model]
    before = sorted(p.name for p in tmp_path.iterdir())
    for command in ("compile", "generate"):
        if command == "generate" and case == "with --context":
            continue  # generate's own wording (no --contexts there)
        run = run_cli(
            command, *[files.get(a, a) for a in args], "--model", str(folder), "--out", "out",
            cwd=tmp_path,
        )  # fmt: skip
        lines = run.stderr.splitlines()
        assert run.returncode == 2, run.stderr
        assert len(lines) == 1 and lines[0].startswith(start), (command, run.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no staging


def test_generate_chat_answer_beside_the_full_answer(models, tmp_path) -> None:
    files = _files(tmp_path)
    run = run_cli(
        "generate", "--chat", "--document", files["doc"], "--query", QUERIES[0],
        "--max-new-tokens", "16", "--model", str(models["qwen3"]), "--out", "gen", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    data = json.loads((tmp_path / "gen" / "generate.json").read_text())
    chat = data["chat"]
    assert chat["answers_match"] and len(chat["full_answer_ids"]) == 16
    assert data["context_ids"][-len(chat["query_ids"]) :] == chat["query_ids"]
    assert f"answer (the full conversation, greedy): {chat['full_answer']!r}" in run.stdout
    assert f"answer (the patched model, per token):  {chat['patched_answer']!r}" in run.stdout


def test_contexts_chat_lines(models, tmp_path) -> None:
    lines = [
        {"name": "sys", "system": SYSTEMS[0], "query": QUERIES[0]},
        {"name": "conv", "messages": [
            {"role": "user", "content": DOCUMENTS[0]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": QUERIES[0]},
        ]},
        {"name": "bad", "messages": {"role": "user"}},
        {"name": "both", "context": "x", "system": "y", "query": "z"},
    ]  # fmt: skip
    args = ["compile", "--contexts", "c.jsonl", "--model", str(models["gemma3"]), "--out", "b"]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = run_cli(*args, cwd=tmp_path)
    assert run.returncode == 2 and not (tmp_path / "b").exists(), run.stderr
    assert run.stderr.splitlines() == [
        "ctxc: error: c.jsonl: 2 bad lines (nothing was run): line 3: messages must be a "
        "non-empty JSON list of {role, content} objects (got dict); line 4: 'context' and a "
        "chat line's messages/system/document: give one"
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n")
    run = run_cli(*args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "b" / "index.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for name in ("sys", "conv"):
        report = json.loads((tmp_path / "b" / name / "report.json").read_text())
        assert report["max_abs_logit_diff"] <= BOUND and report["chat"]["query_text"]
