"""Servable thought patches (issue 36): a ``linear_only`` bake at a vLLM rank, emitted as
``lora``, ``gguf-lora`` and ``ort-adapter`` through ``emit_checked`` (the code ``ctxc compile
--emit`` runs), each served result compared with ctxc's patched model within its runtime's
floor, far below the patch's own effect (an adapter that changed nothing would fail). The LoRA
bake runs as ``ctxc bake --model tiny.gguf`` does, and its adapter is loaded as its card says,
offline (issue 54)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from ctxc.backends import emit_checked
from ctxc.backends.gguf.llama_cpp.run import llama_cpp_logits, llama_cpp_unavailable
from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.serve import check_servable
from ctxc.core.errors import CtxcError
from testbed.tiny_models import bpe_tokenizer, shared, tiny_tokenizer
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import logits, random_ids


def _baked(family: str, rank: int, method: str = "fit"):
    model = shared(family)
    prefix = special_prefix(tiny_tokenizer())
    data = FitData(
        [*prefix, *random_ids(5, 16)], prefix, [random_ids(40 + i, 6) for i in range(4)],
        ["file"] * 4,
    )  # fmt: skip
    opts = BakeOptions(rank=rank, linear_only=True, method=method)
    return model, bake(model, data=data, options=opts).patch


@pytest.mark.tiny
def test_a_model_without_post_norms_bakes_into_lora_by_default_and_gemma_is_refused() -> None:
    """Asked for a LoRA artefact, a default bake (no ``linear_only``) of a model whose blocks
    have no post norm (Llama) is linear pairs of one rank; Gemma's sandwich norms would move
    norm scales: refused after the blocks are located, before the fit, naming a block."""
    prefix = special_prefix(tiny_tokenizer())
    data = FitData(
        [*prefix, *random_ids(5, 16)], prefix, [random_ids(40 + i, 6) for i in range(4)],
        ["file"] * 4,
    )  # fmt: skip
    opts = BakeOptions(rank=16)
    patch = bake(shared("llama"), data=data, options=opts, emit=("lora",)).patch
    assert patch.deltas and all(d.vector is None for d in patch.deltas.values()), patch.deltas
    ranks = {d.rank for d in patch.deltas.values()}
    assert ranks == {16}, f"ranks {sorted(ranks)}, wanted 16 (padded)"
    with pytest.raises(CtxcError, match=r"moves norm scales \(model\.layers\.0\.mlp's output"):
        bake(shared("gemma3"), data=data, options=opts, emit=("gguf-lora",))
    moved = bake(shared("gemma3"), data=data, options=opts).patch  # without a LoRA kind: as before
    assert any(d.vector is not None for d in moved.deltas.values())


@pytest.mark.tiny
@needs_extra("peft")
def test_a_distilled_bake_is_servable_and_from_the_fit_it_is_refused_on_gemma() -> None:
    """``--method distill`` from scratch trains LoRA pairs on linears alone (issue 54): on Gemma,
    whose fit moves norm scales, it goes into a LoRA kind at one rank, every delta a pair; from
    the fit it keeps the fit's norm-scale moves: refused before the fit, as the fit is."""
    prefix = special_prefix(tiny_tokenizer())
    data = FitData(
        [*prefix, *random_ids(5, 16)], prefix, [random_ids(40 + i, 6) for i in range(4)],
        ["file"] * 4,
    )  # fmt: skip
    opts = BakeOptions(rank=16, method="distill", distill_steps=2)
    patch = bake(shared("gemma3"), data=data, options=opts, emit=("lora",)).patch
    assert patch.deltas and all(d.vector is None for d in patch.deltas.values()), patch.deltas
    ranks = {d.rank for d in patch.deltas.values()}
    assert ranks == {16}, f"ranks {sorted(ranks)}, wanted 16"
    from_fit = dataclasses.replace(opts, distill_from_fit=True)
    with pytest.raises(CtxcError, match=r"moves norm scales"):
        bake(shared("gemma3"), data=data, options=from_fit, emit=("lora",))


