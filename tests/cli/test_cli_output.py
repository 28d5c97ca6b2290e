"""Output folders and what the CLI writes (issue 15, items 1, 5-7, 9, 10).

In process (`ctxc.cli.app.main`), but for the read-only folder's refusal: that one runs in a
child process that obeys the folders' modes, as root too (CI runs as root). Every refusal
asserts the exact first line, exit 2, and that nothing was lost or left behind: the current
folder's files, no output and no staging folder.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ctxc.cli.app import main
from tests.fixtures.helpers import without_trail

pytestmark = pytest.mark.tiny

CONTEXT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(folder.rglob("*"))
    }


def _no_staging(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*.partial-*")]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A working folder with a user's files in it, and a private ctxc cache."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "context.txt").write_text(CONTEXT)
    (work / "notes.md").write_text("mine")
    monkeypatch.chdir(work)
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    return work


@pytest.fixture
def warm_private_cache(cwd, warm_cache) -> None:
    """``cwd``'s private cache given the tiny model's export entry (``warm_cache``'s): a compile
    there loads the graph, as a user's second run does, instead of tracing the model again."""
    shutil.copytree(warm_cache / "exports", Path(os.environ["CTXC_CACHE"]) / "exports")


@pytest.fixture(scope="module")
def compiled(tiny_model_dir, tmp_path_factory) -> Path:
    """One compile output for the tests that read or reuse it."""
    base = tmp_path_factory.mktemp("compiled")
    (base / "context.txt").write_text(CONTEXT)
    out = base / "out"
    args = ["compile", "--model", str(tiny_model_dir), "--context", str(base / "context.txt")]
    assert main([*args, "--out", str(out)]) == 0
    return out


def _compile(model_dir, *extra: str) -> list[str]:
    return ["compile", "--model", str(model_dir), "--context", "context.txt", *extra]


REFUSALS = {
    ".": "ctxc: error: --out . is the current folder: name a new folder for the output",
    "..": "ctxc: error: --out .. holds the current folder: name a new folder for the output",
    "{cache}/out": "ctxc: error: --out {cache}/out overlaps the ctxc cache {cache}: "
    "name another folder",
}


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("target", sorted(REFUSALS))
def test_out_that_would_lose_files_is_refused(target, force, cwd, tiny_model_dir, capsys):
    cache = os.environ["CTXC_CACHE"]
    target = target.format(cache=cache)
    before = _snapshot(cwd.parent)
    args = _compile(tiny_model_dir, "--out", target, *(["--force"] if force else []))
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        REFUSALS[target.replace(cache, "{cache}")].format(cache=cache)
    ]
    assert _snapshot(cwd.parent) == before


def test_folder_with_other_files_is_refused_even_with_force(cwd, tiny_model_dir, capsys):
    out = cwd / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--force"]):
        assert main(_compile(tiny_model_dir, "--out", "out", *extra)) == 2
        assert capsys.readouterr().err.splitlines() == [
            "ctxc: error: output folder out holds files ctxc did not write ('keep.txt'): "
            "name another folder (--force replaces only an earlier ctxc output)"
        ]
    assert _snapshot(out) == {"keep.txt": b"mine"}
    assert not _no_staging(cwd)


@pytest.mark.usefixtures("warm_private_cache")
def test_earlier_output_needs_force_and_force_replaces_it(cwd, tiny_model_dir, capsys):
    assert main(_compile(tiny_model_dir, "--out", "out")) == 0
    first = _snapshot(cwd / "out")
    assert sorted(p.name for p in (cwd / "out").iterdir()) == [
        ".ctxc",
        "model",
        "patch.safetensors",
        "report.json",
    ]
    capsys.readouterr()
    assert main(_compile(tiny_model_dir, "--out", "out")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ctxc: error: output folder out holds an earlier ctxc output (--force replaces it)"
    ]
    assert _snapshot(cwd / "out") == first
    assert main(_compile(tiny_model_dir, "--out", "out", "--force")) == 0
    second = _snapshot(cwd / "out")
    # Identical inputs give byte-identical patches (sorted safetensors metadata).
    assert second["patch.safetensors"] == first["patch.safetensors"]
    assert sorted(p.name for p in cwd.iterdir()) == ["context.txt", "notes.md", "out"]


