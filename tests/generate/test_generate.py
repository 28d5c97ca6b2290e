"""The per-token protocol (MATH.md 6) on tiny models, and the `ctxc generate` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ctxc.generate.steps import generate
from testbed.tiny_models import VOCAB, build, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import CliRun, run_cli

pytestmark = pytest.mark.tiny

CONTEXT = torch.randint(4, VOCAB, (18,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_float32_protocol_matches_the_cached_baseline(family: str) -> None:
    model = shared(family)  # built and traced once a session; generate leaves it as it was
    result = generate(model, CONTEXT, 5, update="stable")
    diffs = [s.max_abs_logit_diff for s in result.steps]
    assert result.targets_from.startswith("cached decode"), result.targets_from
    assert result.apply == "lowrank"
    assert [s.step for s in result.steps] == list(range(5))
    assert max(diffs) <= 1e-5, f"max {max(diffs):.3g} mean {sum(diffs) / len(diffs):.3g}"
    assert result.match_rate == 1.0
    # Teacher forcing: the baseline tokens are the greedy continuation of the full model.
    with torch.no_grad():
        ids = torch.tensor([CONTEXT])
        for s in result.steps:
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            assert token == s.baseline_token
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_lora_rule_per_token_is_exact_behind_two_post_norms(family: str) -> None:
    """The cached decode's hooks record the residual between the two branches too (the
    pre-FFN norm's input; OLMo 2's MLP input), the ``lora`` rule's start (MATH.md 10)."""
    model = shared(family)
    result = generate(model, CONTEXT, 4, update="lora")
    diffs = [s.max_abs_logit_diff for s in result.steps]
    assert result.targets_from.startswith("cached decode"), result.targets_from
    assert max(diffs) <= 1e-5, f"max {max(diffs):.3g} mean {sum(diffs) / len(diffs):.3g}"
    assert result.match_rate == 1.0


def test_bfloat16_protocol_applies_low_rank_actions() -> None:
    model = build("gemma3").to(torch.bfloat16)
    result = generate(model, CONTEXT, 4, update="stable")
    diffs = [s.max_abs_logit_diff for s in result.steps]
    assert result.apply == "lowrank"
    assert all(math.isfinite(d) for d in diffs), diffs
    with torch.no_grad():  # the unpatched control: the first query token alone, no context
        full = model(input_ids=torch.tensor([CONTEXT])).logits[0, -1].float()
        alone = model(input_ids=torch.tensor([CONTEXT[-1:]])).logits[0, -1].float()
    control = float((full - alone).abs().max())
    figures = f"max {max(diffs):.3g} mean {sum(diffs) / len(diffs):.3g}, control {control:.3g}"
    # Measured: at most 3.9e-3 (one bfloat16 step at these logits), control 0.61; 10x margin.
    assert max(diffs) <= 0.04, figures
    assert control >= 10 * max(diffs), figures


def _generate(model, context, steps: int, out) -> CliRun:
    args = ["--model", str(model), "--context", str(context), "--out", str(out)]
    return run_cli("generate", *args, "--max-new-tokens", str(steps))


@needs_extra("plot")
def test_cli_writes_json_and_plot(tiny_model_dir, tmp_path) -> None:
    context = tmp_path / "c.txt"
    context.write_text("w5 w6 w7 w8 w9 w10 w11")
    out = tmp_path / "gen"
    proc = _generate(tiny_model_dir, context, 3, out)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "generate.json").read_text())
    assert len(data["steps"]) == 3
    for key in ("step", "baseline_token", "patched_token", "max_abs_logit_diff", "total_variation"):
        assert key in data["steps"][0], key
    assert (out / "generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_zero_steps(tiny_model_dir, tmp_path) -> None:
    context = tmp_path / "c.txt"
    context.write_text("w5 w6 w7")
    proc = _generate(tiny_model_dir, context, 0, tmp_path / "g")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == ["ctxc: error: --max-new-tokens must be at least 1"], proc.stderr
    assert not (tmp_path / "g").exists()
