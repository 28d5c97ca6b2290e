"""An ``o_proj`` delta (``attn_output`` in GGUF) in the LoRA-only artefacts (issue 23): the
linear-only rule moves ``o_proj`` behind a post-attention norm, so ``--emit lora`` (vLLM's rules)
and ``lora.gguf`` (llama.cpp) must carry it, and llama.cpp must apply it. The delta here is a
seeded one added to a ``lora`` patch: these tests check the artefacts, not the rule.
"""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.backends.gguf.llama_cpp.run import llama_cpp_logits, llama_cpp_unavailable
from ctxc.backends.gguf.lora import write_gguf_lora
from ctxc.backends.gguf.write import write_gguf
from ctxc.backends.peft.lora_adapter import emit_lora
from ctxc.backends.reference import torch_logits
from ctxc.patch import Delta, Patch
from testbed.tiny_models import bpe_tokenizer, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import diff_msg, max_diff, random_ids

pytestmark = pytest.mark.tiny

_REASON = llama_cpp_unavailable()
needs_llama_cpp = pytest.mark.skipif(_REASON is not None, reason=f"llama.cpp: {_REASON}")


def _with_o_proj(model) -> Patch:
    """A ``lora`` patch of a tiny model with a rank-k ``o_proj`` delta added in every block."""
    patch = ctxc.compile(
        model, context_ids=random_ids(50, 20), query_ids=random_ids(51, 3), update="lora"
    ).patch
    k = len(patch.meta.query_ids)
    g = torch.Generator().manual_seed(52)
    deltas = dict(patch.deltas)
    for layer in range(model.config.num_hidden_layers):
        name = f"model.layers.{layer}.self_attn.o_proj.weight"
        out_f, in_f = model.get_parameter(name).shape
        u, v = torch.randn(out_f, k, generator=g), torch.randn(in_f, k, generator=g)
        deltas[name] = Delta(param=name, block=f"model.layers.{layer}", u=0.3 * u, v=0.3 * v)
    return Patch(deltas=deltas, meta=patch.meta)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@needs_extra("peft")
def test_emit_lora_carries_o_proj_within_vllm_rules(tmp_path, family) -> None:
    model = shared(family)
    patch = _with_o_proj(model)
    _, figures = emit_lora(model, patch, tmp_path)
    assert "o_proj" in figures.vllm.module_names, figures.vllm
    assert figures.vllm.modules == len(patch.deltas), figures.vllm


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_lora_gguf_names_o_proj_attn_output(tmp_path, family) -> None:
    model = shared(family)
    names, _ = write_gguf_lora(model, _with_o_proj(model), tmp_path / "lora.gguf")
    layers = model.config.num_hidden_layers
    for layer in range(layers):
        key = f"blk.{layer}.attn_output.weight"
        assert names.get(key) == f"model.layers.{layer}.self_attn.o_proj", sorted(names)


@needs_llama_cpp
def test_llama_cpp_applies_an_attn_output_lora(tmp_path) -> None:
    # Llama: llama.cpp and Transformers agree to ~1e-7 here, so the o_proj pair's effect
    # (0.3 on the logits) would show if llama.cpp skipped or mis-scaled it.
    model = shared("llama")
    patch = _with_o_proj(model)
    base, lora = tmp_path / "base.gguf", tmp_path / "lora.gguf"
    write_gguf(model, bpe_tokenizer(), base)
    write_gguf_lora(model, patch, lora)
    q = list(patch.meta.query_ids)
    (got,) = llama_cpp_logits(
        [{"model": base, "lora": str(lora), "ids": q, "k": len(q)}], "lora.gguf", threads=1
    )
    with patch.applied(model, check=False):
        (want,) = torch_logits(model, [torch.tensor([q])])
    assert max_diff(got, want) <= 1e-5, diff_msg("llama.cpp vs torch, o_proj patched", got, want)
