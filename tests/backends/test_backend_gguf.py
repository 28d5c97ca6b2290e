"""The lora rule's artefacts: the serving LoRA (vLLM's rules), the LoRA GGUF and the GGUF model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ctxc
from ctxc.backends.gguf.lora import emit_gguf_lora
from ctxc.backends.gguf.model import emit_gguf
from ctxc.backends.peft.lora_adapter import emit_lora
from ctxc.backends.peft.lora_rules import check_vllm_adapter
from ctxc.core.errors import CtxcError
from testbed.tiny_models import bpe_tokenizer, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import diff_msg, max_diff, random_ids, run_cli

pytestmark = pytest.mark.tiny


def test_lora_rule_is_exact_on_llama_and_moves_linear_weights_only() -> None:
    model = shared("llama")
    rep = ctxc.compile(model, context_ids=random_ids(1, 24), update="lora").report
    got, control = rep.emitted.max_abs_logit_diff, rep.control.max_abs_logit_diff
    msg = f"emitted max {got:.3g} mean {rep.emitted.mean_abs_logit_diff:.3g}, control {control:.3g}"
    assert rep.emitted.max_abs_logit_diff <= 1e-5 and rep.emitted.top1_match, msg
    assert rep.control.max_abs_logit_diff > 1e-2, "control too close: the test cannot fail; " + msg
    assert all(b.unreached_norm is not None and b.unreached_norm <= 1e-4 for b in rep.blocks)


def test_lora_rule_on_gemma3_leaves_norms_and_is_exact_behind_them() -> None:
    model = shared("gemma3")
    ids = random_ids(2, 20)
    lora = ctxc.compile(model, context_ids=ids, update="lora")
    assert all(d.vector is None for d in lora.patch.deltas.values())
    misses = [b.unreached_norm for b in lora.report.blocks]
    assert all(m is not None and m <= 1e-4 for m in misses), misses
    # Both post norms fixed, o_proj and down_proj moved: exact (MATH.md 10).
    got, control = lora.report.emitted.max_abs_logit_diff, lora.report.control.max_abs_logit_diff
    assert got <= 1e-6 and control > 1e-2, f"lora {got:.3g}, control {control:.3g}"


@needs_extra("peft")
def test_serving_lora_follows_vllm_rules_and_refuses_norm_deltas(tmp_path) -> None:
    model = shared("llama")
    patch = ctxc.compile(model, context_ids=random_ids(3, 20), update="lora").patch
    path, figures = emit_lora(model, patch, tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    assert not config["modules_to_save"] and config["bias"] == "none"
    assert figures.vllm.r == 1 and figures.vllm.max_lora_rank == 1
    assert figures.vllm.module_names == ("down_proj", "gate_proj", "up_proj")
    assert figures.peft.lora.max_abs_logit_diff <= 1e-5, figures.peft.lora

    gemma = shared("gemma3")
    stable = ctxc.compile(gemma, context_ids=random_ids(3, 20), update="stable").patch
    with pytest.raises(CtxcError, match="compile with --update lora"):
        emit_lora(gemma, stable, tmp_path / "refused")

    # Each of vLLM's rules, broken in turn, is caught by the structural check.
    good = json.loads((path / "adapter_config.json").read_text())
    for key, bad in [
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("r", 1024),
        ("rank_pattern", {"x": 2}),
        ("use_dora", True),
    ]:
        (path / "adapter_config.json").write_text(json.dumps({**good, key: bad}))
        with pytest.raises(CtxcError, match="vLLM's adapter rules"):
            check_vllm_adapter(path, model)
    (path / "adapter_config.json").write_text(json.dumps(good))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(
        {**tensors, "base_model.model.model.norm.weight": torch.ones(64)},
        str(path / "adapter_model.safetensors"),
    )
    with pytest.raises(CtxcError, match="not a lora_A/lora_B weight"):
        check_vllm_adapter(path, model)


@pytest.mark.parametrize("gguf_type", ["F32", "BF16"])
def test_gguf_lora_holds_the_patch(tmp_path, gguf_type: str) -> None:
    import gguf

    model = shared("gemma3")
    patch = ctxc.compile(model, context_ids=random_ids(4, 20), update="lora").patch
    path, figures = emit_gguf_lora(model, patch, tmp_path, gguf_type=gguf_type)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    names = {t.name for t in reader.tensors}
    assert "blk.0.ffn_down.weight.lora_a" in names and "blk.2.ffn_up.weight.lora_b" in names
    assert len(names) == 2 * len(patch.deltas) == 2 * figures.pairs
    if gguf_type == "F32":
        assert figures.max_delta_diff <= 1e-6 and figures.applied_vs_patched <= 1e-5, figures
    else:
        assert figures.tolerance is None and figures.max_delta_diff > 0, figures


@pytest.mark.parametrize("gguf_type", ["F32", "F16"])
def test_gguf_model_reloads_in_transformers(tmp_path, gguf_type: str) -> None:
    model = shared("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch = ctxc.compile(model, context_ids=random_ids(5, 24)).patch
    path, figures = emit_gguf(
        model, patch, tmp_path, tokenizer=bpe_tokenizer(), gguf_type=gguf_type
    )
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    with torch.no_grad(), patch.applied(model):
        want = model(torch.tensor([patch.meta.query_ids])).logits[0]
    got = loaded(torch.tensor([patch.meta.query_ids])).logits[0].detach()
    bound = 1e-4 if gguf_type == "F32" else 5e-3  # F16 weights: the format's rounding
    assert max_diff(got, want) <= bound, diff_msg("GGUF reloaded vs patched", got, want)
    assert figures.max_tensor_diff == 0.0, figures
    assert figures.reloaded.top1_match
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert not changed, f"emit_gguf left the model modified: {changed[:3]}"


def test_gemma2_lora_rule_writes_and_reloads_as_gguf(tmp_path) -> None:
    """Gemma 2 (sandwich norms, GGUF arch ``gemma2``): the lora rule's pairs, ``attn_output``
    among them, as ``lora.gguf``, and the patched model as ``model.gguf`` reloaded by
    Transformers' own GGUF loader."""
    import gguf

    model = shared("gemma2")
    patch = ctxc.compile(model, context_ids=random_ids(7, 22), update="lora").patch
    path, lora = emit_gguf_lora(model, patch, tmp_path / "l", tokenizer=bpe_tokenizer())
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.1.attn_output.weight.lora_a" in names and len(names) == 2 * len(patch.deltas)
    assert lora.applied_vs_patched <= 1e-5 and lora.applied.max_abs_logit_diff <= 1e-6, lora
    model_path, figures = emit_gguf(model, patch, tmp_path / "m", tokenizer=bpe_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), gguf_file=model_path.name)
    with torch.no_grad(), patch.applied(model):
        want = model(torch.tensor([patch.meta.query_ids])).logits[0]
    got = loaded(torch.tensor([patch.meta.query_ids])).logits[0].detach()
    assert max_diff(got, want) <= 1e-5, diff_msg("gemma2 GGUF reloaded vs patched", got, want)
    assert figures.reloaded.top1_match, figures