@pytest.mark.tiny
@pytest.mark.parametrize("rank", [16, 64])
def test_linear_only_patch_has_one_rank_and_no_norm(rank: int) -> None:
    _, patch = _baked("gemma3", rank)
    assert all(d.vector is None and d.u is not None for d in patch.deltas.values())
    ranks = {d.rank for d in patch.deltas.values()}
    assert ranks == {rank}, f"ranks {sorted(ranks)}, wanted {rank}"
    assert any(name.endswith("o_proj.weight") for name in patch.deltas)  # attention moved


def _served(tmp_path, kinds: list[str]):
    """A linear-only llama bake at rank 16, its artefacts of ``kinds`` emitted and checked; the
    torch patched logits on its query and the patch's own effect (max |patched - unpatched|)."""
    model, patch = _baked("llama", 16)
    query = list(patch.meta.query_ids)
    patched = logits(model, query, patch).float()
    effect = float((patched - logits(model, query).float()).abs().max())
    assert effect > 1e-2, f"the patch moves the logits by {effect:.3g} only: cannot fail"
    figures = emit_checked(model, patch, tmp_path, kinds, tokenizer=bpe_tokenizer())
    assert list(figures) == kinds
    return model, query, patched, effect, figures


class _GgufBake(NamedTuple):
    gguf: Path  # the tiny Llama as an F32 GGUF file, the bake's --model
    out: Path  # the bake folder
    report: dict  # its report.json
    model: torch.nn.Module  # the model loaded from the GGUF (unpatched)
    query: list[int]  # the patch's query (the first fit query)
    patched: torch.Tensor  # the torch patched model's logits on it
    effect: float  # max |patched - unpatched|


@pytest.fixture(scope="module")
def gguf_bake(tmp_path_factory) -> Iterator[_GgufBake]:
    """``ctxc bake --model tiny.gguf --linear-only --rank 16 --emit lora,gguf-lora`` as the
    library runs it (``bake_into``): the tiny Llama written as an F32 GGUF file, baked from it in
    a cache of its own."""
    import ctxc
    from ctxc.backends.gguf.write import write_gguf
    from ctxc.bake import BakeJob, HeldOut, bake_into
    from ctxc.patch import Patch

    tmp = tmp_path_factory.mktemp("gguf-bake")
    gguf = tmp / "base" / "tiny.gguf"
    gguf.parent.mkdir()
    write_gguf(shared("llama"), bpe_tokenizer(), gguf, "F32")
    opts = BakeOptions(
        rank=16, linear_only=True, data="continuations", samples=4, sample_tokens=6, cloze=0
    )
    held = HeldOut(samples=2, off_topic=0)  # the BPE tokenizer has no BOS to write off-topic from
    emit = ("lora", "gguf-lora")
    job = BakeJob(tmp / "b", "w1 w2 w3 w4 w5 w6 w7 w8 w9", options=opts, held=held, emit=emit)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CTXC_CACHE", str(tmp / "cache"))
        report = bake_into(dataclasses.replace(job, model=str(gguf))).report
        model, _ = ctxc.load_model(str(gguf))
        patch = Patch.load(job.out)
        query = list(patch.meta.query_ids)
        patched = logits(model, query, patch).float()
        effect = float((patched - logits(model, query).float()).abs().max())
        assert effect > 1e-2, f"the patch moves the logits by {effect:.3g} only: cannot fail"
        yield _GgufBake(gguf, job.out, report, model, query, patched, effect)


@pytest.mark.tiny
@needs_extra("peft")
def test_served_lora_reproduces_the_patched_model(gguf_bake) -> None:
    b = gguf_bake
    lora = b.report["artefacts"]["lora"]  # PEFT reload of lora/ (vLLM's rules checked too)
    assert lora["vllm"]["r"] == 16 and not lora["peft"]["modules_to_save"], lora
    as_loaded = lora["peft"]["vs_patched"]["as_loaded"]["max_abs_logit_diff"]
    assert as_loaded <= 1e-4 * max(1.0, float(b.patched.abs().max())), lora
    assert as_loaded < 1e-3 * b.effect, f"PEFT {as_loaded:.3g} vs {b.effect:.3g}"
    gguf = b.report["artefacts"]["gguf-lora"]
    assert gguf["applied_vs_patched"] < 1e-3 * b.effect, gguf
    if llama_cpp_unavailable() is None:
        assert gguf["llama_cpp"] is not None, gguf["llama_cpp_skipped"]
        _llama_cpp_vs_patched(b.model, b.gguf, b.out / "lora.gguf", b.query, b.patched, b.effect)


