"""A routed bake's chunks as the lines of a batch run (issue 55): baked side by side by worker
processes with the patches of one process, byte for byte; an interrupt keeps every finished
chunk whole and leaves no partial folder; ``resume`` bakes only the missing chunks and writes
the router; a resume with other options or texts is one line before any model loads.

The thread count decides how torch rounds its parallel sums, so every run here computes at one
thread: the run in this process at torch's one thread, each of two workers at its share of it
(one). The runs on a local Ray are not in the suite (starting Ray takes most of a minute, as
for ``compile --contexts``: tests/cli/test_cli_ray.py); ``python -m
benchmarks.cost.routed_batch`` runs them.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch

from ctxc.bake import BakeHooks, BakeJob, BakeOptions, HeldOut, bake_routed
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

_DOC = "w1 w2 w3 w4 w5 w6\n\nw13 w14 w15 w16 w17\n\n\nw30 w31 w32 w33\n\nw40 w41 w42 w43 w44"
_WORDS = 6  # four chunks, one paragraph each
_IDS = ["000", "001", "002", "003"]
_OPTIONS = BakeOptions(
    rank=8, samples=2, sample_tokens=4, data="continuations", cloze=0, linear_only=True
)
_HELD = HeldOut(samples=0, off_topic=0)
# The same bake on the command line.
_FIT = ["--rank", "8", "--samples", "2", "--sample-tokens", "4", "--data", "continuations",
        "--cloze", "0", "--linear-only", "--eval-samples", "0", "--eval-off-topic", "0",
        "--route", "--chunk-words", str(_WORDS)]  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread(warm_cache, monkeypatch):
    """Torch at one thread (and so each worker), the tiny model's export in the cache."""
    monkeypatch.setenv("CTXC_CACHE", str(warm_cache))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _job(model: Path, out: Path, doc: str = _DOC) -> BakeJob:
    chunks = (("doc.txt", doc),)
    return BakeJob(out, chunks=chunks, options=_OPTIONS, held=_HELD, emit=(), model=str(model))


def _digests(out: Path) -> dict[str, str]:
    """sha256 of each chunk's patch.safetensors, by chunk id."""
    return {
        p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((out / "chunks").glob("*/patch.safetensors"))
    }


def _report(folder: Path) -> dict:
    """A chunk's report.json without its wall times."""
    report = json.loads((folder / "report.json").read_text())
    report.pop("timings")
    return report


def _partial(out: Path) -> list[str]:
    """Staging folders left anywhere under ``out``."""
    return [str(p.relative_to(out)) for p in out.rglob("*") if ".partial-" in p.name]


def _interrupt_after(first: int, seen: list):
    """``on_chunks``: record each progress; KeyboardInterrupt once ``first`` chunks are baked."""

    def on_chunks(progress) -> None:
        seen.append(progress)
        if progress.baked and progress.done - progress.kept >= first:
            raise KeyboardInterrupt

    return on_chunks


@pytest.fixture(scope="module")
def whole(tiny_model_dir, warm_cache, tmp_path_factory) -> Path:
    """An uninterrupted routed bake in this process (``workers=1``), at one thread."""
    out = tmp_path_factory.mktemp("whole") / "out"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("CTXC_CACHE", str(warm_cache))
            run = bake_routed(_job(tiny_model_dir, out), _WORDS, workers=1)
    finally:
        torch.set_num_threads(before)
    assert run.report["chunk_ids"] == _IDS, run.report["chunk_ids"]
    return out


def test_two_workers_bake_the_patches_of_one_process(whole, tiny_model_dir, tmp_path) -> None:
    seen: list = []
    out = tmp_path / "out"
    run = bake_routed(
        _job(tiny_model_dir, out), _WORDS, BakeHooks(on_chunks=seen.append), workers=2
    )
    assert _digests(out) == _digests(whole), "two workers' patches differ from one process's"
    assert (out / "router.json").read_bytes() == (whole / "router.json").read_bytes()
    for cid in _IDS:
        got, want = (_report(d / "chunks" / cid) for d in (out, whole))
        assert got == want, cid
    assert sorted(run.report["chunks"]) == _IDS and len(run.lines) == 4
    assert [p.done for p in seen] == [1, 2, 3, 4] and all(p.baked for p in seen), seen
    assert seen[-1].left_s == 0 and seen[0].left_s is not None
    assert not multiprocessing.active_children(), "a worker process outlived the run"


