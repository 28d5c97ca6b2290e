"""Routed chat bakes (issue 54): a document cut into chunks, each baked alone as a chat bake
whose system turn is the chunk, on a tiny Llama 3 chat model. A chunk's folder is the folder
``bake_into`` writes for ``messages=[system: chunk]`` with the same options: its patch bit for
bit, its report equal but for the wall times and ``route``. The router records the mode: a
``--resume`` of the other mode is refused in one line before any model loads, one of the same
mode bakes the missing chunk as it was; ``--add`` bakes chat chunks; ``ctxc route`` picks a
chunk whose report is a chat bake's.

Every bake here computes at one thread, in this process (``--workers 1``): the resumed chunk is
compared byte for byte with the one baked before it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ctxc.bake import BakeJob, BakeOptions, HeldOut, Router, bake_into, bake_routed
from ctxc.bake.route import chunk_turns
from ctxc.core.chat import NO_TEMPLATE
from testbed.chat import DOCUMENTS, SYSTEMS, chat_model_dir
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

# Two paragraphs (the lighthouse, the invoice): two chunks at one word a chunk.
_DOC = f"{DOCUMENTS[0]}\n\n{DOCUMENTS[1]}"
_WORDS = 1
# Cheap options that still run every chat step: sampled continuations, cloze questions
# answered in turns, the on-policy refit (a chat bake's default), a held-out question asked as
# a user turn.
_OPTIONS = BakeOptions(rank=8, samples=2, sample_tokens=4, questions=0, cloze=2, answer_tokens=4)
_QUESTION = "Who built it?"
_HELD = HeldOut(questions=(_QUESTION,), samples=0, off_topic=0)
# The same on the command line (with held.txt holding _QUESTION).
_FIT = ["--rank", "8", "--samples", "2", "--sample-tokens", "4", "--questions", "0",
        "--cloze", "2", "--answer-tokens", "4", "--eval-questions", "held.txt",
        "--eval-samples", "0", "--eval-off-topic", "0", "--route", "--chunk-words",
        str(_WORDS), "--workers", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama 3 chat model and its tokenizer (the template's system turn)."""
    return chat_model_dir(tmp_path_factory.mktemp("chat-llama3"), "llama3")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """This module's ``CTXC_CACHE``: the chat model traced once for every bake here."""
    return tmp_path_factory.mktemp("routed-chat-cache")


@pytest.fixture(autouse=True)
def one_thread(cache, monkeypatch):
    """Torch at one thread, the module's cache."""
    monkeypatch.setenv("CTXC_CACHE", str(cache))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``folder/patch.safetensors``' tensors by name and its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(folder / "patch.safetensors")
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata() or {})
    return load_file(path), meta


def _report(folder: Path) -> dict:
    """A bake folder's report.json without its wall times."""
    report = json.loads((folder / "report.json").read_text())
    report.pop("timings")
    return report


def test_a_chat_chunk_s_folder_is_the_chat_bake_of_its_text(chat_dir, tmp_path) -> None:
    """In this process: each chunk's patch is, tensor for tensor (``torch.equal``), the patch
    of ``bake_into`` with the chunk as the one system turn; its report is that bake's report
    (figures included) with ``route`` added; its files are the same."""
    out = tmp_path / "routed"
    job = BakeJob(
        out, chunks=(("doc.txt", _DOC),), options=_OPTIONS, held=_HELD, emit=(), model=str(chat_dir)
    )
    run = bake_routed(job, _WORDS, chat=True, workers=1)
    router = Router.load(out)
    assert run.report["chunk_ids"] == ["000", "001"] and router.chat, router
    assert router.texts == DOCUMENTS[:2], router.texts
    for cid, text in zip(router.ids, router.texts, strict=True):
        single = tmp_path / f"single-{cid}"
        turns = tuple(chunk_turns(text))
        bake_into(BakeJob(single, messages=turns, options=_OPTIONS, held=_HELD, emit=(),
                          model=str(chat_dir)))  # fmt: skip
        folder = out / "chunks" / cid
        got, want = _tensors(folder), _tensors(single)
        assert sorted(got[0]) == sorted(want[0]) and got[0], cid
        differ = [k for k in want[0] if not torch.equal(got[0][k], want[0][k])]
        assert not differ, f"chunk {cid}: tensors differ from its chat bake's: {differ[:3]}"
        assert got[1] == want[1], cid  # the patch's metadata: context ids, first query, ...
        report = _report(folder)
        assert report.pop("route") == {"chunk": cid, "file": "doc.txt", "words": len(text.split())}
        assert report == _report(single), cid
        assert report["chat"]["messages"] == list(turns) and report["chat"]["roles"] == ["system"]
        assert "held_out_questions" in report["figures"], report["figures"]
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in single.iterdir()), names


