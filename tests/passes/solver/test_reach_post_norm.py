"""The lora rule's target behind a fixed post-norm scale (passes/solver/reach_post_norm.py)."""

from __future__ import annotations

import pytest
import torch

from ctxc.passes.solver.primitive_moves import ConditionError
from ctxc.passes.solver.reach_post_norm import reachable_outputs
from tests.fixtures.helpers import diff_msg, max_diff


def _scaled(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return s * u / u.double().pow(2).mean(dim=-1, keepdim=True).sqrt().float()  # [k, d]


def test_a_reachable_target_is_met_and_the_magnitude_kept() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(32, generator=g) + 2.0  # [d], no zero
    w = torch.randn(2, 32, generator=g)
    w = w / w.pow(2).mean(dim=-1, keepdim=True).sqrt()  # unit RMS rows
    u = 5.0 * torch.randn(2, 32, generator=g)  # [k, d]
    got = reachable_outputs(s, s * w, u)
    assert max_diff(_scaled(s, got), s * w) <= 1e-5, diff_msg("reached", _scaled(s, got), s * w)
    assert max_diff(got.pow(2).mean(dim=-1), u.pow(2).mean(dim=-1)) <= 1e-3


def test_zero_scales_absorb_the_rms_so_a_small_target_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    s = torch.randn(16, generator=g)
    s[:3] = 0.0
    t = 0.1 * s * torch.randn(16, generator=g)[None]  # [1, d]: needs RMS < 1 on the live part
    got = reachable_outputs(s, t, torch.ones(1, 16))
    assert max_diff(_scaled(s, got), t) <= 1e-6, diff_msg("reached", _scaled(s, got), t)


def test_an_unreachable_target_gets_the_nearest_point() -> None:
    g = torch.Generator().manual_seed(2)
    s = torch.rand(16, generator=g) + 0.5
    t = 10.0 * torch.randn(1, 16, generator=g)  # far outside {s w : mean(w^2) = 1}
    got = _scaled(s, reachable_outputs(s, t, torch.ones(1, 16)))
    miss = float((got - t).norm())
    for seed in range(20):  # no random reachable point is nearer
        w = torch.randn(1, 16, generator=torch.Generator().manual_seed(seed))
        other = s * w / w.pow(2).mean().sqrt()
        assert miss <= float((other - t).norm()) + 1e-4
    with pytest.raises(ConditionError, match="0 at every coordinate"):
        reachable_outputs(torch.zeros(4), torch.ones(1, 4), torch.ones(1, 4))