@pytest.mark.tiny
@needs_extra("peft")
def test_baked_lora_says_what_it_is_and_loads_offline(gguf_bake, monkeypatch) -> None:
    """The bake's ``lora/`` card says fitted, not exact, with the bake's figures and the GGUF
    file's SHA-256; report.json gives each figure under what it compares, with its bound; the
    card's one line (``AutoPeftModelForCausalLM`` with ``gguf_file=``) loads the adapter with the
    hub offline and every connection refused, and gives ctxc's patched logits."""
    import socket

    import huggingface_hub.constants
    import peft

    b = gguf_bake
    card = (b.out / "lora" / "README.md").read_text()
    assert "**fitted**" in card and "**not exact**" in card and "exact low-rank" not in card, card
    assert hashlib.sha256(b.gguf.read_bytes()).hexdigest() in card, card
    kl = b.report["figures"]["held_out_samples"]["patched"]["kl"]
    assert f"| {kl:.3g} |" in card, card
    found = b.report["artefacts"]["lora"]["peft"]
    assert found["vs_full_context"]["bound"] is None, "a bake is not held to the full context"
    vs = found["vs_patched"]
    assert vs["as_loaded"]["bound"] is None and vs["merged"]["bound"] > 0, vs
    assert vs["merged"]["max_abs_logit_diff"] <= vs["merged"]["bound"], vs
    config = json.loads((b.out / "lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(b.gguf.parent), config

    (line,) = re.findall(r"^ {4}model = (peft\.AutoPeftModelForCausalLM\..*)$", card, re.M)
    assert 'gguf_file="tiny.gguf"' in line, line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # PEFT reads it when called, the hub at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*_args, **_kwargs):
        raise OSError("this test is offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    line = line.replace("PATH/TO/lora", str(b.out / "lora"))
    served = eval(line, {"peft": peft}).eval()  # the card's own line, as a user runs it
    diff = float((logits(served, b.query).float() - b.patched).abs().max())
    bound = 1e-4 * max(1.0, float(b.patched.abs().max()))
    assert diff <= bound and diff < 1e-3 * b.effect, f"offline PEFT vs patched {diff:.3g}"


@pytest.mark.slow  # an ONNX export
def test_served_ort_adapter_reproduces_the_patched_model(tmp_path) -> None:
    _, _, _, effect, figures = _served(tmp_path, ["ort-adapter"])
    ort = figures["ort-adapter"]
    worst = max(c.max_abs_diff for c in ort.checks)  # onnxruntime + adapter vs torch patched
    assert worst <= ort.tolerance and worst < 1e-2 * effect, f"ORT {worst:.3g}, {effect:.3g}"


def _llama_cpp_vs_patched(model, base, lora, query, patched, effect) -> None:
    """llama.cpp with ``lora.gguf`` on the F32 base GGUF against the torch patched model, within
    4x llama.cpp's own distance from torch on the unpatched model (its floor)."""
    k = len(query)
    served, alone = llama_cpp_logits(
        [
            {"model": base, "lora": str(lora), "ids": query, "k": k},
            {"model": base, "lora": None, "ids": query, "k": k},
        ],
        "lora.gguf",
    )
    floor = float((alone - logits(model, query).float()).abs().max())
    diff = float((served - patched).abs().max())
    assert diff <= 4 * max(floor, 1e-5), f"llama.cpp vs patched {diff:.3g}, floor {floor:.3g}"
    assert diff < 1e-2 * effect, f"llama.cpp vs patched {diff:.3g}, patch effect {effect:.3g}"


def test_unservable_bakes_are_refused_before_loading() -> None:
    fit = BakeOptions(rank=16)
    # From Python the messages name the parameters; the CLI says the flags (test_cli_bake_chunks).
    check_servable(["lora"], BakeOptions(rank=16, method="distill"), "16")  # LoRA pairs alone
    check_servable(["lora"], fit, "16")  # norm-scale moves are the model's: after it loads
    with pytest.raises(CtxcError, match="rank 12 is not one"):
        check_servable(["lora"], BakeOptions(rank=12, linear_only=True), "12")
    with pytest.raises(CtxcError, match="one rank for every module"):
        check_servable(["gguf-lora"], BakeOptions(rank=None, linear_only=True), "full")
    check_servable(["gguf-lora"], BakeOptions(rank=12, linear_only=True), "12")  # any rank
    check_servable(["lora"], BakeOptions(rank=16, method="additive"), "16")
    check_servable(["torch", "onnx"], fit, "16")


@pytest.mark.tiny
@needs_extra("peft")
def test_the_vllm_recipe_asks_each_question_through_its_adapter(gguf_bake, tmp_path) -> None:
    """``examples/serve_vllm.py`` checked without vLLM (issue 54): a stand-in ``vllm`` records
    the engine's arguments and each request; every adapter the script names passes vLLM's
    adapter rules, at a ``max_lora_rank`` vLLM takes; a routed bake's question goes to the
    chunk ``Router.pick`` names, a ``NAME::`` question to the adapter it names, a question
    outside every bake's scope to no adapter (the base model)."""
    import importlib.util
    import sys
    import types

    from ctxc.backends.peft.facts import MAX_LORA_RANKS
    from ctxc.backends.peft.lora_rules import check_vllm_adapter
    from ctxc.bake import CHUNKS_DIR, Router

    b = gguf_bake
    routed = tmp_path / "article"  # a routed bake's layout, each chunk holding b's adapter
    texts = ("w1 w2 w3 about the harbour", "w7 w8 w9 about the mill")
    routed.mkdir()
    Router(("000", "001"), texts, {}).save(routed)
    for chunk in ("000", "001"):
        (routed / CHUNKS_DIR / chunk).mkdir(parents=True)
        (routed / CHUNKS_DIR / chunk / "lora").symlink_to(b.out / "lora")
    seen: dict = {"engine": None, "asked": []}

    class LLM:
        def __init__(self, **kwargs):
            seen["engine"] = kwargs

        def generate(self, prompts, params, lora_request=None):
            seen["asked"].append((prompts, params, lora_request))
            done = types.SimpleNamespace(text=" the answer\nQuestion: more")
            return [types.SimpleNamespace(outputs=[done])]

    vllm = types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **k: k)
    request = types.SimpleNamespace(LoRARequest=lambda *a: a)
    path = Path(__file__).resolve().parents[2] / "examples" / "serve_vllm.py"
    spec = importlib.util.spec_from_file_location("serve_vllm", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    stand_ins = {"vllm": vllm, "vllm.lora": types.ModuleType("vllm.lora")}
    stand_ins["vllm.lora.request"] = request  # type: ignore[assignment]
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "serve_vllm", script)  # its dataclass looks itself up there
        spec.loader.exec_module(script)
        for name, module in stand_ins.items():
            m.setitem(sys.modules, name, module)
        questions = ["What is the mill?", "Where is the harbour?", f"{b.out.name}::Who?"]
        questions.append("What is the capital of Japan?")  # outside every scope: no adapter
        args = ["--base", "base-model", "--bake", str(routed), "--bake", str(b.out)]
        answers = script.main([*args, *(x for q in questions for x in ("--question", q))])
    engine = seen["engine"]
    assert engine["enable_lora"] is True and engine["model"] == "base-model", engine
    assert engine["max_lora_rank"] == 16 and 16 in MAX_LORA_RANKS, engine
    assert answers == ["the answer"] * 4, answers
    *got, (outside, none) = [(prompts[0], lora) for prompts, _, lora in seen["asked"]]
    assert (outside, none) == ("Question: What is the capital of Japan?\nAnswer:", None)
    want = [("What is the mill?", "article/001", 2), ("Where is the harbour?", "article/000", 1)]
    want.append(("Who?", b.out.name, 3))
    for (prompt, lora), (question, name, lora_id) in zip(got, want, strict=True):
        assert prompt == f"Question: {question}\nAnswer:", prompt
        assert lora[:2] == (name, lora_id), (lora, name, lora_id)
        assert check_vllm_adapter(Path(lora[2]), b.model).r == 16, lora
    assert all(p["temperature"] == 0.0 for _, p, _ in seen["asked"]), seen["asked"]
