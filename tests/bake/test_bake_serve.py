"""Servable thought patches (issue 36): a ``linear_only`` bake at a vLLM rank, emitted as
``lora``, ``gguf-lora`` and ``ort-adapter`` through ``emit_checked`` (the code ``ctxc compile
--emit`` runs), each served result compared with ctxc's patched model within its runtime's
floor, far below the patch's own effect (an adapter that changed nothing would fail)."""

from __future__ import annotations

import pytest

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


@pytest.mark.tiny
@needs_extra("peft")
def test_served_lora_reproduces_the_patched_model(tmp_path) -> None:
    model, query, patched, effect, figures = _served(tmp_path, ["lora", "gguf-lora"])
    lora = figures["lora"].peft  # PEFT reload of lora/ (vLLM's rules checked too)
    assert figures["lora"].vllm.r == 16 and not lora.modules_to_save
    assert lora.lora_vs_baked <= 1e-4 * max(1.0, float(patched.abs().max())), lora
    assert lora.lora_vs_baked < 1e-3 * effect, f"PEFT {lora.lora_vs_baked:.3g} vs {effect:.3g}"
    gguf = figures["gguf-lora"]
    assert gguf.applied_vs_patched < 1e-3 * effect, gguf
    if llama_cpp_unavailable() is None:
        assert gguf.llama_cpp is not None, gguf.llama_cpp_skipped
        _llama_cpp_vs_patched(model, tmp_path / "lora.gguf", query, patched, effect)


@pytest.mark.slow  # an ONNX export
def test_served_ort_adapter_reproduces_the_patched_model(tmp_path) -> None:
    _, _, _, effect, figures = _served(tmp_path, ["ort-adapter"])
    ort = figures["ort-adapter"]
    worst = max(c.max_abs_diff for c in ort.checks)  # onnxruntime + adapter vs torch patched
    assert worst <= ort.tolerance and worst < 1e-2 * effect, f"ORT {worst:.3g}, {effect:.3g}"


def _llama_cpp_vs_patched(model, lora, query, patched, effect) -> None:
    """llama.cpp with ``lora.gguf`` on the F32 base against the torch patched model, within
    4x llama.cpp's own distance from torch on the unpatched model (its floor)."""
    from ctxc.backends.gguf.write import write_gguf

    base = lora.parent / "base.gguf"
    write_gguf(model, bpe_tokenizer(), base, "F32")
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
    with pytest.raises(CtxcError, match="bake with linear_only"):
        check_servable(["lora"], fit, "16")
    with pytest.raises(CtxcError, match="rank 12 is not one"):
        check_servable(["lora"], BakeOptions(rank=12, linear_only=True), "12")
    with pytest.raises(CtxcError, match="one rank for every module"):
        check_servable(["gguf-lora"], BakeOptions(rank=None, linear_only=True), "full")
    check_servable(["gguf-lora"], BakeOptions(rank=12, linear_only=True), "12")  # any rank
    check_servable(["lora"], BakeOptions(rank=16, method="additive"), "16")
    check_servable(["torch", "onnx"], fit, "16")
