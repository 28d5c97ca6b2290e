"""One llama.cpp model serving several ``lora.gguf`` adapters, switched per request (issue 23,
check 3): each request gives its own context's logits, the same as a run on a context of its
own, on one shared context (``llama_set_adapters_lora`` per switch) and on fresh ones. Skipped,
with the reason, where llama.cpp's library cannot load.
"""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.backends.gguf.llama_cpp.run import (
    llama_cpp_logits,
    llama_cpp_switching,
    llama_cpp_unavailable,
)
from ctxc.backends.gguf.lora import write_gguf_lora
from ctxc.backends.gguf.write import write_gguf
from ctxc.core.errors import CtxcError
from testbed.tiny_models import bpe_tokenizer, shared
from tests.fixtures.helpers import diff_msg, max_diff, random_ids

pytestmark = pytest.mark.tiny

_REASON = llama_cpp_unavailable()
needs_llama_cpp = pytest.mark.skipif(_REASON is not None, reason=f"llama.cpp: {_REASON}")

_QUERY = random_ids(40, 3)  # the same query for every context: only the adapter tells them apart


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama's F32 base GGUF, three contexts' ``lora.gguf`` and their ids."""
    tmp = tmp_path_factory.mktemp("switching")
    model = shared("llama")
    base = tmp / "base.gguf"
    write_gguf(model, bpe_tokenizer(), base)
    adapters, contexts = [], []
    for seed in (41, 42, 43):
        context = random_ids(seed, 16)
        patch = ctxc.compile(model, context_ids=context, query_ids=_QUERY, update="lora").patch
        path = tmp / f"lora{seed}.gguf"
        write_gguf_lora(model, patch, path)
        adapters.append(path)
        contexts.append(context)
    return base, adapters, contexts


def _fulls(base, contexts) -> list[torch.Tensor]:
    """llama.cpp's own full-context runs on the base."""
    jobs = [{"model": base, "lora": None, "ids": c + _QUERY, "k": len(_QUERY)} for c in contexts]
    return llama_cpp_logits(jobs, "base.gguf", threads=1)


@needs_llama_cpp
@pytest.mark.parametrize("fresh", [False, True], ids=["one-context", "fresh-contexts"])
def test_switched_adapters_give_each_its_own_context(served, fresh) -> None:
    base, adapters, contexts = served
    order = [0, 1, 1, None, 2, 0, 2]
    requests = [(a, _QUERY, len(_QUERY)) for a in order]
    run = llama_cpp_switching(base, adapters, requests, fresh=fresh, threads=1)
    # Each adapter alone on a fresh context (the existing per-artefact path): the reference.
    alone = llama_cpp_logits(
        [{"model": base, "lora": str(a), "ids": _QUERY, "k": len(_QUERY)} for a in adapters]
        + [{"model": base, "lora": None, "ids": _QUERY, "k": len(_QUERY)}],
        "lora.gguf",
        threads=1,
    )
    fulls = _fulls(base, contexts)
    for i, a in enumerate(order):
        got = run.logits[i]
        want = alone[-1] if a is None else alone[a]
        assert max_diff(got, want) <= 1e-4, diff_msg(f"request {i} (adapter {a})", got, want)
        if a is None:
            continue
        own = max_diff(got, fulls[a])
        others = [max_diff(got, f) for j, f in enumerate(fulls) if j != a]
        assert own <= 1e-3, diff_msg(f"request {i}, own context", got, fulls[a])
        assert min(others) > 100 * max(own, 1e-6), f"request {i}: own {own:.3g}, others {others}"
    assert len(run.load_s) == len(adapters) and all(t > 0 for t in run.load_s), run.load_s
    # One context: set where the adapter changes; fresh contexts: wherever there is one.
    want_switched = (
        [a is not None for a in order]
        if fresh
        else [a != b for a, b in zip(order, [None, *order[:-1]], strict=True)]
    )
    assert list(run.switched) == want_switched, run.switched
    assert all((s > 0) == w for s, w in zip(run.set_s, want_switched, strict=True)), run.set_s
    assert run.fresh is fresh and len(run.decode_s) == len(order)


@needs_llama_cpp
def test_a_bad_adapter_index_is_an_error(served) -> None:
    base, adapters, _ = served
    with pytest.raises(CtxcError, match="request names adapter 5; 3 are loaded"):
        llama_cpp_switching(base, adapters, [(5, _QUERY, 1)], threads=1)


@needs_llama_cpp
def test_an_adapter_llama_cpp_cannot_load_is_an_error(served, tmp_path) -> None:
    base, adapters, _ = served
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(CtxcError, match=r"lora\.gguf: llama\.cpp could not run it: .*bad\.gguf"):
        llama_cpp_switching(base, [adapters[0], bad], [(0, _QUERY, 1)], threads=1)