def test_a_config_the_gguf_loader_cannot_rebuild_is_one_line(tmp_path) -> None:
    """Tiny Qwen 3 has head_dim 16; Transformers' GGUF loader reads no head_dim for qwen3 and
    rebuilds 128: a one-line refusal, not an internal error."""
    model = shared("qwen3")
    patch = ctxc.compile(model, context_ids=random_ids(8, 16)).patch
    with pytest.raises(CtxcError, match="rebuilds this model with other parameter shapes"):
        emit_gguf(model, patch, tmp_path, tokenizer=bpe_tokenizer())


def _model_dir(tmp_path, family: str):
    folder = tmp_path / family
    shared(family).save_pretrained(str(folder))
    bpe_tokenizer().save_pretrained(str(folder))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(" ".join(f"w{i}" for i in random_ids(6, 20)))
    return folder, ctx


@needs_extra("peft")
def test_cli_emits_lora_gguf_and_gguf_lora(tmp_path) -> None:
    folder, ctx = _model_dir(tmp_path, "llama")
    out = tmp_path / "out"
    proc = run_cli(
        "compile",
        "--model",
        str(folder),
        "--context",
        str(ctx),
        "--update",
        "lora",
        "--emit",
        "lora,gguf,gguf-lora",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["gguf"]["reloaded_vs_patched"] <= 1e-4
    assert report["lora"]["vllm"]["r"] == 1
    assert report["gguf-lora"]["applied_vs_patched"] <= 1e-4
    assert (out / "model.gguf").is_file() and (out / "lora.gguf").is_file()
    assert (out / "lora" / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    ("family", "emit", "update", "expected"),
    [
        ("gpt2", "gguf", "stable", "GGUF writer does not know model type 'gpt2'"),
        pytest.param(
            "gemma3", "lora", "stable", "compile with --update lora", marks=needs_extra("peft")
        ),
    ],
)
def test_cli_refuses_what_the_target_cannot_hold(tmp_path, family, emit, update, expected):
    folder, ctx = _model_dir(tmp_path, family)
    out = tmp_path / "out"
    proc = run_cli(
        "compile",
        "--model",
        str(folder),
        "--context",
        str(ctx),
        "--update",
        update,
        "--emit",
        emit,
        "--out",
        str(out),
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("ctxc: error:") and expected in lines[0], lines
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
