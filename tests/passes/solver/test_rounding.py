"""Patches that survive other arithmetic (issue 21, MATH.md 12): a tiny FlexOlmo (an MoE behind
a post norm) reloaded by plain Transformers (its default experts kernel, not the solver's
``batched_mm``) and with its weights in fresh, differently laid out tensors, against the plain
forward of context + query. Before MATH.md 12 its scale alone took the move: gains up to 5.3e3
and 1.6e-4 off when reloaded."""

from __future__ import annotations

import pytest
import torch
import transformers

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.core.thresholds import EXACT_ATOL

pytestmark = pytest.mark.tiny


def _flex_olmo(seed: int, hidden: int) -> torch.nn.Module:
    config = transformers.FlexOlmoConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    torch.manual_seed(seed)
    cls = transformers.FlexOlmoForCausalLM
    model = cls._from_config(config, experts_implementation="batched_mm", dtype=torch.float32)
    with torch.no_grad():  # unit norm weights hide bugs (testbed/tiny_models.py)
        for param in model.parameters():
            if param.ndim == 1:
                param.normal_(0.0, 0.5)
    return model.eval()


def _relaid(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight in fresh storage of another layout: transposed, made contiguous, and read
    back through the transpose (a non-contiguous view with the same values)."""
    return {
        k: v.detach().T.contiguous().T if v.ndim == 2 else v.detach().clone()
        for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize(("seed", "hidden"), [(1, 32), (2, 64), (3, 64), (4, 128)])
def test_flex_olmo_survives_a_reload_and_another_layout(tmp_path, seed, hidden):
    model = _flex_olmo(seed, hidden)
    ids = torch.randint(4, 128, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
    result = ctxc.compile(model, None, context_ids=ids[:-1], query_ids=ids[-1:])
    rep = result.report
    scale_blocks = [b for b in rep.blocks if b.output_control == "scale"]
    assert len(scale_blocks) == 3, [(b.path, b.output_control) for b in rep.blocks]
    for b in scale_blocks:  # the experts moved first, the scale took a bounded remainder
        assert any("experts" in p for p in b.delta_norms), (b.path, sorted(b.delta_norms))
        assert b.max_gain < 1e3 and b.rounding_gain <= 1.0 + 1e-6, (b.path, b.max_gain, b)
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([ids])).logits[0, -1]
        control = model(input_ids=torch.tensor([ids[-1:]])).logits[0, -1]
    emit_torch(model, None, result.patch, tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "model"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        reloaded = loaded(input_ids=torch.tensor([ids[-1:]])).logits[0, -1]
        relaid = torch.func.functional_call(
            loaded, _relaid(loaded), (), {"input_ids": torch.tensor([ids[-1:]])}
        ).logits[0, -1]
    for what, got in (("reloaded", reloaded), ("fresh layout", relaid)):
        diff = (got - plain).abs()
        msg = (
            f"{what}: max {float(diff.max()):.3g} mean {float(diff.mean()):.3g} (control "
            f"{float((control - plain).abs().max()):.3g}, largest gain "
            f"{max(b.max_gain for b in scale_blocks):.3g}, rounding gain {rep.rounding_gain:.3g})"
        )
        assert float(diff.max()) <= EXACT_ATOL, msg
    assert float((control - plain).abs().max()) > 1e-2
    assert rep.to_dict()["rounding_gain"] == rep.rounding_gain <= 1.0 + 1e-6