def test_unwritable_out_fails_before_loading_the_model(cwd, capsys):
    # /sys refuses new entries even to root; the unknown model shows the model was not loaded.
    args = ["compile", "--model", "no-such-model", "--context", "context.txt"]
    assert main([*args, "--out", "/sys/ctxc-out"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ctxc: error: cannot write the output folder /sys/ctxc-out: Operation not permitted"
    ]
    assert not Path("/sys/ctxc-out").exists()


def _unprivileged(argv: list[str]) -> tuple[int, list[str]]:
    """``ctxc argv`` in a child process that obeys the folders' modes: root may write anywhere
    (``os.access`` grants it every folder), so as root the child runs under util-linux's
    ``setpriv`` without the capabilities that override them (its files stay root's own and
    readable: the interpreter and the installed package load as ever). The exit status and
    stderr's lines."""
    drop = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "as root this test needs util-linux's setpriv to drop CAP_DAC_OVERRIDE"
        drop = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    run = "import sys; from ctxc.cli.app import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [*drop, sys.executable, "-c", run, *argv], capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stderr.splitlines()


def test_read_only_out_is_refused(cwd):
    out = cwd / "out"
    out.mkdir()
    out.chmod(0o555)
    before = _snapshot(cwd)
    try:
        code, lines = _unprivileged(["compile", "--context", "context.txt", "--out", "out"])
    finally:
        out.chmod(0o755)
    assert (code, lines) == (2, ["ctxc: error: output folder out is not writable"])
    assert _snapshot(cwd) == before and not _no_staging(cwd.parent)


def test_missing_parents_are_not_left_behind(cwd, capsys):
    args = ["compile", "--model", "no-such-model", "--context", "context.txt"]
    assert main([*args, "--out", "a/b/out"]) == 2
    assert without_trail(capsys.readouterr().err).startswith("ctxc: error: unknown model")
    assert sorted(p.name for p in cwd.iterdir()) == ["context.txt", "notes.md"]


def test_modes_follow_the_umask(compiled):
    # The module fixture ran under the test's umask: every entry gets 0o666/0o777 minus it,
    # but the unpatched weights' shard, linked from the cache: read-only (frozen_shards.py).
    umask = os.umask(0)
    os.umask(umask)
    modes = {
        str(p.relative_to(compiled)): stat.S_IMODE(p.stat().st_mode)
        for p in [compiled, *compiled.rglob("*")]
    }
    linked = {k for k in modes if (compiled / k).is_file() and (compiled / k).stat().st_nlink > 1}
    assert linked == {"model/model-00001-of-00002.safetensors"}, linked
    want = {
        k: (0o777 if (compiled / k).is_dir() else 0o444 if k in linked else 0o666) & ~umask
        for k in modes
    }
    assert modes == want


def test_emitted_figure_is_the_reloaded_folder(compiled, tiny_model_dir):
    report = json.loads((compiled / "report.json").read_text())
    assert report["emitted_measured_on"] == (
        "model/ reloaded with AutoModelForCausalLM.from_pretrained"
    )
    full_ids = torch.tensor([report["context_ids"] + report["query_ids"]])
    query = torch.tensor([report["query_ids"]])
    model = AutoModelForCausalLM.from_pretrained(str(compiled / "model"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        full = base(full_ids).logits[0, -1:].double()
        got = model(query).logits[0, -1:].double()
    measured = float((got - full).abs().max())
    # The report's reference is the compile's traced full run; eager differs by rounding only.
    assert report["max_abs_logit_diff"] == report["emitted"]["max_abs_logit_diff"]
    assert abs(report["max_abs_logit_diff"] - measured) <= 1e-6, (report["emitted"], measured)
    for key in ("solver", "control"):
        assert "max_abs_logit_diff" in report[key], key
    # model/ reloaded measures the patched weights: no second, in-memory run (issue 11)
    assert "in_memory" not in report and "verify" not in report["timings"], report["timings"]


def test_context_past_the_model_positions_is_refused(cwd, tiny_model_dir, capsys):
    # The tiny model takes 256 positions; BOS + 300 words is 301 tokens.
    (cwd / "long.txt").write_text(" ".join(f"w{i % 100}" for i in range(300)))
    args = ["compile", "--model", str(tiny_model_dir), "--context", "long.txt", "--out", "out"]
    assert main(args) == 2
    assert without_trail(capsys.readouterr().err).splitlines() == [
        "ctxc: error: context + query is 301 tokens; the model takes at most 256 positions "
        "(max_position_embeddings)"
    ]
    assert sorted(p.name for p in cwd.iterdir()) == ["context.txt", "long.txt", "notes.md"]


def test_corrupted_patch_is_refused_on_export(compiled, cwd, tiny_model_dir, capsys):
    meta = _metadata(compiled / "patch.safetensors")
    tensors = load_file(str(compiled / "patch.safetensors"))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    bad = cwd / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    args = ["export", "--patch", str(bad), "--model", str(tiny_model_dir), "--to", "torch"]
    assert main([*args, "--out", "exported"]) == 2
    n = int(tensors[name][0].numel())
    assert capsys.readouterr().err.splitlines() == [
        f"ctxc: error: patch {bad}: tensor {name!r} has {n} non-finite value(s) (NaN or Inf)"
    ]
    assert not (cwd / "exported").exists() and not _no_staging(cwd)


def test_export_takes_a_compile_folder_as_patch(compiled, cwd, tiny_model_dir, capsys):
    args = ["export", "--patch", str(compiled), "--model", str(tiny_model_dir), "--to", "torch"]
    assert main([*args, "--out", "exported"]) == 0
    assert (cwd / "exported" / "config.json").is_file()
    report = json.loads((cwd / "exported" / "report.json").read_text())
    assert report["torch"]["emitted"]["max_abs_logit_diff"] <= 1e-5, report["torch"]
    capsys.readouterr()
    (cwd / "empty").mkdir()
    assert main(["export", "--patch", "empty", "--to", "torch", "--out", "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ctxc: error: patch folder empty holds no patch.safetensors"
    ]


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def test_staging_of_a_killed_run_is_removed(cwd, capsys):
    dead = cwd / ".out.partial-999999999-abcd"
    live = cwd / f".out.partial-{os.getpid()}-abcd"
    dead.mkdir()
    live.mkdir()
    args = ["compile", "--model", "no-such-model", "--context", "context.txt", "--out", "out"]
    assert main(args) == 2
    assert without_trail(capsys.readouterr().err).startswith("ctxc: error: unknown model")
    assert not dead.exists() and live.exists()


@pytest.mark.usefixtures("warm_private_cache")
def test_a_full_disk_is_one_line_exit_2_and_nothing_kept(cwd, tiny_model_dir, capsys, monkeypatch):
    """The machine refusing a write (disk full) is the user's to fix, not a bug: one line naming
    the cause and the path, exit 2, no output folder, no staging folder, the user's files kept."""
    import errno

    from ctxc.patch import Patch

    before = _snapshot(cwd)

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Patch, "save", full)
    rc = main([*_compile(tiny_model_dir), "--out", "out"])
    lines = without_trail(capsys.readouterr().err).strip().splitlines()
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("ctxc: error: no space left on the device"), (
        lines
    )
    assert "patch.safetensors" in lines[0], lines
    assert not (cwd / "out").exists() and not _no_staging(cwd), sorted(os.listdir(cwd))
    assert _snapshot(cwd) == before


@pytest.mark.usefixtures("warm_private_cache")
def test_a_full_disk_while_writing_model_keeps_the_patch(cwd, tiny_model_dir, capsys, monkeypatch):
    """The disk full while model/ is written, by a write that names no file (a shard's pwrite,
    as measured on a full tmpfs): the message names the artefact's path under --out, and the
    patch, already written whole, is kept alone in out.failed/ for ctxc export (issue 34)."""
    import errno

    import ctxc.backends.torch.check as torch_check
    from ctxc.patch import Patch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch_check, "emit_torch_checked", full)
    rc = main([*_compile(tiny_model_dir), "--out", "out"])
    lines = without_trail(capsys.readouterr().err).strip().splitlines()
    assert (rc, lines) == (
        2,
        [
            "ctxc: error: no space left on the device writing out/model/; the patch is kept in "
            "out.failed/ (ctxc export --patch out.failed writes the artefacts once there is room)"
        ],
    )
    assert not (cwd / "out").exists() and not _no_staging(cwd), sorted(os.listdir(cwd))
    assert sorted(p.name for p in (cwd / "out.failed").iterdir()) == [".ctxc", "patch.safetensors"]
    assert Patch.load(cwd / "out.failed").deltas, "the kept patch does not load"


def test_environment_errors_are_found_through_the_cause_chain():
    import errno

    from ctxc.core.errors import environment_error

    inner = OSError(errno.EROFS, "Read-only file system", "/ro/x")
    try:
        try:
            raise inner
        except OSError as exc:
            raise RuntimeError("while writing") from exc
    except RuntimeError as outer:
        found = environment_error(outer)
    assert found is not None and str(found).startswith("read-only file system writing /ro/x")
    assert environment_error(OSError(errno.ENOENT, "No such file", "/x")) is None
    assert environment_error(ValueError("no")) is None
