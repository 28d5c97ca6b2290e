"""``ctxc bake --route``, ``--add``/``--remove`` on a routed bake and ``ctxc route`` on a tiny
model (issue 36): one patch per chunk, each the patch of a bake of that chunk alone; adding or
removing a chunk leaves the others' files as they were; bad input is one line."""

from __future__ import annotations

import json
import sys

import pytest

from ctxc.bake.route import Router
from ctxc.patch import Patch
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

_FIT = ["--rank", "8", "--samples", "2", "--sample-tokens", "4", "--data", "continuations",
        "--cloze", "0", "--eval-samples", "0", "--linear-only"]  # fmt: skip
_DOC = "w1 w2 w3 w4 w5 w6\n\nw13 w14 w15 w16 w17\n\n\nw30 w31 w32 w33"


def _bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


@needs_extra("peft")
def test_route_bakes_each_chunk_alone_and_adds_and_removes(tiny_model_dir, tmp_path) -> None:
    doc, more, alone = tmp_path / "doc.txt", tmp_path / "more.txt", tmp_path / "one.txt"
    doc.write_text(_DOC)
    more.write_text("w40 w41 w42 w43")
    alone.write_text("w13 w14 w15 w16 w17")
    model, out = ["--model", str(tiny_model_dir)], tmp_path / "routed"
    # In this process (--workers 1): at the thread count of the plain bake it is compared with.
    proc = run_cli("bake", *model, *_FIT, "--route", "--chunk-words", "6", "--context", str(doc),
                   "--emit", "lora", "--out", str(out), "--workers", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    router = Router.load(out)
    assert router.ids == ("000", "001", "002") and router.chunk_words == 6, router
    assert router.texts == tuple(p.strip() for p in _DOC.split("\n\n") if p.strip())
    for cid in router.ids:
        names = sorted(p.name for p in (out / "chunks" / cid).iterdir())
        assert names == [".ctxc", "lora", "patch.safetensors", "report.json", "scope.json"], (
            cid,
            names,
        )
        report = json.loads((out / "chunks" / cid / "report.json").read_text())
        assert report["route"]["chunk"] == cid and report["options"]["rank"] == 8
    assert "3 chunks" in proc.stdout, proc.stdout

    # A chunk's patch is the patch of a plain bake of that chunk's text alone.
    single = tmp_path / "single"
    proc = run_cli("bake", *model, *_FIT, "--context", str(alone), "--emit", "lora",
                   "--out", str(single))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got, want = Patch.load(out / "chunks" / "001"), Patch.load(single)
    assert list(got.deltas) == list(want.deltas)
    worst = max(
        float((got.deltas[n].dense() - d.dense()).abs().max()) for n, d in want.deltas.items()
    )
    assert worst == 0.0, f"routed chunk vs its own bake: max |delta difference| {worst:.3g}"

    proc = run_cli("route", str(out), "--query", "w14 w16?")
    assert proc.returncode == 0 and proc.stdout.strip() == str(out / "chunks" / "001"), proc
    before = {cid: _bytes(out / "chunks" / cid) for cid in router.ids}
    proc = run_cli("bake", *model, "--add", str(out), "--context", str(more))
    assert proc.returncode == 0, proc.stderr
    added = Router.load(out)
    assert added.ids == ("000", "001", "002", "003") and added.texts[3] == "w40 w41 w42 w43"
    assert {cid: _bytes(out / "chunks" / cid) for cid in router.ids} == before
    assert (out / "chunks" / "003" / "lora").is_dir()  # the routed bake's --emit, kept
    proc = run_cli("route", str(out), "--query", "w42", "--scores")
    assert proc.stdout.splitlines()[-1] == str(out / "chunks" / "003"), proc.stdout

    proc = run_cli("bake", "--remove", str(out), "--chunk", "001")
    assert proc.returncode == 0, proc.stderr
    assert Router.load(out).ids == ("000", "002", "003") and not (out / "chunks" / "001").exists()
    assert _bytes(out / "chunks" / "000") == before["000"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--route", "--context", "{ctx}", "--method", "additive"], "give --method fit or"),
        (["--route", "--context", "{ctx}", "--queries", "{ctx}"], "(no --queries)"),
        # --route --chat: the document is the --system file, each chunk a system turn alone.
        (["--route", "--chat", "--system", "{ctx}", "--queries", "{ctx}"], "(no --queries)"),
        (["--route", "--chat", "--system", "{ctx}", "--context", "{ctx}"], "not --context"),
        (["--route", "--chat", "--system", "{ctx}", "--document", "{ctx}"], "not --document"),
        (["--route", "--chat", "--messages", "{ctx}"], "as --system FILE, not --messages"),
        (["--route", "--chat"], "--route --chat needs --system FILE"),
        (["--route", "--chat", "--system", "{empty}"], "system prompt file is empty"),
        (["--route", "--context", "{ctx}", "--system", "{ctx}"], "--system applies with --chat"),
        (["--add", "{routed}", "--context", "{ctx}", "--chat"], "not --chat turns"),
        (["--context", "{ctx}", "--chunk-words", "9"], "--chunk-words goes with --route"),
        (["--route", "--context", "{ctx}", "--chunk-words", "0"], "at least 1"),
        (["--route", "--context", "{empty}"], "context file"),
        (["--remove", "{routed}", "--chunk", "009"], "no chunk '009'"),
        (["--add", "{routed}", "--context", "{ctx}", "--chunk-words", "9"], "cannot change"),
        (["--add", "{routed}", "--context", "{ctx}", "--emit", "torch"], "carry the artefacts"),
        (["--context", "{ctx}", "--resume"], "--resume goes with --route"),
        (["--add", "{routed}", "--context", "{ctx}", "--workers", "2"], "--workers goes with"),
        (["--route", "--context", "{ctx}", "--workers", "0"], "--workers must be at least 1"),
        (["--route", "--context", "{ctx}", "--address", "auto"], "--address applies to --engine"),
        (["--route", "--context", "{ctx}", "--resume", "--force"], "--force are exclusive"),
    ],
)
def test_bad_route_input_is_one_line(tmp_path, args, message) -> None:
    ctx, empty, routed = tmp_path / "c.txt", tmp_path / "e.txt", tmp_path / "r"
    ctx.write_text("w1 w2 w3")
    empty.write_text("")
    routed.mkdir()
    Router(("000",), ("w1 w2",), {}).save(routed)
    filled = [a.format(ctx=ctx, empty=empty, routed=routed) for a in args]
    proc = run_cli("bake", "--model", "nowhere", *filled, "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_route_on_ray_without_ray_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` raises ImportError
    (tmp_path / "c.txt").write_text("w1 w2 w3")
    args = ["--route", "--context", str(tmp_path / "c.txt"), "--engine", "ray"]
    proc = run_cli("bake", "--model", "nowhere", *args, "--out", str(tmp_path / "o"))
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        ["ctxc: error: --engine ray needs ray: pip install 'ctxc[ray]'"],
    )


def test_route_of_a_folder_that_is_not_routed_is_one_line(tmp_path) -> None:
    proc = run_cli("route", str(tmp_path), "--query", "what?")
    assert proc.returncode == 2 and "is not a routed bake" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
