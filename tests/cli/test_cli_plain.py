"""What the commands say, said plainly (issue 34): a runtime that cannot load in one short line
naming the cause and the fix, said once; the closing ``wrote`` line listing every file. Quick
tier: no model is built."""

from __future__ import annotations

from dataclasses import dataclass

# cffi's message on a glibc 2.36 system for the wheel's libllama (386 characters; measured).
GLIBC_ERROR = (
    "Failed to load llama.cpp library from /v/llama_cpp_py_sync/libllama.so: cannot load library "
    "'/v/llama_cpp_py_sync/libllama.so': /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.38' "
    "not found (required by /v/llama_cpp_py_sync/libllama.so).  Additionally, "
    "ctypes.util.find_library() did not manage to locate a library called "
    "'/v/llama_cpp_py_sync/libllama.so'"
)


def test_an_old_glibc_is_named_with_its_fix() -> None:
    from ctxc.backends.gguf.llama_cpp.run import SHIM, load_failure

    line = load_failure(GLIBC_ERROR, have="2.36")
    assert line == (
        f"llama.cpp's prebuilt library needs glibc >= 2.38 and this system has 2.36: run {SHIM} "
        "to shim it, or use a newer system"
    )
    assert "tools/llamacpp/install.sh" in SHIM and len(line) < 200, line


def test_another_load_error_is_its_first_clause_only() -> None:
    from ctxc.backends.gguf.llama_cpp.run import load_failure

    other = GLIBC_ERROR.replace("version `GLIBC_2.38' not found", "undefined symbol: x" * 20)
    line = load_failure(other)
    assert line.startswith("llama.cpp's library does not load: Failed to load"), line
    assert len(line) <= 200 and "Additionally" not in line, line


def test_the_shim_script_is_in_the_repository() -> None:
    """docs/backends.md, the README and .ci/run name tools/llamacpp/install.sh: it is here,
    with the two files it uses, and nothing names the path outside the repository."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("install.sh", "c23shim.c", "elf_weaken.py"):
        assert (root / "tools" / "llamacpp" / name).is_file(), name
    for doc in ("README.md", "docs/backends.md", ".ci/run", "pyproject.toml"):
        text = (root / doc).read_text()
        assert "tools/llamacpp/install.sh" in text, doc
        assert "../shared/" not in text, f"{doc} names a path outside the repository"


@dataclass
class _Figures:
    line: str
    llama_cpp_skipped: str | None = None

    def summary(self) -> str:
        return self.line


def test_a_shared_reason_is_said_once() -> None:
    from ctxc.cli.support import summaries

    why = "llama.cpp's prebuilt library needs glibc >= 2.38"
    lines = summaries(
        [
            _Figures("torch: fine"),
            _Figures(f"gguf: model.gguf ...; not run in llama.cpp: {why}", why),
            _Figures(f"gguf-lora: lora.gguf ...; not run in llama.cpp: {why}", why),
        ]
    )
    assert lines == [
        "torch: fine",
        f"gguf: model.gguf ...; not run in llama.cpp: {why}",
        "gguf-lora: lora.gguf ...; not run in llama.cpp: as above",
    ]


def test_wrote_line_lists_every_file_of_the_adapter() -> None:
    """``--emit ort-adapter`` writes its record and the 1 GB patchable.onnx beside the adapter:
    the closing line lists them (tests/cli/test_cli_checks.py holds the files written)."""
    from ctxc.cli.support import written

    assert written(["torch", "ort-adapter"]) == [
        "patch.safetensors",
        "report.json",
        "model/",
        "context.onnx_adapter",
        "context.onnx_adapter.json",
        "patchable.onnx",
    ]


def _pair(kl: float, top1: float, matched: float, answers=None) -> dict:
    return {"kl": kl, "top1": top1, "matched": matched, "gen_tokens": 16, "answers": answers}


def test_bake_summary_names_each_side_and_warns_when_the_patch_is_worse() -> None:
    """``free generation 3.5 vs 4.6`` said which was which nowhere (issue 34): each figure is
    the patch's beside ``(unpatched ...)``, and a worse patch gets a warning line."""
    from ctxc.bake import summary_lines as _summary

    lines = _summary(
        {
            "held_out_samples": {
                "patched": _pair(0.31, 0.625, 3.5),
                "control": _pair(1.02, 0.5, 4.6),
            },
            "held_out_questions": {
                "patched": _pair(0.2, 0.9, 9.0, answers=0.5),
                "control": _pair(0.8, 0.6, 2.0, answers=0.25),
            },
        }
    )
    assert lines == [
        "held_out_samples: KL 0.31 (unpatched 1.02), top-1 62.5% (unpatched 50.0%), free "
        "generation 3.5 tokens matched (unpatched 4.6)",
        "warning: held_out_samples: the patch did worse than no patch on free generation "
        "(3.5 < 4.6 tokens)",
        "held_out_questions: KL 0.2 (unpatched 0.8), top-1 90.0% (unpatched 60.0%), free "
        "generation 9.0 tokens matched (unpatched 2.0), answers 50% (unpatched 25%)",
    ]


def test_resume_rate_counts_only_the_lines_compiled(capsys) -> None:
    """Nine lines kept by ``--resume`` (no work) and one compiled in 0.2 s: the rate is at
    most 1 / 0.2 = 5 contexts/s (counting the kept lines it was 10 / 0.2 = 50); with only
    kept lines there is no rate to show."""
    import re
    import time

    from ctxc.cli.batch import batch_progress
    from ctxc.cli.progress import command_trail

    with command_trail(), batch_progress() as bar:
        task = bar.add_task("contexts", total=10)
        bar.update(task, advance=9, kept=True)
        time.sleep(0.2)
        bar.update(task, advance=1)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"ctxc: contexts 9/10 \(\d+\.\d s\)", lines[1]), lines
    rate = float(re.fullmatch(r"ctxc: contexts 10/10, ([0-9.]+) contexts/s .*", lines[2])[1])
    assert 0 < rate <= 5.0, lines


def test_ray_token_notice_is_dropped_and_its_security_warning_kept(caplog) -> None:
    """Ray's 'Token authentication is enabled' notice is dropped; its warning that
    authentication is disabled still shows (no ray import needed: the logger's name)."""
    import logging

    from ctxc.batch.ray_engine import quiet_ray_notices

    quiet_ray_notices()
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Token authentication is enabled for this Ray cluster. Set X to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone ...")
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "Token authentication is disabled for thi"
    ]
