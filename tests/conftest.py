"""The suite's shared fixtures; the tiers and the threads per worker: tests/fixtures/tiers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.tiny_models import build, tiny_tokenizer

pytest_plugins = ["pytester", "tests.fixtures.tiers"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Gemma 3 with a tokenizer: a model folder the CLI can load."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model = build("gemma3")
    model.config.use_cache = True
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def warm_cache(tiny_model_dir, tmp_path_factory) -> Path:
    """A ``CTXC_CACHE`` holding ``tiny_model_dir``'s export, written once per worker: tests
    that start ``ctxc`` processes on that model point them here, and each loads the graph, as a
    user's second run does, instead of exporting it again (about 6 s a process). Processes may
    share it: the cache's writers are atomic (tests/store/test_export_cache.py)."""
    from tests.fixtures.helpers import run_cli

    cache, work = tmp_path_factory.mktemp("warm-cache"), tmp_path_factory.mktemp("warm-up")
    (work / "c.txt").write_text("w1 w2 w3 w4 w5 w6 w7 w8")
    args = ["compile", "--model", str(tiny_model_dir), "--context", "c.txt", "--out", "out"]
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CTXC_CACHE", str(cache))
        run = run_cli(*args, cwd=work)
    assert run.returncode == 0, run.stderr
    assert list((cache / "exports").glob("*.safetensors")), "the warm-up wrote no export entry"
    return cache


@pytest.fixture(scope="session")
def real_gemma():
    """The bundled Gemma 3 270M and its tokenizer, loaded once per worker (``slow`` tests only;
    ``ctxc.compile`` leaves the model as it was)."""
    import ctxc
    from ctxc.models.load import DEFAULT_MODEL

    return ctxc.load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory):
    """The README's quick start, ``ctxc compile --context examples/medium.txt --out DIR`` on
    the bundled model at the README's thread count, run once per worker: (the run, DIR).
    tests/project/test_readme.py reads its figures; tests/pipeline/test_real_gemma.py checks its
    ``model/`` in a fresh process."""
    import re

    import torch

    from tests.fixtures.helpers import run_cli

    root = Path(__file__).resolve().parents[1]
    threads = int(re.search(r"(\d+) CPU threads", (root / "README.md").read_text()).group(1))
    out = tmp_path_factory.mktemp("quick-start") / "out"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = run_cli(
            "compile", "--context", str(root / "examples" / "medium.txt"), "--out", str(out)
        )
    finally:
        torch.set_num_threads(before)
    return run, out