def test_an_interrupt_keeps_finished_chunks_and_resume_bakes_the_rest(
    whole, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    """In this process: interrupted after one chunk, resumed by the command; each chunk baked
    once (the fit counted), the kept chunk's files untouched."""
    import ctxc.bake.driver as driver

    baked: list[str] = []
    real = driver.bake

    def counted(net, tokenizer, context, *args, **kwargs):
        baked.append(context)
        return real(net, tokenizer, context, *args, **kwargs)

    monkeypatch.setattr(driver, "bake", counted)
    out, seen = tmp_path / "out", []
    stop = BakeHooks(on_chunks=_interrupt_after(1, seen))
    with pytest.raises(KeyboardInterrupt):
        bake_routed(_job(tiny_model_dir, out), _WORDS, stop, workers=1)
    assert sorted(p.name for p in (out / "chunks").iterdir()) == ["000"]
    assert not _partial(out) and not (out / "router.json").exists()
    assert _digests(out) == {"000": _digests(whole)["000"]}
    assert len(baked) == 1
    kept = (out / "chunks" / "000" / "patch.safetensors").stat()
    proc = run_cli("route", str(out), "--query", "w14")  # not a routed bake until it ends
    assert proc.returncode == 2 and "not finished" in proc.stderr, proc.stderr

    (tmp_path / "doc.txt").write_text(_DOC)
    args = ["bake", "--model", str(tiny_model_dir), *_FIT, "--context", "doc.txt", "--out", "out"]
    proc = run_cli(*args, "--resume", "--workers", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(baked) == 4 and sorted(baked) == sorted(set(baked)), "a chunk was baked twice"
    assert _digests(out) == _digests(whole)
    assert (out / "router.json").read_bytes() == (whole / "router.json").read_bytes()
    again = (out / "chunks" / "000" / "patch.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    progress = [line for line in proc.trail if line.startswith("ctxc: chunks ")]
    assert [line.split(":")[1] for line in progress] == [
        " chunks 2/4 baked, 1 kept",
        " chunks 3/4 baked, 1 kept",
        " chunks 4/4 baked, 1 kept",
    ], proc.trail
    assert not _partial(out)


def test_workers_interrupted_keep_whole_chunks_and_resume(whole, tiny_model_dir, tmp_path) -> None:
    """Two workers, interrupted once a chunk is baked: the workers end, the chunk in flight
    leaves nothing, the finished ones stay whole; the resume (here, in this process) keeps them
    and ends with the uninterrupted run's patches."""
    out, seen = tmp_path / "out", []
    stop = BakeHooks(on_chunks=_interrupt_after(1, seen))
    with pytest.raises(KeyboardInterrupt):
        bake_routed(_job(tiny_model_dir, out), _WORDS, stop, workers=2)
    assert not multiprocessing.active_children(), "a worker process outlived the interrupt"
    assert not _partial(out) and not (out / "router.json").exists()
    kept = _digests(out)
    assert 1 <= len(kept) < 4 and all(kept[c] == _digests(whole)[c] for c in kept), kept
    stats = {c: (out / "chunks" / c / "patch.safetensors").stat().st_mtime_ns for c in kept}
    seen.clear()
    hooks = BakeHooks(on_chunks=seen.append)
    bake_routed(_job(tiny_model_dir, out), _WORDS, hooks, workers=1, resume=True)
    assert _digests(out) == _digests(whole)
    assert seen[-1].kept == len(kept) and sum(p.baked for p in seen) == 4 - len(kept), seen
    assert {c: (out / "chunks" / c / "patch.safetensors").stat().st_mtime_ns for c in kept} == stats


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--rank", "4"], "(rank 8, now 4)"),
        (["--doc", "w1 w2 w3\n\nw9 w10"], "(documents_sha256 "),
        (["--eval-samples", "2"], "(eval_samples 0, now 2)"),
    ],
)
def test_a_resume_with_other_options_or_texts_is_one_line(
    whole, tiny_model_dir, tmp_path, monkeypatch, change, message
) -> None:
    import ctxc.cli.bake as cli_bake

    def no_load(*_args):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(cli_bake, "load", no_load)
    shutil.copytree(whole, tmp_path / "out")
    doc = change[1] if change[0] == "--doc" else _DOC
    (tmp_path / "doc.txt").write_text(doc)
    extra = [] if change[0] == "--doc" else change
    args = ["bake", "--model", str(tiny_model_dir), *_FIT, *extra, "--context", "doc.txt"]
    proc = run_cli(*args, "--out", "out", "--resume", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "ctxc: error: --resume: output folder out was baked with other options "
    ), lines
    assert message in lines[0] and lines[0].endswith(
        "give the same options, or --force to start afresh"
    ), lines
    assert _digests(tmp_path / "out") == _digests(whole)