@needs_extra("peft")
def test_routed_chat_bake_resumes_adds_and_routes_in_its_mode(
    chat_dir, tmp_path, monkeypatch
) -> None:
    """The command: ``--route --chat --system doc.txt --emit lora`` writes a chat chunk with a
    ``lora/`` adapter per chunk; ``ctxc route`` picks the invoice's chunk, a chat bake of it; a
    resume without ``--chat`` is one line before the model loads; a resume with it bakes the
    missing chunk as it was; ``--add`` bakes a chat chunk."""
    import ctxc.cli.bake as cli_bake

    (tmp_path / "doc.txt").write_text(_DOC + "\n")
    (tmp_path / "more.txt").write_text(SYSTEMS[1] + "\n")
    (tmp_path / "held.txt").write_text(_QUESTION + "\n")
    model = ["--model", str(chat_dir)]
    chat = ["--chat", "--system", "doc.txt"]
    lora = ["--linear-only", "--emit", "lora"]
    proc = run_cli("bake", *model, *_FIT, *chat, *lora, "--out", "routed", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 chunks" in proc.stdout and "chat: the patched model answers" in proc.stdout, proc
    out = tmp_path / "routed"
    router = Router.load(out)
    assert router.chat and router.emit == ("lora",) and router.texts == DOCUMENTS[:2], router
    for cid, text in zip(router.ids, router.texts, strict=True):
        names = sorted(p.name for p in (out / "chunks" / cid).iterdir())
        assert names == [".ctxc", "lora", "patch.safetensors", "report.json", "scope.json"], (
            cid,
            names,
        )
        assert _report(out / "chunks" / cid)["chat"]["messages"] == chunk_turns(text)

    proc = run_cli("route", "routed", "--query", "How many boxes of nails?", cwd=tmp_path)
    picked = Path(proc.stdout.strip())
    assert proc.returncode == 0 and picked == Path("routed") / "chunks" / "001", proc
    assert _report(tmp_path / picked)["chat"]["messages"] == chunk_turns(DOCUMENTS[1])

    # The other mode: refused in one line before the model loads, the folder untouched.
    before = (out / "chunks" / "001" / "patch.safetensors").read_bytes()
    shutil.copytree(out, tmp_path / "again")
    real_load = cli_bake.load

    def no_load(*_args):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(cli_bake, "load", no_load)
    plain = ["--context", "doc.txt", *lora, "--out", "again", "--resume"]
    proc = run_cli("bake", *model, *_FIT, *plain, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "(chat True, now False)" in lines[0], lines
    monkeypatch.setattr(cli_bake, "load", real_load)

    # The same mode: the missing chunk baked again as a chat chunk, byte for byte.
    shutil.rmtree(tmp_path / "again" / "chunks" / "001")
    (tmp_path / "again" / "router.json").unlink()
    again = [*chat, *lora, "--out", "again", "--resume"]
    proc = run_cli("bake", *model, *_FIT, *again, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "again" / "chunks" / "001" / "patch.safetensors").read_bytes() == before
    assert (tmp_path / "again" / "router.json").read_bytes() == (out / "router.json").read_bytes()

    # --add on a routed chat bake: the new chunk is a chat chunk with the bake's lora/.
    proc = run_cli("bake", *model, "--add", "routed", "--context", "more.txt", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    added = Router.load(out)
    assert added.ids == ("000", "001", "002") and added.chat, added
    assert _report(out / "chunks" / "002")["chat"]["messages"] == chunk_turns(SYSTEMS[1])
    assert (out / "chunks" / "002" / "lora").is_dir()
    assert (out / "chunks" / "001" / "patch.safetensors").read_bytes() == before
    proc = run_cli("route", "routed", "--query", "Who is the librarian?", cwd=tmp_path)
    assert Path(proc.stdout.strip()) == Path("routed") / "chunks" / "002", proc


def test_a_routed_chat_bake_needs_a_chat_template(tiny_model_dir, tmp_path) -> None:
    """A model without a chat template: one line once its tokenizer is read, nothing written."""
    (tmp_path / "doc.txt").write_text(_DOC)
    args = ["--route", "--chat", "--system", "doc.txt", "--out", "o"]
    proc = run_cli("bake", "--model", str(tiny_model_dir), *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == [f"ctxc: error: {NO_TEMPLATE}"], proc.stderr
    assert not (tmp_path / "o").exists()
