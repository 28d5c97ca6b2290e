"""``ctxc bake`` and ``ctxc eval-bake`` on a tiny model: the artefacts, the report, bad input."""

from __future__ import annotations

import json

import pytest

from ctxc.bake.scope import Scope, terms
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny


@pytest.fixture
def texts(tmp_path):
    context = tmp_path / "context.txt"
    context.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    queries = tmp_path / "queries.txt"
    queries.write_text("w5 w6 w7\n\nw20 w21\nw30 w31 w32 w33\n")
    held = tmp_path / "held.txt"
    held.write_text("w8 w9\nw40 w41 w42\n")
    return context, queries, held


def test_bake_writes_patch_report_and_model(tiny_model_dir, texts, tmp_path):
    context, queries, held = texts
    out = tmp_path / "out"
    proc = run_cli(
        "bake", "--model", str(tiny_model_dir), "--context", str(context),
        "--queries", str(queries), "--samples", "2", "--sample-tokens", "4", "--rank", "4",
        "--eval-queries", str(held), "--eval-questions", str(held),
        "--eval-samples", "1", "--eval-off-topic", "2", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        ".ctxc", "model", "patch.safetensors", "report.json", "scope.json"
    ]  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    # Its scope (issue 53): the context's words, the threshold in the report and the file.
    gate = Scope.load(out)
    assert report["scope"] == {
        "file": "scope.json", "threshold": gate.threshold, "words": len(gate.words)
    } and gate.admits(context.read_text()), report["scope"]  # fmt: skip
    assert report["fit_queries"] == 5 and report["fit_kinds"] == {"file": 3, "sample": 2}
    assert report["options"]["rank"] == 4
    figures = report["figures"]
    assert set(figures) == {
        "fit", "held_out_samples", "held_out_queries", "held_out_questions", "off_topic"
    }  # fmt: skip
    # Off the context (issue 53): two samples of about 16 tokens (and any question written).
    assert figures["off_topic"]["patched"]["positions"] >= 16, figures["off_topic"]
    answers = figures["held_out_questions"]["patched"]["answers"]
    assert answers is not None and 0.0 <= answers <= 1.0, figures["held_out_questions"]
    for pair in figures.values():
        p, c, s = pair["patched"], pair["control"], pair["scoped"]
        assert p["positions"] == c["positions"] == s["positions"] > 0
        assert 0.0 <= p["top1"] <= 1.0 and p["kl"] >= 0.0
        # Served with the scope: the patch's figures where every query is in scope, the
        # control's where none is.
        assert 0 <= s["in_scope"] <= s["queries"] == p["queries"], s
        if s["in_scope"] == s["queries"]:
            assert (s["kl"], s["top1"]) == (p["kl"], p["top1"]), (s, p)
        if s["in_scope"] == 0:
            assert (s["kl"], s["top1"]) == (c["kl"], c["top1"]), (s, c)
    assert "served with its scope" in proc.stdout, proc.stdout
    fit = figures["fit"]
    assert fit["patched"]["kl"] < fit["control"]["kl"], fit
    # Per block: each move's relative residual, the output residual, the effective rank.
    blocks = report["blocks"]
    assert blocks, report.keys()
    for b in blocks:
        assert b["move_residuals"] and b["residual_rms"] >= 0 and b["effective_rank"] > 0, b
        # Gemma's sandwich norms: the attention output projection is moved by default.
        o_proj = b["path"].replace("mlp", "self_attn.o_proj.weight")
        assert o_proj in b["move_residuals"] and o_proj in b["ranks"], b
    assert "KL" in proc.stdout
    again = run_cli(
        "eval-bake", str(out), "--model", str(tiny_model_dir), "--queries", str(held),
        "--gen-tokens", "3", cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "held_out" in again.stdout and "served with its scope" in again.stdout, again.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "0", "--questions", "0", "--cloze", "0"], "nothing to fit"),
        (["--data", "continuations", "--samples", "0"], "--samples 0 and no --queries"),
        (
            ["--data", "self-study", "--questions", "0", "--cloze", "0"],
            "--questions 0 and --cloze 0",
        ),
        # the default's cloze questions, but a context with no name or number to ask about
        (["--samples", "0", "--questions", "0"], "no name or number to ask about (--cloze)"),
        (["--rank", "0"], "--rank must be at least 1"),
        (["--rank", "99999"], "past the matrix size"),
        (["--queries", "EMPTY"], "query file is empty"),
        (["--sample-tokens", "5000"], "the model takes at most"),
        (["--steps", "5", "--seconds", "3"], "--steps is for --method distill (not fit)"),
        (["--rank", "auto", "--method", "distill"], "--rank auto is for --method fit"),
        (["--rank", "many"], "--rank 'many' is not an integer, 'full' or 'auto'"),
        (["--method", "distill", "--lr", "0"], "--lr must be positive"),
    ],
)
def test_bake_bad_input_is_one_line_and_no_folder(tiny_model_dir, texts, tmp_path, args, message):
    context, _, _ = texts
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    out = tmp_path / "bad"
    proc = run_cli(
        "bake", "--model", str(tiny_model_dir), "--context", str(context), "--out", str(out),
        *args, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxc: error:"), proc.stderr
    assert message in lines[0], lines[0]
    assert not out.exists()
    assert not list(tmp_path.glob(".bad.partial-*"))


def test_bake_chat_writes_a_model_asked_through_its_template(tmp_path):
    """``ctxc bake --chat`` (issue 35) on a tiny Llama 3 chat model: the held-out questions are
    asked as user turns (the patched side fed the template's ids for the turn alone, the BOS
    its opening), model/ fed that rendering gives the patch's logits, and ``eval-bake`` asks
    its queries the same way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxc.core.chat import template_ids
    from ctxc.patch import Patch
    from testbed.chat import DOCUMENTS, QUERIES, SYSTEMS, chat_model_dir

    model_dir = chat_model_dir(tmp_path / "llama3", "llama3")
    (tmp_path / "system.txt").write_text(SYSTEMS[1] + "\n")
    (tmp_path / "doc.txt").write_text(DOCUMENTS[0] + "\n")
    (tmp_path / "q.txt").write_text("\n".join(QUERIES) + "\n")
    (tmp_path / "held.txt").write_text("Who built it?\nWhat is it?\n")
    proc = run_cli(
        "bake", "--chat", "--system", "system.txt", "--document", "doc.txt", "--queries",
        "q.txt", "--samples", "2", "--sample-tokens", "4", "--questions", "0", "--cloze", "0",
        "--answer-tokens", "4", "--rank", "4", "--eval-questions", "held.txt",
        "--eval-samples", "1", "--model", str(model_dir), "--out", "out", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "chat: the patched model answers its chat template applied to the user's" in (
        proc.stdout
    )
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    chat = report["chat"]
    assert chat["roles"] == ["system", "user"] and chat["opening_ids"] == [tok.bos_token_id]
    # A chat bake refits on its own answers by default: one per answered query turn.
    assert report["fit_kinds"] == {"file": 3, "sample": 2, "on-policy": 3}
    assert report["options"]["on_policy"] is None and "on_policy" in report["timings"]
    turns = chat["messages"]
    # Its scope holds the context turns' words, not the template's (issue 53).
    words = Scope.load(out).words
    assert terms(SYSTEMS[1] + " " + DOCUMENTS[0]) == words, sorted(words)

    def turn_length(q: str) -> int:  # the query turn's ids: the whole less the context's
        whole = template_ids(tok, [*turns, {"role": "user", "content": q}])
        return len(whole) - _context_ids(out)

    held = ["Who built it?", "What is it?"]
    positions = report["figures"]["held_out_questions"]["patched"]["positions"]
    assert positions == sum(1 + turn_length(q) for q in held)  # the BOS's and the turn's
    alone = template_ids(tok, [{"role": "user", "content": QUERIES[0]}])
    with torch.no_grad():
        emitted = AutoModelForCausalLM.from_pretrained(str(out / "model")).eval()
        got = emitted(input_ids=torch.tensor([alone])).logits[0]
        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        with Patch.load(out).applied(base):
            want = base(input_ids=torch.tensor([alone])).logits[0]
    assert float((got - want).abs().max()) < 1e-4
    again = run_cli(
        "eval-bake", "out", "--model", str(model_dir), "--queries", "held.txt",
        "--gen-tokens", "2", cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    figures = json.loads(again.stdout.strip().splitlines()[-1])["held_out"]["patched"]
    assert figures["positions"] == positions


def _context_ids(out) -> int:
    """The baked context's length in tokens (patch.safetensors' metadata)."""
    from ctxc.patch import Patch

    return len(Patch.load(out).meta.context_ids)
