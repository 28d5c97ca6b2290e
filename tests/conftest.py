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
def real_gemma():
    """The bundled Gemma 3 270M and its tokenizer, loaded once per worker (``slow`` tests only;
    ``ctxc.compile`` leaves the model as it was)."""
    import ctxc
    from ctxc.models.load import DEFAULT_MODEL

    return ctxc.load_model(DEFAULT_MODEL)
